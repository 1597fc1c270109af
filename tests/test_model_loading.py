"""Loading real checkpoints: tiny randomly initialised HF models saved by the test itself (never
downloaded) must give the same logits through our loader and model as through transformers;
hub ids resolve through the HF cache; bad paths and architectures fail clearly; and the GGUF
conversion of the embedded model equals transformers' own GGUF loader."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import save_tiny
from shared.attention import NoCacheAttention
from shared.forward_context import set_forward_context
from shared.weights import load_config, load_model, resolve_model_path

CPU = torch.device("cpu")
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)


def hf_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids[None]).logits[0].float()


def our_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    model = load_model(path, CPU, torch.float32)
    assert next(model.parameters()).dtype == torch.float32
    with torch.no_grad(), set_forward_context(NoCacheAttention(model.config.head_dim ** -0.5)):
        hidden = model(ids, torch.arange(ids.numel()))
        return model.compute_logits(hidden)


def random_ids(n: int, vocab: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def assert_same_logits(path: Path, n_tokens: int = 24, seed: int = 0) -> torch.Tensor:
    ids = random_ids(n_tokens, seed=seed)
    ref = hf_logits(path, ids)
    ours = our_logits(path, ids)
    assert ours.shape == ref.shape == (n_tokens, 128)
    assert ref.abs().max() > 0.5, "degenerate reference: logits too small to compare"
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    return ref


# ----------------------------------------------------------------------------- architectures

def _llama(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY, **kw})


def _qwen2(**kw):
    from transformers import Qwen2Config

    return Qwen2Config(**{**TINY, **kw})


def _mistral(**kw):
    from transformers import MistralConfig

    return MistralConfig(**{**TINY, **kw})


CASES = {
    "llama-gqa-untied": lambda: _llama(tie_word_embeddings=False),
    "llama-gqa-tied": lambda: _llama(tie_word_embeddings=True),
    "llama-mha": lambda: _llama(num_key_value_heads=4),
    "llama-mqa-bias": lambda: _llama(num_key_value_heads=1, attention_bias=True, mlp_bias=True),
    "llama-rope-linear": lambda: _llama(rope_parameters=dict(rope_type="linear", factor=4.0,
                                                             rope_theta=10000.0)),
    "qwen2-bias-tied": lambda: _qwen2(tie_word_embeddings=True, rope_parameters=dict(
        rope_type="default", rope_theta=1e6)),
    "qwen2-bias-untied": lambda: _qwen2(tie_word_embeddings=False),
    "mistral-head-dim": lambda: _mistral(head_dim=32),  # head_dim != hidden / heads
}


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(tmp_path, case):
    path = save_tiny(tmp_path / case, CASES[case](), seed=len(case))
    assert_same_logits(path, n_tokens=24, seed=1)


def test_config_facts(tmp_path):
    path = save_tiny(tmp_path / "m", _qwen2(tie_word_embeddings=True))
    cfg = load_config(path)
    assert (cfg.model_type, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == \
        ("qwen2", 4, 2, 16)
    assert cfg.qkv_bias and not cfg.o_proj_bias and cfg.tie_word_embeddings
    path = save_tiny(tmp_path / "b", _llama(attention_bias=True))
    cfg = load_config(path)
    assert cfg.qkv_bias and cfg.o_proj_bias and not cfg.tie_word_embeddings
    path = save_tiny(tmp_path / "mis", _mistral(head_dim=32))
    assert load_config(path).head_dim == 32


def test_llama3_rope_scaling(tmp_path):
    """Positions past original_max_position_embeddings, where the scaling matters."""
    from transformers import AutoModelForCausalLM

    config = _llama(rope_parameters=dict(LLAMA3_ROPE, rope_theta=500000.0))
    path = save_tiny(tmp_path / "llama3", config, seed=3)
    cfg = load_config(path)
    assert cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.rope_theta == 500000.0
    ref = assert_same_logits(path, n_tokens=160, seed=2)
    # The check can fail: the same weights without scaling give clearly different logits.
    plain = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, rope_parameters=dict(rope_type="default", rope_theta=500000.0)).eval()
    assert plain.config.rope_parameters["rope_type"] == "default"
    with torch.no_grad():
        unscaled = plain(random_ids(160, seed=2)[None]).logits[0]
    assert (unscaled - ref).abs().max() > 1e-2


def test_legacy_rope_scaling_config_json(tmp_path):
    """Hub checkpoints written before transformers 5 carry `rope_scaling` and a top-level
    `rope_theta` (Llama 3.1's config.json looks like this)."""
    config = _llama(rope_parameters=dict(LLAMA3_ROPE, rope_theta=500000.0))
    path = save_tiny(tmp_path / "legacy", config, seed=4)
    raw = json.loads((path / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    raw["rope_scaling"] = rope
    (path / "config.json").write_text(json.dumps(raw))
    cfg = load_config(path)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    assert_same_logits(path, n_tokens=100, seed=3)


def test_unsupported_rope_type_is_refused(tmp_path):
    path = save_tiny(tmp_path / "mrope", _llama())
    raw = json.loads((path / "config.json").read_text())
    raw["rope_parameters"] = dict(rope_type="mrope", rope_theta=10000.0)
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="mrope"):
        load_model(path, CPU, torch.float32)


def test_sharded_checkpoint(tmp_path):
    path = save_tiny(tmp_path / "sharded", _llama(), seed=5, max_shard_size="100KB")
    assert len(list(path.glob("*.safetensors"))) > 1
    assert_same_logits(path)


def test_eos_from_generation_config(tmp_path):
    path = save_tiny(tmp_path / "eos", _llama())
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_config(path).eos_token_ids == (2, 7)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert load_config(path).eos_token_ids == (5,)
    (path / "generation_config.json").unlink()
    assert load_config(path).eos_token_ids == (2,)  # falls back to config.json


@pytest.mark.parametrize("missing", ["model.layers.1.mlp.up_proj.weight",
                                     "model.layers.0.self_attn.k_proj.weight",
                                     "model.layers.0.self_attn.q_proj.bias",
                                     "model.layers.1.post_attention_layernorm.weight",
                                     "lm_head.weight"])
def test_missing_tensor_is_an_error(tmp_path, missing):
    """A checkpoint that lacks any tensor, even one slice of a merged projection, is refused
    instead of leaving uninitialised memory in the model."""
    from safetensors.torch import load_file, save_file

    path = save_tiny(tmp_path / "broken", _llama(attention_bias=True))
    state = load_file(str(path / "model.safetensors"))
    del state[missing]
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks"):
        load_model(path, CPU, torch.float32)


def test_folder_without_weights(tmp_path):
    path = save_tiny(tmp_path / "noweights", _llama())
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError):
        load_model(path, CPU, torch.float32)


# ------------------------------------------------------------------------ paths and failures

def test_local_folder_resolves_to_itself(tmp_path):
    path = save_tiny(tmp_path / "local", _llama())
    assert resolve_model_path(str(path)) == path


@pytest.mark.parametrize("name", ["/nonexistent/folder/model", "./no-such-model-dir",
                                  "~/no-such-model-dir-xyz", "a/b/c"])
def test_missing_local_folder(name):
    with pytest.raises(FileNotFoundError):
        resolve_model_path(name)


def test_file_instead_of_folder(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"not a folder")
    with pytest.raises((FileNotFoundError, NotADirectoryError)):
        resolve_model_path(str(f))


def test_unsupported_model_type(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="gpt2"):
        load_config(tmp_path)


def test_unsupported_activation(tmp_path):
    _llama(hidden_act="relu").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="relu"):
        load_config(tmp_path)


