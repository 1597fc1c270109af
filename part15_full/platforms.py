"""The one point where a device's own pieces plug into the stage, chosen once at start-up.

A platform may contribute three things: the layers the model is built from (a layer factory
wrapping the stage's), an attention backend, and a graph runner (graph_runner.py's seam). The base
`Platform` contributes none of them: the stage's own pieces serve, which on a GPU are Triton
attention and CUDA graphs. On a CPU the platform is the CPU appendix's `CpuPlatform`
(cpu/platform.py: fused elementwise kernels and GEMMs per layer, the C paged-attention kernel, the
graph runner that replays a step as one loop of kernel calls), named here by its qualified name so
the stage imports the appendix only on a CPU.

In vLLM v0.33.0: vllm/platforms/__init__.py (current_platform, resolved by qualified name),
vllm/platforms/interface.py (Platform) and vllm/platforms/cpu.py (CpuPlatform)."""
from __future__ import annotations

import importlib

import torch

from shared.model import LayerFactory

CPU_PLATFORM = "part15_full.cpu.platform.CpuPlatform"


class Platform:
    """A device with nothing of its own: every method returns what the stage already has (or None)."""

    def layers(self, layers: LayerFactory) -> LayerFactory:
        """The factory the model's layers are built with."""
        return layers

    def attention_backend(self, *args, **kwargs):
        """A PagedAttention backend of this device's own, for get_attention_backend's arguments, or
        None. (The platform names no module of the stage's: the backends and runners import it.)"""
        return None

    def graph_runner(self, model: torch.nn.Module, attn):
        """A GraphRunner of this device's own for steps without CUDA graphs, or None (the modules'
        forward)."""
        return None


def resolve_obj_by_qualname(qualname: str):
    """'package.module.Name' -> the object, importing the module (vLLM: vllm/utils/import_utils.py)."""
    module, _, name = qualname.rpartition(".")
    return getattr(importlib.import_module(module), name)


def current_platform(device: torch.device | str) -> Platform:
    """The platform of `device`: the CPU appendix's on a CPU, else the base one."""
    if torch.device(device).type == "cpu":
        return resolve_obj_by_qualname(CPU_PLATFORM)()
    return Platform()
