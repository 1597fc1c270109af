"""Part 15's Triton paged attention with a sliding window and soft-capped scores (Gemma 2's
local layers and logit soft-cap), against the torch reference `paged_attention_ref` given the
same window and cap (which follows HF: a token at position i sees keys i - window < j <= i).

Cases: windows smaller than a block, spanning several blocks and longer than every sequence;
decode rows, fresh prefills longer than the window, prefill chunks on cached context, mixed
batches; GQA and MHA; a soft-cap alone (q scaled up so the scores pass the cap) and with a window.
Each check also shows it can fail: where the window (or cap) matters, the reference with it
differs from the reference without it, so a kernel that ignored it would miss the reference.
One more poisons the K/V of the tiles that lie wholly before every query's window with NaN: the
kernel must start its loop past them (a NaN V times a zero weight is still NaN).

Triton on CPU needs TRITON_INTERPRET=1 before triton is imported, so, as in test_paged_kernels.py,
the checks run in a child process (this file run as a script, printing one JSON line); with a GPU
the child runs the compiled kernels."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from test_paged_kernels import Case, make_batch

REPO = Path(__file__).resolve().parents[1]
ATOL = 1e-5  # fp32 throughout


@dataclass(frozen=True)
class WCase:
    case: Case
    window: int | None
    softcap: float | None = None
    q_gain: float = 1.0  # q scaled up so the scores pass the soft-cap


# (seq_len, q_len) per sequence: decode rows (q_len 1), fresh prefills (q_len == seq_len) and
# chunks on cached context (1 < q_len < seq_len), several longer than a 32-key tile of the kernel.
MIXED = ((1, 1), (6, 1), (40, 1), (37, 37), (40, 9), (30, 12))
CASES = {
    "gqa4-2_d16_bs4_w3_mixed": WCase(Case(4, 2, 16, 4, MIXED), window=3),  # window < a block
    "mha2-2_d32_bs4_w13_mixed": WCase(Case(2, 2, 32, 4, MIXED), window=13),  # spans 3-4 blocks
    "gqa4-2_d16_bs8_w64_mixed": WCase(Case(4, 2, 16, 8, MIXED), window=64),  # > every sequence
    "gqa4-2_d16_bs8_w5_decode_only": WCase(Case(4, 2, 16, 8, ((1, 1), (6, 1), (9, 1), (33, 1), (40, 1))),
                                           window=5),
    "gqa4-2_d16_bs8_w6_prefill": WCase(Case(4, 2, 16, 8, ((40, 40), (38, 38))), window=6),
    "mha2-2_d16_bs8_w6_prefill": WCase(Case(2, 2, 16, 8, ((40, 40), (7, 7))), window=6),
    "gqa4-2_d16_bs4_w4_chunks": WCase(Case(4, 2, 16, 4, ((40, 9), (36, 20), (12, 5))), window=4),
    "gqa4-2_d16_bs4_cap5_mixed": WCase(Case(4, 2, 16, 4, MIXED), window=None, softcap=5.0, q_gain=4.0),
    "gqa4-2_d16_bs8_cap5_decode_only": WCase(Case(4, 2, 16, 8, ((1, 1), (9, 1), (40, 1))), window=None,
                                             softcap=5.0, q_gain=4.0),
    "mha2-2_d32_bs8_w7_cap5_mixed": WCase(Case(2, 2, 32, 8, MIXED), window=7, softcap=5.0, q_gain=4.0),
}
# Decode rows and a chunk far enough in that whole 64-key stretches (a multiple of the kernel's
# key tile) lie before every query's window: their K/V are NaN, which the kernel must never read.
SKIP_CASE = WCase(Case(4, 2, 16, 8, ((70, 1), (100, 1), (72, 4))), window=4)


@pytest.fixture(scope="module")
def results() -> dict:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests"),
                                                       os.environ.get("PYTHONPATH", "")]))
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    # subprocess.run waits for the child, and kills it if it runs past the timeout.
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(CASES))
def test_triton_window_softcap_matches_reference(results, name):
    r, wc = results["cases"][name], CASES[name]
    assert r["finite"] and r["out_is_given_buffer"], r
    assert r["err_vs_ref"] < ATOL, r
    longest = max(s for s, _ in wc.case.seqs)
    if wc.window is not None and wc.window < longest:
        assert r["ref_vs_no_window"] > 1e-2, r  # the window matters: ignoring it would fail
    else:
        assert r["ref_vs_no_window"] < ATOL, r  # a window past every sequence is plain causal
    if wc.softcap is not None:
        assert r["ref_vs_no_softcap"] > 1e-2, r  # the cap matters: ignoring it would fail


def test_triton_window_skips_tiles_before_every_window(results):
    r = results["skip"]
    assert r["poisoned_keys"] > 0 and r["finite"], r
    assert r["err_vs_ref"] < ATOL, r


def test_triton_backend_passes_each_layers_window_and_cap(results):
    r = results["backend"]
    assert r["err_vs_torch_backend"] < ATOL and r["layers_differ"], r


# -- the child process ----------------------------------------------------------------------------

def _batch(wc: WCase, device: str) -> dict:
    """make_batch's batch with part 15's metadata and this step's K/V stored (the reference's copy)."""
    from part15_full.attention_metadata import PagedAttentionMetadata
    from part15_full.paged_attention import reshape_and_cache_ref

    b = make_batch(wc.case, device=device)
    md = b["metadata"]
    b["metadata"] = PagedAttentionMetadata(md.slot_mapping, md.block_tables, md.seq_lens, md.query_start_loc,
                                           md.max_query_len, md.max_seq_len)
    reshape_and_cache_ref(b["k"], b["v"], b["k_cache"], b["v_cache"], b["metadata"].slot_mapping)
    b["q"] = b["q"][:b["num_tokens"]] * wc.q_gain
    return b


def _run_checks() -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    from part15_full import triton_kernels
    from part15_full.paged_attention import TorchAttention, TritonAttention, paged_attention_ref

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return (a.float() - b.float()).abs().max().item()

    def triton_out(b: dict, wc: WCase) -> tuple[torch.Tensor, bool]:
        buffer = torch.full_like(b["q"], math.nan)
        out = triton_kernels.paged_attention(b["q"], b["k_cache"], b["v_cache"], b["metadata"], b["scale"],
                                             buffer, window=wc.window, softcap=wc.softcap)
        return out, out is buffer

    cases = {}
    for name, wc in CASES.items():
        b = _batch(wc, device)

        def ref(window, softcap):
            return paged_attention_ref(b["q"], b["k_cache"], b["v_cache"], b["metadata"], b["scale"],
                                       window=window, softcap=softcap)
        want = ref(wc.window, wc.softcap)
        out, is_buffer = triton_out(b, wc)
        cases[name] = dict(err_vs_ref=err(out, want), finite=bool(torch.isfinite(out).all()),
                           out_is_given_buffer=is_buffer,
                           ref_vs_no_window=err(want, ref(None, wc.softcap)),
                           ref_vs_no_softcap=err(want, ref(wc.window, None)))

    # Poison every key in a whole 64-key stretch before its sequence's first window (the reference
    # runs on the clean cache: those keys are masked, so its answer is the same).
    b = _batch(SKIP_CASE, device)
    want = paged_attention_ref(b["q"], b["k_cache"], b["v_cache"], b["metadata"], b["scale"],
                               window=SKIP_CASE.window)
    bs, poisoned = SKIP_CASE.case.block_size, 0
    for i, (seq_len, q_len) in enumerate(SKIP_CASE.case.seqs):
        first_key = seq_len - q_len - SKIP_CASE.window + 1
        for pos in range(first_key // 64 * 64):
            block = b["metadata"].block_tables[i, pos // bs]
            b["k_cache"][block, pos % bs] = math.nan
            b["v_cache"][block, pos % bs] = math.nan
            poisoned += 1
    out, _ = triton_out(b, SKIP_CASE)
    skip = dict(poisoned_keys=poisoned, finite=bool(torch.isfinite(out).all()), err_vs_ref=err(out, want))

    # The backends: layer 0 slides (window 5), layer 1 is global, both capped; each layer's window
    # must reach the kernel.
    wc = WCase(Case(4, 2, 16, 4, ((1, 1), (20, 1), (14, 14), (24, 7))), window=None, q_gain=4.0)
    b = make_batch(wc.case, device=device)
    n, kv_cache = b["num_tokens"], b["k_cache"]
    kwargs = dict(num_layers=2, num_blocks=kv_cache.shape[0], block_size=kv_cache.shape[1],
                  num_kv_heads=kv_cache.shape[2], head_dim=kv_cache.shape[3], dtype=torch.float32,
                  device=device, sliding_windows=(5, None), logit_softcap=5.0)
    outs = []
    for cls in (TritonAttention, TorchAttention):
        backend = cls(**kwargs)
        backend.k_cache[:], backend.v_cache[:] = b["k_cache"], b["v_cache"]  # the cached context
        outs.append([backend.forward(layer, b["q"] * wc.q_gain, b["k"], b["v"], b["metadata"])[:n]
                     for layer in range(2)])
    backend_result = dict(err_vs_torch_backend=max(err(t, r) for t, r in zip(*outs)),
                          layers_differ=err(outs[1][0], outs[1][1]) > 1e-2)
    return dict(device=device, cases=cases, skip=skip, backend=backend_result)


if __name__ == "__main__":
    print(json.dumps(_run_checks()))