# ------------------------------------------------------------------------------- hub ids

@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An HF cache in tmp_path. huggingface_hub reads HF_HUB_CACHE / HF_HUB_OFFLINE into
    `huggingface_hub.constants` at import time, so set both the environment and the constants."""
    import huggingface_hub
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    calls = []
    real = huggingface_hub.snapshot_download

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", spy)
    return cache, calls


def test_hub_id_resolves_from_cache(tmp_path, offline_hub):
    cache, calls = offline_hub
    src = save_tiny(tmp_path / "src", _llama(), seed=6)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--testorg--tiny-llama"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in src.iterdir():  # the real cache layout: snapshot files link to content blobs
        blob = repo / "blobs" / f"blob-{f.name}"
        shutil.copy(f, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)

    path = resolve_model_path("testorg/tiny-llama")
    assert len(calls) == 1 and calls[0][1]["repo_id"] == "testorg/tiny-llama"
    assert Path(path).resolve() == snapshot.resolve()
    ids = random_ids(16, seed=4)
    torch.testing.assert_close(our_logits(Path(path), ids), hf_logits(src, ids), atol=1e-4, rtol=1e-4)


def test_hub_id_not_cached_offline_fails(offline_hub):
    _, calls = offline_hub
    # huggingface_hub's LocalEntryNotFoundError is a FileNotFoundError: no network was tried.
    with pytest.raises(FileNotFoundError):
        resolve_model_path("testorg/not-in-cache")
    assert len(calls) == 1


# ----------------------------------------------------------------------------------- GGUF

def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head, head_dim, cols", [(9, 64, 576), (3, 64, 576), (4, 8, 5), (2, 6, None)])
def test_unpermute_inverts_llama_cpp_permute(n_head, head_dim, cols):
    from shared.gguf_convert import unpermute

    rng = np.random.default_rng(n_head * 100 + head_dim)
    shape = (n_head * head_dim,) + ((cols,) if cols else ())
    w = rng.standard_normal(shape).astype(np.float32)
    permuted = llama_cpp_permute(w, n_head)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute(permuted, n_head), w)
    np.testing.assert_array_equal(llama_cpp_permute(unpermute(w, n_head), n_head), w)


def test_unpermute_layout():
    """Within one head, llama.cpp interleaves the two rotary halves: rows (x0, y0, x1, y1, ...)
    must become HF's (x0, x1, ..., y0, y1, ...)."""
    from shared.gguf_convert import unpermute

    head_dim = 6
    hf_rows = np.arange(2 * head_dim, dtype=np.float32)  # 2 heads; per head x = 0..2, y = 3..5
    interleaved = np.array([0, 3, 1, 4, 2, 5, 6, 9, 7, 10, 8, 11], dtype=np.float32)
    np.testing.assert_array_equal(llama_cpp_permute(hf_rows, 2), interleaved)
    np.testing.assert_array_equal(unpermute(interleaved, 2), hf_rows)


