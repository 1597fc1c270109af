"""Tiny random checkpoints of every model family the registry serves, built with transformers'
own config classes, with windows shorter than the tests' sequences (8 tokens) so that sliding-window
attention differs from plain causal attention. Shared by the model-level and the engine-level
family tests."""
from __future__ import annotations

from pathlib import Path

import torch

from conftest import save_tiny

WINDOW = 8
BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _config(name: str):
    import transformers as tf

    if name == "mistral-window":
        return tf.MistralConfig(**BASE, sliding_window=WINDOW)
    if name == "qwen2-window":  # the layers from max_window_layers on slide
        return tf.Qwen2Config(**BASE, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    if name == "qwen3":  # head_dim 32 though hidden / heads is 16
        return tf.Qwen3Config(**BASE, head_dim=32, tie_word_embeddings=True)
    if name == "qwen3-yarn":
        return tf.Qwen3Config(**BASE, head_dim=16, rope_parameters=dict(
            rope_type="yarn", factor=4.0, rope_theta=10000.0, original_max_position_embeddings=16))
    if name == "gemma2":  # scale by query_pre_attn_scalar 24, caps small enough to bite
        return tf.Gemma2Config(**BASE, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                               attn_logit_softcapping=1.5, final_logit_softcapping=2.0,
                               hidden_activation="gelu_pytorch_tanh")
    if name == "gemma3":  # sliding, full, sliding: local RoPE base, global RoPE linearly scaled
        return tf.Gemma3TextConfig(**BASE, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
                                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                   rope_parameters={
                                       "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e6),
                                       "sliding_attention": dict(rope_type="default", rope_theta=1e4)})
    if name == "phi3":  # half of each head rotated, longrope, every layer sliding
        rotary_half = 16 * 1 // 2 // 2
        return tf.Phi3Config(**{**BASE, "max_position_embeddings": 256}, sliding_window=WINDOW,
                             original_max_position_embeddings=64,
                             rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5,
                                                  short_factor=[1.0 + 0.1 * i for i in range(rotary_half)],
                                                  long_factor=[2.0 + 0.5 * i for i in range(rotary_half)]))
    if name == "smollm3":  # layers 1 and 3 without RoPE
        return tf.SmolLM3Config(**{**BASE, "num_hidden_layers": 4}, no_rope_layer_interval=2)
    if name == "llama-dynamic":
        return tf.LlamaConfig(**BASE, rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0))
    raise KeyError(name)


FAMILIES = ("mistral-window", "qwen2-window", "qwen3", "qwen3-yarn", "gemma2", "gemma3", "phi3", "smollm3",
            "llama-dynamic")


def save_family(path: Path, name: str, seed: int = 0) -> Path:
    config = _config(name)
    config._attn_implementation = "eager"
    return save_tiny(path, config, seed=seed)


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def save_families(root: Path, seed: int) -> dict[str, Path]:
    """Every family's checkpoint under `root`, by name."""
    return {name: save_family(root / name, name, seed=seed) for name in FAMILIES}
