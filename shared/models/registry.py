"""The model registry: config.json's `architectures[0]` names the class that builds the model.

Llama, Mistral and Qwen2 are one class (shared/model.py): they differ only in config values (biases,
RoPE base, window), which ModelConfig reads. Each other family subclasses it in its own file and
overrides what it changes. A part that adds layers of its own (part 11's experts) reuses these
classes through its LayerFactory.

In vLLM: vllm/model_executor/models/registry.py (`_TEXT_GENERATION_MODELS`, architecture -> module
and class, imported lazily)."""
from __future__ import annotations

from torch import nn

from ..model import LlamaForCausalLM
from .gemma2 import Gemma2ForCausalLM
from .gemma3 import Gemma3ForCausalLM
from .phi3 import Phi3ForCausalLM
from .qwen3 import Qwen3ForCausalLM
from .smollm3 import SmolLM3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
}


def get_model_class(architecture: str, extra: tuple[str, ...] = ()) -> type[nn.Module]:
    """The class of `architecture`, or a ValueError naming it and every supported one (with `extra`:
    those a part adds, such as its MoE families)."""
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: "
                         f"{', '.join([*MODEL_REGISTRY, *extra])}")
    return MODEL_REGISTRY[architecture]
