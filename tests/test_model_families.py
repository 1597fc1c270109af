"""The model families of shared/models/ against transformers, model by model: a tiny random
checkpoint of each (tests/model_families.py), its logits over 40 tokens (five windows' worth)
within 1e-4 of HF's eager fp32 forward, with dense attention that slides and caps per layer as the
config says. The RoPE scalings against transformers' own functions. What a part without per-layer
attention does with such a model: caps the context at the window, or refuses."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from model_families import FAMILIES, WINDOW, hf_model, save_families
from shared.attention import sdpa
from shared.forward_context import AttentionBackend, set_forward_context
from shared.weights import load_config, load_model

CPU = torch.device("cpu")
N = 40


class DenseAttention(AttentionBackend):
    """Every token of one sequence at once, each layer with its window, the model's scale and cap."""

    def __init__(self, cfg, windows=None):
        self.cfg, self.windows = cfg, windows or cfg.layer_windows

    def forward(self, layer_idx, q, k, v, metadata=None):
        return sdpa(q, k, v, self.cfg.attention_scale, window=self.windows[layer_idx],
                    softcap=self.cfg.attn_logit_softcap)


def ours(path: Path, ids: torch.Tensor, max_positions: int | None = None, **attention) -> torch.Tensor:
    cfg = load_config(path, per_layer_attention=True)
    model = load_model(path, CPU, torch.float32, max_positions, cfg=cfg)
    with torch.no_grad(), set_forward_context(DenseAttention(cfg, **attention)):
        return model.compute_logits(model(ids, torch.arange(ids.numel())))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return save_families(tmp_path_factory.mktemp("families"), seed=3)


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_transformers(folders, name):
    ids = torch.randint(3, 128, (N,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf_model(folders[name])(ids[None]).logits[0]
    # Dynamic NTK is HF's up to the trained context only: serve no longer than that here.
    got = ours(folders[name], ids, 512 if name == "llama-dynamic" else None)
    assert ref.abs().max() > 0.5
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    cfg = load_config(folders[name], per_layer_attention=True)
    if any(cfg.layer_windows):  # the test can fail: without the windows the logits are others
        plain = ours(folders[name], ids, windows=(None,) * cfg.num_hidden_layers)
        assert (plain[WINDOW:] - ref[WINDOW:]).abs().max() > 1e-3


def test_config_facts(folders):
    cfg = {name: load_config(folders[name], per_layer_attention=True) for name in FAMILIES}
    assert cfg["gemma2"].layer_windows == (WINDOW, None, WINDOW)
    assert cfg["gemma2"].attention_scale == 24 ** -0.5 and cfg["gemma2"].attn_logit_softcap == 1.5
    assert cfg["gemma2"].final_logit_softcap == 2.0 and cfg["gemma2"].hidden_act == "gelu_pytorch_tanh"
    assert cfg["gemma3"].rope_local_theta == 1e4 and cfg["gemma3"].rope_theta == 1e6
    assert cfg["gemma3"].rope_scaling["rope_type"] == "linear"
    assert cfg["qwen2-window"].layer_windows == (None, WINDOW, WINDOW)
    assert cfg["mistral-window"].layer_windows == (WINDOW,) * 3
    assert cfg["phi3"].rotary_dim == 8 and cfg["phi3"].rope_scaling["original_max_position_embeddings"] == 64
    assert cfg["smollm3"].no_rope_layers == (1, 3)
    assert cfg["qwen3"].head_dim == 32 and not cfg["qwen3"].qkv_bias
    # Stretched contexts, by vLLM's rule: yarn's trained context times its factor, dynamic's too.
    assert cfg["qwen3-yarn"].max_position_embeddings == 16 * 4
    assert cfg["llama-dynamic"].max_position_embeddings == 512 * 2
    assert {name: type(load_model(folders[name], CPU, torch.float32, cfg=c, load_format="dummy")).__name__
            for name, c in cfg.items()} == {
        "mistral-window": "LlamaForCausalLM", "qwen2-window": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
        "qwen3-yarn": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
        "phi3": "Phi3ForCausalLM", "smollm3": "SmolLM3ForCausalLM", "llama-dynamic": "LlamaForCausalLM"}


def test_a_part_without_windows_caps_the_context_and_refuses_capped_scores(folders, caplog):
    with caplog.at_level(logging.INFO):
        cfg = load_config(folders["gemma3"])
    assert cfg.max_position_embeddings == WINDOW and cfg.layer_windows == (None,) * 3
    assert "capped at 8 tokens" in caplog.text
    assert cfg.layer_types[1] == "full_attention"  # Gemma 3's local RoPE still follows the layer types
    with pytest.raises(ValueError, match="soft-capped attention scores need part 15"):
        load_config(folders["gemma2"])
    # Within the window the capped model is exact.
    ids = torch.randint(3, 128, (WINDOW,), generator=torch.Generator().manual_seed(2))
    model = load_model(folders["gemma3"], CPU, torch.float32, cfg=cfg)
    with torch.no_grad(), set_forward_context(DenseAttention(cfg)):
        got = model.compute_logits(model(ids, torch.arange(WINDOW)))
        ref = hf_model(folders["gemma3"])(ids[None]).logits[0]
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_an_unsupported_architecture_is_refused_naming_the_supported(tmp_path):
    from shared.models.registry import get_model_class

    with pytest.raises(ValueError, match=r"'GPT2LMHeadModel' is not supported; supported: LlamaForCausalLM, .*"
                                         r"Gemma3ForCausalLM, Phi3ForCausalLM, SmolLM3ForCausalLM"):
        get_model_class("GPT2LMHeadModel")


@pytest.mark.parametrize("params", [
    dict(rope_type="linear", factor=3.0),
    dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=64),
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
    dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=64, beta_fast=16, beta_slow=2,
         mscale=1.0, mscale_all_dim=0.5),
    dict(rope_type="dynamic", factor=2.0),
])
def test_rope_frequencies_match_transformers(params):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from shared.rotary_embedding import rope_inv_freq

    hf = LlamaConfig(hidden_size=256, num_attention_heads=2, max_position_embeddings=256,
                     rope_parameters={**params, "rope_theta": 10000.0})
    # Dynamic NTK: HF's frequencies at a sequence of 384 tokens; ours for an engine serving 384.
    ref, ref_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, "cpu", **(
        {"seq_len": 384} if params["rope_type"] == "dynamic" else {}))
    scaling = dict(params, original_max_position_embeddings=params.get("original_max_position_embeddings", 256))
    got, factor = rope_inv_freq(128, 10000.0, scaling, max_position=384)
    torch.testing.assert_close(got, ref.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(ref_factor)


def test_longrope_takes_short_factors_inside_the_trained_context_and_long_ones_beyond():
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from shared.rotary_embedding import RotaryEmbedding

    short, long = [1.0 + 0.1 * i for i in range(8)], [2.0 + 0.5 * i for i in range(8)]
    params = dict(rope_type="longrope", rope_theta=10000.0, short_factor=short, long_factor=long)
    hf = Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
                    original_max_position_embeddings=64, rope_parameters=params)
    ref_short, att = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu")
    ref_long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=100)
    rotary = RotaryEmbedding(16, 256, 10000.0, dict(params, original_max_position_embeddings=64))
    for position, inv_freq in ((63, ref_short), (64, ref_long), (200, ref_long)):
        expected = torch.cat([position * inv_freq] * 2).float()
        torch.testing.assert_close(rotary.cos[position], expected.cos() * att, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(ref_short, ref_long)
