"""A weight format of the tests' own, through the quantization seam (shared/layers.py): the weight
stored transposed, [in, out], with its dims declared (input_dim 0, output_dim 1), and a post-load hook that counts itself.
A model built with it must compute exactly what the dense model computes, on one process and on a
tensor-parallel group: that proves the loaders (merged q/k/v and gate/up slices, column and row
shards) follow each parameter's declared dims instead of assuming the dense layout."""
from __future__ import annotations

import torch
from torch import nn

from shared.layers import LinearMethodBase, QuantizationConfig, set_weight_attrs


class TransposedLinearMethod(LinearMethodBase):
    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, weight_loader):
        weight = nn.Parameter(torch.empty(input_size_per_partition, sum(output_partition_sizes), dtype=params_dtype),
                              requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 0, "output_dim": 1,
                                  "weight_loader": lambda p, w, shard=None: weight_loader(p, w.t(), shard)})
        layer.register_parameter("weight", weight)
        # An integer parameter the format keeps (a counter): no loader may cast or randomise it.
        layer.register_buffer("post_loads", torch.zeros((), dtype=torch.int32))

    def apply(self, layer, x, bias=None):
        out = x @ layer.weight
        return out if bias is None else out + bias

    def process_weights_after_loading(self, layer):
        layer.post_loads += 1


class TransposedConfig(QuantizationConfig):
    """The format for every linear layer whose prefix contains one of `parts` (all by default)."""

    def __init__(self, parts: tuple[str, ...] = ("",)):
        self.parts = parts
        self.prefixes: list[str] = []

    def get_name(self) -> str:
        return "transposed"

    def get_quant_method(self, layer, prefix):
        self.prefixes.append(prefix)
        return TransposedLinearMethod() if any(p in prefix for p in self.parts) else None
