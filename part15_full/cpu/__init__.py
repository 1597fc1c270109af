"""The CPU appendix of part 15: what exists only to make the engine fast without a GPU (its lesson
is README.md beside this file). The stage reaches it at one point, chosen once at start-up:
platform.py's CpuPlatform, resolved by its qualified name on a CPU (../platforms.py), which hands
out the layers (layers.CpuLayers: fused elementwise kernels and each linear layer's GEMM), the
attention backend (attention.CpuAttention) and the graph runner (graph_runner.CpuGraphRunner).
Their switches are in envs.py."""
