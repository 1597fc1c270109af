"""Part 03 paged attention: the torch reference against dead-simple dense attention, and the
Triton kernels against the torch reference.

Triton on CPU needs TRITON_INTERPRET=1 *before* triton is first imported, and other tests in the
same pytest process import it early (transformers does). So the Triton checks run in a child
process: this file run as a script (`python tests/test_paged_kernels.py`) does them all and
prints one JSON line that the tests below read. With a GPU the child runs the compiled kernels
instead (and adds a bf16 case, which the interpreter cannot do: its bf16 tl.dot is broken)."""
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

from part03_paged_attention.kv_cache_manager import KVCacheManager, cdiv, compute_slot_mapping
from part03_paged_attention.attention_metadata import PagedAttentionMetadata
from part03_paged_attention.paged_attention import PagedAttention, paged_attention_ref, reshape_and_cache_ref

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Case:
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    seqs: tuple[tuple[int, int], ...]  # (seq_len, q_len) per sequence, in batch order
    dtype: torch.dtype = torch.float32
    gpu_only: bool = False


# Lengths at and around block boundaries (1, bs-1, bs, bs+1, 2bs), mixing decode (q_len 1),
# fresh prefill (q_len == seq_len) and prefill on cached context (1 < q_len < seq_len).
CASES = {
    "gqa4-2_d16_bs4_mixed": Case(4, 2, 16, 4, ((1, 1), (3, 1), (9, 3), (4, 4), (5, 1), (8, 1),
                                                (5, 5), (8, 4), (7, 2))),
    "smollm9-3_d64_bs16_mixed": Case(9, 3, 64, 16, ((15, 1), (16, 16), (1, 1), (17, 1), (33, 2),
                                                    (32, 1), (17, 17), (32, 15))),
    "smollm9-3_d64_bs16_decode_only": Case(9, 3, 64, 16, ((1, 1), (15, 1), (16, 1), (17, 1),
                                                          (33, 1))),
    "mha2-2_d32_bs16": Case(2, 2, 32, 16, ((31, 31), (16, 1), (18, 3))),
    "mqa4-1_d24_bs8": Case(4, 1, 24, 8, ((8, 8), (9, 1), (17, 9))),  # head_dim not a power of 2
    "fp16_gqa4-2_d16_bs4": Case(4, 2, 16, 4, ((5, 1), (8, 8), (9, 2)), dtype=torch.float16),
    "bf16_smollm9-3_d64_bs16": Case(9, 3, 64, 16, ((17, 1), (16, 16), (33, 2)),
                                    dtype=torch.bfloat16, gpu_only=True),
}
ATOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
NUM_PAD_TOKENS = 2  # trailing padding tokens (slot -1) whose K/V must not be stored


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The definition, in float64: q [n, H, D] are the last n of L positions; k, v [L, KV, D]."""
    n, length = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(length - n, length)
    scores = scores.masked_fill(torch.arange(length)[None, :] > q_pos[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def make_batch(case: Case, seed: int = 0, device: str = "cpu") -> dict:
    """A flattened batch for `case`: q/k/v of the new tokens (views of one fused QKV tensor, as
    the model hands them), caches already holding each sequence's context in scattered blocks
    (the rest random garbage), the metadata, and each sequence's full dense K/V."""
    g = torch.Generator().manual_seed(seed)
    bs, kv, d = case.block_size, case.kv_heads, case.head_dim
    num_blocks = 1 + sum(cdiv(s, bs) for s, _ in case.seqs) + 3
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # scattered, never block 0
    k_cache = torch.randn(num_blocks, bs, kv, d, generator=g)
    v_cache = torch.randn(num_blocks, bs, kv, d, generator=g)
    tables, dense_k, dense_v, new_k, new_v = [], [], [], [], []
    for seq_len, q_len in case.seqs:
        blocks, ids = ids[:cdiv(seq_len, bs)], ids[cdiv(seq_len, bs):]
        tables.append(blocks)
        k_full, v_full = torch.randn(2, seq_len, kv, d, generator=g)
        context = torch.tensor(compute_slot_mapping(blocks, bs, 0, seq_len - q_len), dtype=torch.long)
        k_cache.view(-1, kv, d)[context] = k_full[:seq_len - q_len]
        v_cache.view(-1, kv, d)[context] = v_full[:seq_len - q_len]
        dense_k.append(k_full), dense_v.append(v_full)
        new_k.append(k_full[seq_len - q_len:]), new_v.append(v_full[seq_len - q_len:])
    num_tokens = sum(q for _, q in case.seqs)
    qkv = torch.randn(num_tokens + NUM_PAD_TOKENS, (case.heads + 2 * kv) * d, generator=g)
    q, k, v = qkv.split([case.heads * d, kv * d, kv * d], dim=-1)
    q, k, v = q.view(-1, case.heads, d), k.view(-1, kv, d), v.view(-1, kv, d)
    k[:num_tokens], v[:num_tokens] = torch.cat(new_k), torch.cat(new_v)
    metadata = PagedAttentionMetadata.build(tables, [s for s, _ in case.seqs],
                                            [q for _, q in case.seqs], bs, device)
    metadata.slot_mapping = torch.cat([metadata.slot_mapping,
                                       torch.full((NUM_PAD_TOKENS,), -1, device=device)])

    def to(x: torch.Tensor) -> torch.Tensor:
        return x.to(device=device, dtype=case.dtype)

    return dict(q=to(q), k=to(k), v=to(v), k_cache=to(k_cache), v_cache=to(v_cache),
                metadata=metadata, num_tokens=num_tokens, scale=d ** -0.5,
                dense_k=[to(x).cpu() for x in dense_k], dense_v=[to(x).cpu() for x in dense_v])