@pytest.fixture(scope="module")
def hf_gguf_state():
    from transformers import AutoModelForCausalLM

    from shared.gguf_convert import find_gguf

    pytest.importorskip("accelerate")  # transformers' GGUF loader needs it
    gguf = find_gguf()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return model.config, {k: v.detach() for k, v in model.state_dict().items()}


def test_gguf_conversion_matches_transformers(hf_gguf_state):
    from shared.gguf_convert import find_gguf, gguf_state_dict

    hf_config, hf_state = hf_gguf_state
    ours = gguf_state_dict(find_gguf())
    expected = set(hf_state)
    if hf_config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    assert expected <= set(ours)
    assert set(ours) - expected <= {"lm_head.weight"}
    for name in sorted(expected):
        assert ours[name].dtype == torch.float32
        assert torch.equal(ours[name], hf_state[name]), name


def test_cached_conversion_matches_transformers(hf_gguf_state, model_path):
    """The converted folder the engine and the HF oracle both load (possibly written by an
    earlier version of the converter) holds exactly transformers' GGUF weights and config."""
    from safetensors.torch import load_file

    hf_config, hf_state = hf_gguf_state
    cached = load_file(str(Path(model_path) / "model.safetensors"))
    for name, tensor in hf_state.items():
        if name == "lm_head.weight" and hf_config.tie_word_embeddings:
            assert name not in cached or torch.equal(cached[name], tensor)
            continue
        assert torch.equal(cached[name], tensor), name
    cfg = load_config(Path(model_path))
    assert cfg.num_hidden_layers == hf_config.num_hidden_layers
    assert cfg.num_attention_heads == hf_config.num_attention_heads
    assert cfg.num_key_value_heads == hf_config.num_key_value_heads
    assert cfg.rope_theta == hf_config.rope_parameters["rope_theta"]
    assert cfg.tie_word_embeddings == hf_config.tie_word_embeddings
    assert cfg.vocab_size == hf_config.vocab_size


