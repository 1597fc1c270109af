"""Part 15 builds its Triton kernels' variants at start-up only. Triton compiles a kernel once per
set of constants and per "specialization" of its other arguments: each integer argument equal to 1,
divisible by 16 or neither, each pointer 16-byte aligned or not. A block table whose row stride grew
with the longest sequence (1, then 2-15, then 16) or a first prefill step after start-up would each
compile a new variant in the middle of a run, on a GPU a stall of seconds. Here every launch's
specialization key is recorded (Triton runs interpreted, so the key is computed as Triton computes
it), and a varied workload (prompts from 3 to 90 tokens, block tables from 1 to 24 blocks wide,
chunked prefill beside decodes) must add none after start-up. Without the start-up warm-up
(`ModelRunner._warm_up`) the same run adds some: the check can fail.

Under TRITON_INTERPRET=1, set before triton is imported: so the engine runs in a child process, this
file run as a script, which prints one JSON line."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import run_interpreted_script


@pytest.fixture(scope="module")
def variants(tmp_path_factory) -> dict:
    return run_interpreted_script(__file__, tmp_path_factory.mktemp("variants"))


def test_no_kernel_variant_is_built_after_start_up(variants):
    r = variants["warmed"]
    assert r["at_start"] >= 3, r  # reshape_and_cache, and attention for decode and for prefill
    assert r["after_run"] == r["at_start"], r["new"]
    assert r["tokens"] == r["hf"]


def test_without_the_warm_up_variants_appear_mid_run(variants):
    r = variants["cold"]
    assert r["after_run"] > r["at_start"], r


def specialization(args: tuple, kwargs: dict) -> tuple:
    """Triton's key for a launch: the constants, and per other argument its specialization."""
    import torch

    def spec(a):
        if isinstance(a, torch.Tensor):
            return ("ptr", str(a.dtype), a.data_ptr() % 16 == 0)
        if isinstance(a, bool) or not isinstance(a, int):
            return type(a).__name__
        return ("int", a == 1, a % 16 == 0)
    return tuple(spec(a) for a in args) + tuple(sorted(kwargs.items()))


def _run(tmp: Path) -> dict:
    import torch
    import transformers

    from conftest import greedy, hf_greedy_tokens, save_tiny
    from part15_full import LLM, model_runner, triton_kernels

    class Recorded:  # kernel[grid](*args, **constants), each launch's key recorded
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                keys.add((self.name, specialization(args, kwargs)))
                return self.kernel[grid](*args, **kwargs)
            return launch
    for name in ("_paged_attention_kernel", "_reshape_and_cache_kernel"):
        setattr(triton_kernels, name, Recorded(name, getattr(triton_kernels, name)))

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    path = save_tiny(tmp / "llama", config, seed=5, scale=0.3)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (3, 17, 40, 90, 8)]
    result = {}
    for name, warm in (("warmed", True), ("cold", False)):
        keys: set = set()
        if not warm:
            model_runner.ModelRunner._warm_up = lambda self: None
        llm = LLM(model=str(path), device="cpu", dtype="float32", use_triton=True, kv_cache_memory_mb=4,
                  max_num_seqs=4, max_num_batched_tokens=32, block_size=4)
        at_start = set(keys)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(6))
        result[name] = {"at_start": len(at_start), "after_run": len(keys),
                        "new": sorted(str(k) for k in keys - at_start),
                        "tokens": [o.outputs[0].token_ids for o in outs]}
        llm.shutdown()
    result["warmed"]["hf"] = hf_greedy_tokens(path, prompts, 6)
    return result


if __name__ == "__main__":
    print(json.dumps(_run(Path(sys.argv[1]))))