def max_err_vs_dense(out: torch.Tensor, batch: dict, case: Case) -> float:
    err, start = 0.0, 0
    for i, (seq_len, q_len) in enumerate(case.seqs):
        want = dense_attention(batch["q"][start:start + q_len].cpu(), batch["dense_k"][i],
                               batch["dense_v"][i], batch["scale"])
        err = max(err, (out[start:start + q_len].cpu().double() - want).abs().max().item())
        start += q_len
    return err


def run_backend_steps(backend: PagedAttention, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Drive a 2-layer backend through 4 engine-like steps with a KVCacheManager: prefill two
    requests, decode both, decode one while the other prefills a chunk on its cached context,
    then admit a third request beside two decodes. Returns (backend outputs, dense outputs)."""
    g = torch.Generator().manual_seed(seed)
    heads, kv, d = 4, backend.k_cache.shape[3], backend.k_cache.shape[4]
    mgr = KVCacheManager(backend.k_cache.shape[1], backend.block_size)
    device = backend.k_cache.device
    history: dict[tuple[str, int], list[torch.Tensor]] = {}  # (request, layer) -> [k, v] so far
    lengths: dict[str, int] = {}
    got, want = [], []
    for step in [[("a", 6), ("b", 3)], [("a", 1), ("b", 1)], [("a", 1), ("b", 5)],
                 [("c", 4), ("a", 1), ("b", 1)]]:
        seq_lens = []
        for req, n in step:
            lengths[req] = lengths.get(req, 0) + n
            assert mgr.allocate_slots(req, lengths[req])
            seq_lens.append(lengths[req])
        metadata = PagedAttentionMetadata.build([mgr.get_block_ids(r) for r, _ in step], seq_lens,
                                                [n for _, n in step], backend.block_size, device)
        num_tokens = sum(n for _, n in step)
        for layer in range(backend.k_cache.shape[0]):
            q = torch.randn(num_tokens, heads, d, generator=g)
            k, v = torch.randn(2, num_tokens, kv, d, generator=g)
            got.append(backend.forward(layer, q.to(device), k.to(device), v.to(device), metadata).cpu())
            start, rows = 0, []
            for req, n in step:
                hk, hv = history.setdefault((req, layer), [k[:0], v[:0]])
                hk, hv = torch.cat([hk, k[start:start + n]]), torch.cat([hv, v[start:start + n]])
                history[(req, layer)] = [hk, hv]
                rows.append(dense_attention(q[start:start + n], hk, hv, backend.scale))
                start += n
            want.append(torch.cat(rows))
    for req in lengths:
        mgr.free(req)
    assert mgr.num_free_blocks == mgr.block_pool.num_blocks - 1
    return got, want


# -- the torch reference (in process) --------------------------------------------------------------

@pytest.mark.parametrize("name", [n for n, c in CASES.items() if not c.gpu_only])
def test_reference_matches_dense_attention(name):
    case = CASES[name]
    batch = make_batch(case)
    reshape_and_cache_ref(batch["k"], batch["v"], batch["k_cache"], batch["v_cache"],
                          batch["metadata"].slot_mapping)
    out = paged_attention_ref(batch["q"][:batch["num_tokens"]], batch["k_cache"], batch["v_cache"],
                              batch["metadata"], batch["scale"])
    assert out.shape == (batch["num_tokens"], case.heads, case.head_dim) and out.dtype == case.dtype
    assert max_err_vs_dense(out, batch, case) < ATOL[case.dtype]


def test_reshape_and_cache_ref_writes_only_its_slots():
    case = CASES["gqa4-2_d16_bs4_mixed"]
    batch = make_batch(case)
    k_cache, v_cache = batch["k_cache"].clone(), batch["v_cache"].clone()
    slots = batch["metadata"].slot_mapping
    reshape_and_cache_ref(batch["k"], batch["v"], k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, 2, 16), v_cache.view(-1, 2, 16)
    n = batch["num_tokens"]
    assert torch.equal(flat_k[slots[:n]], batch["k"][:n]) and torch.equal(flat_v[slots[:n]], batch["v"][:n])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots[:n]] = False
    assert torch.equal(flat_k[untouched], batch["k_cache"].view(-1, 2, 16)[untouched])
    assert torch.equal(flat_v[untouched], batch["v_cache"].view(-1, 2, 16)[untouched])


def test_metadata_build():
    md = PagedAttentionMetadata.build([[3, 1], [2], [5, 6, 7]], seq_lens=[6, 1, 9],
                                      query_lens=[6, 1, 2], block_size=4)
    assert md.query_start_loc.tolist() == [0, 6, 7, 9]
    assert md.block_tables.tolist() == [[3, 1, 0], [2, 0, 0], [5, 6, 7]]  # padded with block 0
    assert md.seq_lens.tolist() == [6, 1, 9]
    assert md.slot_mapping.tolist() == [12, 13, 14, 15, 4, 5, 8, 27, 28]
    assert (md.max_query_len, md.max_seq_len, md.num_seqs) == (6, 9, 3)
    assert md.slot_mapping.dtype == torch.int64 and md.block_tables.dtype == torch.int32
    assert md.seq_lens.dtype == torch.int32 and md.query_start_loc.dtype == torch.int32


def test_backend_defaults_to_reference_on_cpu():
    backend = PagedAttention(num_layers=3, num_blocks=10, block_size=16, num_kv_heads=3,
                             head_dim=64, dtype=torch.float32, device="cpu")
    assert not backend.use_triton and backend.scale == 64 ** -0.5
    assert backend.k_cache.shape == (3, 10, 16, 3, 64)
    assert backend.nbytes == 2 * 3 * 10 * 16 * 3 * 64 * 4


def test_backend_over_engine_steps_matches_dense():
    backend = PagedAttention(num_layers=2, num_blocks=12, block_size=4, num_kv_heads=2,
                             head_dim=16, dtype=torch.float32, device="cpu", use_triton=False)
    got, want = run_backend_steps(backend)
    for g, w in zip(got, want):
        assert (g.double() - w).abs().max() < 1e-4


# -- the Triton kernels (in a child process) -------------------------------------------------------

@pytest.fixture(scope="module")
def triton_results() -> dict:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(CASES))
def test_triton_kernels_match_reference(triton_results, name):
    result = triton_results["cases"][name]
    if result is None:
        pytest.skip("needs a GPU: the Triton interpreter cannot run bf16 tl.dot")
    dtype = CASES[name].dtype
    assert result["cache_equal"], "reshape_and_cache stored different K/V than the reference"
    assert result["err_vs_ref"] < ATOL[dtype], result
    assert result["err_vs_dense"] < ATOL[dtype], result
    assert result["out_is_given_buffer"]


def test_triton_backend_over_engine_steps(triton_results):
    result = triton_results["backend_steps"]
    assert result["err_vs_dense"] < 1e-4 and result["err_vs_ref_backend"] < 1e-4, result


def _run_triton_checks() -> dict:
    """The child process: every case through both implementations."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    from part03_paged_attention import triton_kernels

    cases: dict[str, dict | None] = {}
    for name, case in CASES.items():
        if case.gpu_only and device == "cpu":
            cases[name] = None
            continue
        batch = make_batch(case, device=device)
        n, md = batch["num_tokens"], batch["metadata"]
        ref_k, ref_v = batch["k_cache"].clone(), batch["v_cache"].clone()
        reshape_and_cache_ref(batch["k"], batch["v"], ref_k, ref_v, md.slot_mapping)
        tri_k, tri_v = batch["k_cache"].clone(), batch["v_cache"].clone()
        triton_kernels.reshape_and_cache(batch["k"], batch["v"], tri_k, tri_v, md.slot_mapping)
        ref = paged_attention_ref(batch["q"][:n], ref_k, ref_v, md, batch["scale"])
        buffer = torch.full_like(ref, math.nan)
        out = triton_kernels.paged_attention(batch["q"][:n], tri_k, tri_v, md, batch["scale"], out=buffer)
        cases[name] = dict(cache_equal=torch.equal(ref_k, tri_k) and torch.equal(ref_v, tri_v),
                           err_vs_ref=(out.float() - ref.float()).abs().max().item(),
                           err_vs_dense=max_err_vs_dense(out, batch, case),
                           out_is_given_buffer=out is buffer)

    def backend(use_triton: bool) -> PagedAttention:
        return PagedAttention(num_layers=2, num_blocks=12, block_size=4, num_kv_heads=2,
                              head_dim=16, dtype=torch.float32, device=device, use_triton=use_triton)

    got, want = run_backend_steps(backend(True))
    ref_got, _ = run_backend_steps(backend(False))
    steps = dict(err_vs_dense=max((g.double() - w).abs().max().item() for g, w in zip(got, want)),
                 err_vs_ref_backend=max((g - r).abs().max().item() for g, r in zip(got, ref_got)))
    return dict(device=device, cases=cases, backend_steps=steps)


if __name__ == "__main__":
    print(json.dumps(_run_triton_checks()))
