"""Part 14 on whole engines: weight-only int8 / int4 through the quantization seam.

- The embedded model in int8 (per output channel): its teacher-forced next-token choices agree with
  fp32's at nearly every prompt position, its logits stay within a measured bound, and greedy
  generation follows fp32's for the first tokens on nearly every prompt (a quantized model is a
  different model: long greedy runs diverge at near-ties, so longer runs are compared by perplexity).
- Perplexity on Python's help-topics text orders the formats: fp32 <= int8 < int4 g32 < int4 g128.
- The weights' bytes: the quantized layers hold 1/4 (int8) and about 1/8 (int4) of their fp32 bytes.
- TP 2 quantized computes what TP 1 quantized computes (float64: only summation order differs).
- `quantization=None` is part 13's engine (the cross-part parity suite runs it against HF).
Pack/unpack, kernels, GPTQ loading, the online methods and MoE experts are tested layer by layer
in test_part14_quant_utils.py, test_part14_quant_kernels.py, test_part14_gptq.py and
test_part14_quantization.py."""
from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from conftest import build_llm, free_port, greedy, save_tiny
from shared.attention import NoCacheAttention
from shared.forward_context import set_forward_context

PART = "part14_quant"


@pytest.fixture(scope="module")
def engines():
    made = {q: build_llm(PART, kv_cache_memory_mb=16, quantization=q) for q in (None, "int8")}
    yield made
    for llm in made.values():
        llm.shutdown()


def teacher_forced(llm, ids):
    model = llm.engine.executor.runner.model
    t = torch.tensor(ids)
    with torch.inference_mode(), set_forward_context(NoCacheAttention(model.config.head_dim ** -0.5)):
        return model.compute_logits(model(t, torch.arange(len(t))))


def test_int8_follows_fp32_on_the_prompt_set(engines, prompt_token_ids):
    fp, q8 = engines[None], engines["int8"]
    agree, worst = [], 0.0
    for ids in prompt_token_ids:
        a, b = teacher_forced(fp, ids), teacher_forced(q8, ids)
        agree.append((a.argmax(-1) == b.argmax(-1)).float().mean().item())
        worst = max(worst, (a - b).abs().max().item())
    # Measured on this model: agreement 0.97-1.0 per prompt, worst logit difference 1.93.
    assert min(agree) >= 0.95 and worst <= 2.5, (agree, worst)
    outs = [o.outputs[0].token_ids for o in fp.generate([list(p) for p in prompt_token_ids], greedy(4))]
    outs8 = [o.outputs[0].token_ids for o in q8.generate([list(p) for p in prompt_token_ids], greedy(4))]
    assert sum(a == b for a, b in zip(outs, outs8)) >= len(outs) - 1


def test_perplexity_orders_the_formats():
    from shared.bench.perplexity import run_perplexity

    ppl = {}
    for q, g in ((None, 128), ("int8", 128), ("int4", 32), ("int4", 128)):
        ppl[q, g] = run_perplexity(PART, 512, 512, device="cpu", dtype="float32", kv_cache_memory_mb=8,
                                   quantization=q, quantization_group_size=g).perplexity
    assert ppl[None, 128] <= ppl["int8", 128] * 1.01 < ppl["int4", 32] < ppl["int4", 128], ppl


def weight_bytes(model, quantized: bool) -> int:
    """Bytes of the projection layers' weight parameters (and their scales)."""
    total = 0
    for m in model.modules():
        if getattr(m, "prefix", "").endswith("proj"):
            for name, p in m.named_parameters(recurse=False):
                if name != "bias":
                    total += p.numel() * p.element_size()
    return total


def test_quantized_layers_hold_a_quarter_and_an_eighth_of_the_bytes(engines):
    fp = weight_bytes(engines[None].engine.executor.runner.model, False)
    q8 = weight_bytes(engines["int8"].engine.executor.runner.model, True)
    q4 = build_llm(PART, kv_cache_memory_mb=8, quantization="int4", quantization_group_size=128)
    try:
        b4 = weight_bytes(q4.engine.executor.runner.model, True)
    finally:
        q4.shutdown()
    assert 0.25 <= q8 / fp <= 0.25 * 1.01  # 1 byte a weight, plus a scale per output row
    # Half a byte, plus an fp32 scale per 128 weights, and the padding of 576 inputs to 640: at most
    # (0.5 + 4 / 128) / 4 * 640 / 576 = 0.148.
    assert 0.125 <= b4 / fp <= 0.148


def _rank_logits(rank: int, size: int, path: str, port: int, out: str) -> None:
    import torch.distributed as dist

    from part14_quant.parallel_layers import TensorParallelLayers
    from part14_quant.quantization import Int4WeightOnlyConfig
    from shared.weights import load_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        from pathlib import Path

        layers = TensorParallelLayers(rank, size, Int4WeightOnlyConfig(16)) if size > 1 else None
        model = load_model(Path(path), torch.device("cpu"), torch.float64, layers=layers)
        ids = torch.tensor([1, 5, 9, 33, 2, 77, 4, 100])
        with torch.no_grad(), set_forward_context(NoCacheAttention(model.config.head_dim ** -0.5)):
            torch.save(model.compute_logits(model(ids, torch.arange(len(ids)))), f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_tp2_quantized_equals_tp1_quantized(tmp_path):
    """Groups of 16 along each row-parallel shard of 64 inputs: the ranks quantize exactly the groups
    the single process does, so only the order of the sums differs (float64)."""
    from transformers import LlamaConfig

    from part14_quant.quantization import Int4WeightOnlyConfig
    from shared.model import LayerFactory
    from shared.weights import load_model

    path = save_tiny(tmp_path / "tiny", LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                     max_position_embeddings=64, tie_word_embeddings=False), scale=0.3)
    mp.spawn(_rank_logits, args=(2, str(path), free_port(), str(tmp_path)), nprocs=2, join=True)
    single = load_model(path, torch.device("cpu"), torch.float64, layers=LayerFactory(Int4WeightOnlyConfig(16)))
    ids = torch.tensor([1, 5, 9, 33, 2, 77, 4, 100])
    with torch.no_grad(), set_forward_context(NoCacheAttention(single.config.head_dim ** -0.5)):
        want = single.compute_logits(single(ids, torch.arange(len(ids))))
    for r in range(2):
        torch.testing.assert_close(torch.load(tmp_path / f"rank{r}.pt"), want, rtol=0, atol=1e-10)
