"""The CPU appendix's one plug-in point: `CpuPlatform`, which part 15 resolves by its qualified name
(../platforms.py) on a CPU and asks, once while the engine starts, for its three pieces: the layers
(layers.py: fused elementwise kernels, each linear layer's GEMM; and glibc told to keep freed
activations, malloc.py), the attention backend (attention.py's C kernel, where the model's shapes fit
it) and the graph runner (graph_runner.py: a step replayed as one loop of kernel calls). Each piece
has its off-switch in envs.py; a piece that does not apply returns None and the stage's own serves.

In vLLM v0.33.0: vllm/platforms/cpu.py (CpuPlatform)."""
from __future__ import annotations

import torch

from ..platforms import Platform
from .attention import CpuAttention
from .graph_runner import CpuGraphRunner
from . import malloc
from .layers import CpuLayers, load_ops


class CpuPlatform(Platform):

    def layers(self, layers):
        malloc.tune_malloc()  # freed activations stay in the heap
        return CpuLayers(layers, load_ops())  # fused elementwise kernels; each linear layer's GEMM

    def attention_backend(self, *args, **kwargs) -> CpuAttention | None:
        return CpuAttention.create(*args, **kwargs)

    def graph_runner(self, model: torch.nn.Module, attn) -> CpuGraphRunner | None:
        return CpuGraphRunner.build(model, attn)
