"""ModelConfig: the few architecture facts the engine needs, read from an HF config."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 always; Llama when attention_bias
    o_proj_bias: bool = False  # Llama when attention_bias; never Qwen2
    mlp_bias: bool = False
    hidden_act: str = "silu"
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bos_token_id: int | None = None

    @classmethod
    def from_hf(cls, hf: Any, eos_token_ids: tuple[int, ...] = ()) -> "ModelConfig":
        model_type = hf.model_type
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"model_type {model_type!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf.hidden_act!r} is not supported (only silu)")
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        # transformers >= 5 folds theta and scaling into `rope_parameters`; older ones do not.
        rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
        theta = rope.pop("rope_theta", None) or getattr(hf, "rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        eos = eos_token_ids or _as_tuple(getattr(hf, "eos_token_id", None))
        max_len = hf.max_position_embeddings
        window = getattr(hf, "sliding_window", None)
        if window and getattr(hf, "use_sliding_window", model_type == "mistral"):
            # No sliding-window attention here: within the window it is plain causal attention,
            # so cap the usable context at the window rather than silently diverge beyond it.
            max_len = min(max_len, window)
        return cls(
            model_type=model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_hidden_layers=hf.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=max_len,
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(getattr(hf, "attention_bias", False)),
            o_proj_bias=model_type != "qwen2" and bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            eos_token_ids=eos,
            bos_token_id=getattr(hf, "bos_token_id", None),
        )


def _as_tuple(x: Any) -> tuple[int, ...]:
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (list, tuple)) else (int(x),)
