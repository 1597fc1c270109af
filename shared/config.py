"""ModelConfig: the few architecture facts the engine needs, read from an HF config.

Every family's config is read here into the same fields (what differs in its layers is the family's
model file's, shared/models/). Sliding-window attention, soft-capped attention scores and a custom
attention scale need an attention backend that implements them (part 15's); a part whose backends
do not (`per_layer_attention=False`) caps the context at the window, within which sliding-window
attention is plain causal attention, and refuses the other two."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "smollm3")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")
# Families whose config has a use_sliding_window switch, off unless set; the others slide whenever
# sliding_window is set.
_WINDOW_SWITCH = ("qwen2", "qwen3", "smollm3")
# How far each rope type stretches the context (vLLM's rule): linear, dynamic and yarn multiply it
# by `factor`; llama3 and longrope configs already state the stretched length.
_STRETCHES = ("linear", "dynamic", "yarn")


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
    architecture: str = "LlamaForCausalLM"  # config.json's `architectures[0]`: the registry's key
    # Per layer: "full_attention" or "sliding_attention" (empty: every layer full).
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None  # keys a sliding layer's token sees, itself included
    attn_logit_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: the same on the logits
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by its -1/2 power, not head_dim's
    partial_rotary_factor: float = 1.0  # the share of each head that RoPE rotates (Phi-4-mini 0.75)
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' RoPE base (no scaling)
    no_rope_layers: tuple[int, ...] = ()  # SmolLM3: indices of layers without RoPE

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window, None for a full-attention layer."""
        types = self.layer_types or ("full_attention",) * self.num_hidden_layers
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in types)

    @classmethod
    def from_hf(cls, hf: Any, eos_token_ids: tuple[int, ...] = (),
                per_layer_attention: bool = False) -> "ModelConfig":
        model_type = hf.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        gemma = model_type.startswith("gemma")
        act = getattr(hf, "hidden_activation", None) if gemma else getattr(hf, "hidden_act", "silu")
        act = act or getattr(hf, "hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden activation {act!r} is not supported ({', '.join(ACTIVATIONS)})")
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        layers = hf.num_hidden_layers
        theta, scaling, local_theta, partial = _rope(hf)
        max_len = hf.max_position_embeddings
        if scaling and scaling["rope_type"] in _STRETCHES:
            max_len = int((scaling.get("original_max_position_embeddings") or max_len) * scaling["factor"])
        window = getattr(hf, "sliding_window", None)
        if window and getattr(hf, "use_sliding_window", model_type not in _WINDOW_SWITCH):
            layer_types = tuple(getattr(hf, "layer_types", None) or ("sliding_attention",) * layers)
        else:
            window, layer_types = None, ()
        if "sliding_attention" not in layer_types:
            window, layer_types = None, ()
        softcap = getattr(hf, "attn_logit_softcapping", None) if gemma else None
        scalar = getattr(hf, "query_pre_attn_scalar", None) if gemma else None
        if not per_layer_attention:
            if softcap:
                raise ValueError(f"{model_type}'s soft-capped attention scores need part 15's attention backends")
            if scalar and scalar != head_dim:
                raise ValueError(f"{model_type}'s attention scale (query_pre_attn_scalar {scalar}) needs part 15's "
                                 f"attention backends")
            if window:
                # Within the window, sliding-window attention is plain causal attention: cap the
                # context there rather than silently diverge beyond it.
                logger.info("%s has %d-token sliding-window layers; this part's attention has no sliding window, "
                            "so the context is capped at %d tokens (part 15 attends as the model does)",
                            model_type, window, window)
                max_len = min(max_len, window)
            window = None  # every layer attends causally (the layer types still pick Gemma 3's RoPE)
        eos = eos_token_ids or _as_tuple(getattr(hf, "eos_token_id", None))
        bias = bool(getattr(hf, "attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=max_len,
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bias,
            o_proj_bias=model_type != "qwen2" and bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            hidden_act=act,
            eos_token_ids=eos,
            bos_token_id=getattr(hf, "bos_token_id", None),
            architecture=(getattr(hf, "architectures", None) or ["LlamaForCausalLM"])[0],
            layer_types=layer_types,
            sliding_window=window,
            attn_logit_softcap=softcap,
            final_logit_softcap=getattr(hf, "final_logit_softcapping", None) if gemma else None,
            query_pre_attn_scalar=scalar,
            partial_rotary_factor=float(partial),
            rope_local_theta=local_theta,
            no_rope_layers=tuple(i for i, rope in enumerate(getattr(hf, "no_rope_layers", None) or ()) if not rope)
            if model_type == "smollm3" else (),
        )


def _rope(hf: Any) -> tuple[float, dict[str, Any] | None, float | None, float]:
    """(theta, scaling or None, the sliding layers' theta (Gemma 3) or None, partial rotary factor).
    transformers >= 5 folds theta, the scaling and the partial factor into `rope_parameters`, per
    layer type for Gemma 3; older ones keep `rope_theta`, `rope_scaling`, `rope_local_base_freq`."""
    params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    local_theta = None
    if "full_attention" in params or "sliding_attention" in params:
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"scaled RoPE on sliding layers ({local['rope_type']}) is not supported")
        local_theta = local.get("rope_theta")
        params = dict(params.get("full_attention") or {})
    elif hf.model_type == "gemma3_text":
        local_theta = getattr(hf, "rope_local_base_freq", 10000.0)
    theta = params.pop("rope_theta", None) or getattr(hf, "rope_theta", 10000.0)
    partial = params.pop("partial_rotary_factor", None) or getattr(hf, "partial_rotary_factor", 1.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = "longrope" if rope_type == "su" else rope_type
    if rope_type == "default":
        return theta, None, local_theta, partial
    scaling = {**params, "rope_type": rope_type}
    if rope_type in ("dynamic", "yarn", "longrope") and not scaling.get("original_max_position_embeddings"):
        # The trained context: max_position_embeddings, but Phi-3 keeps it at the top level.
        scaling["original_max_position_embeddings"] = (
            getattr(hf, "original_max_position_embeddings", None) if rope_type == "longrope" else None) \
            or hf.max_position_embeddings
    return theta, scaling, local_theta, partial


def _as_tuple(x: Any) -> tuple[int, ...]:
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (list, tuple)) else (int(x),)