# ----------------------------------------------------------------------------- config.json without transformers

def _with_every_field_left_out(path: Path):
    """The folder's config.json as written, then with each of its fields left out in turn."""
    full = json.loads((path / "config.json").read_text())
    yield "nothing"
    for key in full:
        (path / "config.json").write_text(json.dumps({k: v for k, v in full.items() if k != key}))
        yield key


MOE = {"mixtral": lambda: __import__("transformers").MixtralConfig(**{**TINY, "num_local_experts": 4}),
       "qwen2_moe": lambda: __import__("transformers").Qwen2MoeConfig(
           **{**TINY, "num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48})}


@pytest.mark.parametrize("case", [*CASES, *MOE])
def test_config_read_from_the_file_equals_transformers_reading(tmp_path, case):
    """Engines and workers read config.json themselves (importing transformers costs seconds a
    process); where the file leaves out a field whose default only the model's class knows, they
    ask transformers. Either way, with any one field missing, the result is transformers' own.
    A long context and 4 heads make the class defaults visible (Mistral's 4096-token window, Qwen2's
    32 KV heads, Llama's bos and eos ids)."""
    from transformers import AutoConfig

    from part15_full.moe_config import load_configs
    from shared.config import ModelConfig
    from shared.weights import generation_eos_token_ids

    config = (CASES.get(case) or MOE[case])()
    config.max_position_embeddings = 32768
    config.save_pretrained(tmp_path)
    for left_out in _with_every_field_left_out(tmp_path):
        try:
            hf = AutoConfig.from_pretrained(tmp_path)
        except Exception:  # noqa: BLE001 - transformers itself refuses the file (no model_type, ...)
            continue
        if case in MOE:
            from part15_full.moe_config import ATTENTION_OF, MoEConfig

            dense = __import__("copy").copy(hf)
            dense.model_type = ATTENTION_OF[hf.model_type]
            want = ModelConfig.from_hf(dense, eos_token_ids=generation_eos_token_ids(tmp_path)), MoEConfig.from_hf(hf)
            assert load_configs(tmp_path) == want, left_out
        else:
            want = ModelConfig.from_hf(hf, eos_token_ids=generation_eos_token_ids(tmp_path))
            assert load_config(tmp_path) == want, left_out


def test_a_mistral_file_without_its_window_falls_back_to_the_class_default(tmp_path):
    """The fallback above is needed: read naively, this file has no window at all."""
    config = _mistral()
    config.max_position_embeddings = 32768
    config.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("sliding_window", None)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_config(tmp_path).max_position_embeddings == 4096  # MistralConfig's sliding_window


def test_loading_the_embedded_model_does_not_import_transformers():
    """The speed this is for: an engine process starts without transformers (seconds per process)."""
    import subprocess
    import sys

    code = ("import sys; from part04_continuous_batching import LLM; from shared.sampling_params import "
            "SamplingParams; llm = LLM(device='cpu', dtype='float32'); "
            "llm.generate('Hi', SamplingParams(max_tokens=2)); assert 'transformers' not in sys.modules, 'imported'")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
