"""The CPU appendix of part 15: what exists only to make the engine fast without a GPU (its lesson
is README.md beside this file). The stage reaches it at three points, each chosen once at start-up:
the model runner's layer factory (layers.CpuLayers: fused elementwise kernels and each linear
layer's GEMM), the attention backend (paged_attention.get_attention_backend -> attention.CpuAttention)
and the runner seam (graph_runner.make_graph_runner -> graph_runner.CpuGraphRunner)."""
