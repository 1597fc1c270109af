"""Part 15's CPU paged attention: the C kernel that reads K/V blocks in place, against dense
attention in float64 and the torch reference; its build, cache, fallback and off-switch."""
from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path

import pytest
import torch

import part15_full.cpu.attention as cpu_attention
import part15_full.cpu.build as cpu_build
from part15_full.attention_metadata import PagedAttentionMetadata
from part15_full.cpu.kernels import CSRC, bind
from part15_full.paged_attention import (TorchAttention, get_attention_backend, paged_attention_ref,
                                         reshape_and_cache_ref)

from test_paged_kernels import ATOL, CASES, Case, dense_attention, make_batch, max_err_vs_dense, run_backend_steps

# Beyond part 03's cases: decode rows hundreds of tokens long (many blocks, the online softmax
# rescaling across them), speculative-decoding-shaped queries (2-8 new tokens on a context), a
# prefill just over SHORT_QUERY on a short sequence (through the kernel's tiles), a prefill chunk on
# a long cached context (the kernel's tiles too) and a fresh prefill past PREFILL_MAX_LEN in either
# type (the SDPA path) in one batch; head sizes the
# kernel compiles as constants (64, 128) and ones it does not, with and without a remainder past
# its 8-float (row kernel) and 16-float (tiles) vectors; tiles of 16 rows (MHA), 4 and 5 rows with
# a shorter last one, and of one row (16 query heads on a KV head);
# each of those in bf16 too (a bf16 pool, widened as the kernel loads it).
SHAPES = {
    "smollm9-3_d64_bs16_long_and_spec": Case(9, 3, 64, 16, ((300, 1), (129, 1), (47, 1), (200, 8),
                                                            (64, 9), (31, 2), (2, 2), (700, 20),
                                                            (1100, 1100))),
    "gqa8-2_d128_bs32": Case(8, 2, 128, 32, ((70, 1), (33, 3), (40, 40))),
    "gqa6-2_d20_bs8": Case(6, 2, 20, 8, ((45, 1), (19, 4), (6, 6), (30, 12))),
    "mqa3-1_d5_bs4": Case(3, 1, 5, 4, ((23, 1), (7, 2), (23, 10))),
    "mha4-4_d32_bs16_tiles": Case(4, 4, 32, 16, ((50, 20), (17, 1))),
    "gqa16-1_d16_bs8_tiles": Case(16, 1, 16, 8, ((30, 10), (9, 1))),
}
KERNEL_CASES = {
    **{n: c for n, c in CASES.items() if c.dtype == torch.float32},
    **SHAPES,
    **{f"bf16_{n}": dataclasses.replace(c, dtype=torch.bfloat16) for n, c in SHAPES.items()},
}


def assert_matches_dense(out, batch, case):
    """fp32: within 1e-4 of float64 attention. bf16: the kernel sums in fp32 and rounds once, where
    it stores, so each of its outputs is within one bf16 rounding (half a step: at most 2^-8 of its
    size) of float64 attention over the same bf16 inputs, plus fp32's sums; the long prefills that
    go through torch's bf16 SDPA round at every op (part 03's bf16 bound)."""
    if case.dtype == torch.float32:
        assert max_err_vs_dense(out, batch, case) < 1e-4
        return
    assert out.dtype == torch.bfloat16
    start = 0
    for i, (seq_len, q_len) in enumerate(case.seqs):
        want = dense_attention(batch["q"][start:start + q_len], batch["dense_k"][i], batch["dense_v"][i],
                               batch["scale"])
        got = out[start:start + q_len].double()
        if cpu_attention.uses_kernel(q_len, seq_len, case.dtype):
            torch.testing.assert_close(got, want, rtol=2 ** -8, atol=1e-5)
        else:
            assert (got - want).abs().max() < ATOL[torch.bfloat16]
        start += q_len


def windowed_dense(q, k, v, scale, window):
    """dense_attention with HF's sliding window: q [n, H, D] are the last n of L positions, and
    position i sees keys i - window < j <= i."""
    n, length = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos, k_pos = torch.arange(length - n, length)[:, None], torch.arange(length)[None, :]
    seen = (k_pos <= q_pos) & (k_pos > q_pos - window)
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~seen, float("-inf")).softmax(-1), v)


def assert_matches_windowed_dense(out, batch, case, window):
    """assert_matches_dense's bounds, against float64 attention over each row's window."""
    if window is None:
        return assert_matches_dense(out, batch, case)
    start = 0
    for i, (seq_len, q_len) in enumerate(case.seqs):
        want = windowed_dense(batch["q"][start:start + q_len], batch["dense_k"][i], batch["dense_v"][i],
                              batch["scale"], window)
        got = out[start:start + q_len].double()
        if case.dtype == torch.float32:
            assert (got - want).abs().max() < 1e-4, (seq_len, q_len)
        elif cpu_attention.uses_kernel(q_len, seq_len, case.dtype):
            torch.testing.assert_close(got, want, rtol=2 ** -8, atol=1e-5)
        else:
            assert (got - want).abs().max() < ATOL[torch.bfloat16], (seq_len, q_len)
        start += q_len


SOURCE = CSRC / "paged_attention_cpu.c"


class Kernel:
    """The CPU backend over the given pools of one layer: kernel.forward(q, k, v, k_cache, v_cache,
    metadata, scale, window=None) -> out, as the backend computes it for a layer (a sliding-window
    one with `window`)."""

    def __init__(self, lib):
        self.lib = lib

    def forward(self, q, k, v, k_cache, v_cache, metadata, scale, window=None):
        num_blocks, block_size, kv_heads, d = k_cache.shape
        backend = cpu_attention.CpuAttention(1, 1, block_size, kv_heads, d, k_cache.dtype, "cpu", scale,
                                             sliding_windows=(window,), lib=self.lib, num_heads=q.shape[1])
        backend.k_cache, backend.v_cache = k_cache[None], v_cache[None]
        return backend.forward(0, q, k, v, metadata)


@pytest.fixture(scope="module")
def kernel():
    lib = cpu_attention.load_kernel()
    assert lib is not None, "no C compiler here? the set-up installs none; cc must be on PATH"
    return Kernel(lib)


@pytest.mark.parametrize("padding", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_the_kernel_matches_dense_attention_and_the_reference(kernel, name, padding):
    case = KERNEL_CASES[name]
    batch = make_batch(case, seed=1)
    n = batch["num_tokens"]
    q, k, v, metadata = batch["q"], batch["k"], batch["v"], batch["metadata"]
    if q.is_contiguous():  # make_batch's cast to bf16 copied them: views of fused rows again
        fused = torch.cat([x.flatten(1) for x in (q, k, v)], 1)
        q, k, v = (t.view(-1, x.shape[1], x.shape[2]) for t, x in
                   zip(fused.split([x.shape[1] * x.shape[2] for x in (q, k, v)], 1), (q, k, v)))
        batch["q"] = q  # what assert_matches_dense reads
    if not padding:  # no slot -1: the plain row copy stores the new K/V
        q, k, v = q[:n], k[:n], v[:n]
        metadata.slot_mapping = metadata.slot_mapping[:n]
    ref_k, ref_v = batch["k_cache"].clone(), batch["v_cache"].clone()
    reshape_and_cache_ref(k, v, ref_k, ref_v, metadata.slot_mapping)
    want = paged_attention_ref(q[:n], ref_k, ref_v, metadata, batch["scale"])

    assert q.stride(0) > q.shape[1] * q.shape[2]  # a view of the fused QKV rows, as the model gives
    out = kernel.forward(q, k, v, batch["k_cache"], batch["v_cache"], metadata, batch["scale"])[:n]
    assert torch.equal(batch["k_cache"], ref_k) and torch.equal(batch["v_cache"], ref_v)
    assert_matches_dense(out, batch, case)
    if case.dtype == torch.float32:
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
    else:  # the torch reference rounds to bf16 at every op: about a bf16 step apart
        torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("window", [None, 20], ids=["full", "window20"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_threads_split_the_work_without_changing_a_bit(kernel, dtype, window):
    """Decode rows, verification rows and prefill tiles of unequal lengths, split over 1, 2 and 3
    threads (the suite's workers may run on one): each item is summed by one thread, in one order.
    In a sliding-window layer too (the work split then counts a row's window, not its length)."""
    case = dataclasses.replace(SHAPES["smollm9-3_d64_bs16_long_and_spec"], dtype=dtype)
    batch = make_batch(case, seed=5)
    args = (batch["q"], batch["k"], batch["v"], batch["k_cache"], batch["v_cache"], batch["metadata"],
            batch["scale"])
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(kernel.forward(*args, window=window)[:batch["num_tokens"]].clone())
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert_matches_windowed_dense(outs[1], batch, case, window)


def test_the_backend_uses_the_kernel_on_cpu_through_engine_like_steps():
    backend = get_attention_backend(num_layers=2, num_blocks=12, block_size=4, num_heads=4, num_kv_heads=2,
                                    head_dim=8, dtype=torch.float32, device="cpu")
    assert isinstance(backend, cpu_attention.CpuAttention)
    got, want = run_backend_steps(backend, seed=3)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, atol=1e-5, rtol=1e-4)


def test_decode_reads_the_blocks_in_place(kernel, monkeypatch):
    """Short queries, short prefills and chunks on a cached context never gather; a long fresh
    prefill still does (SDPA over its gathered K/V)."""
    gathers = []
    real_gather = cpu_attention.gather_blocks
    monkeypatch.setattr(cpu_attention, "gather_blocks", lambda *a: gathers.append(a) or real_gather(*a))
    for name, expected in (("smollm9-3_d64_bs16_decode_only", 0), ("smollm9-3_d64_bs16_long_and_spec", 2)):
        case = KERNEL_CASES[name]
        batch = make_batch(case)
        kernel.forward(batch["q"], batch["k"], batch["v"], batch["k_cache"], batch["v_cache"],
                       batch["metadata"], batch["scale"])
        assert len(gathers) == expected, name  # the 1100-token prefill: one gather for K, one for V
        gathers.clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_slot_past_the_pool_raises_and_stores_nothing(kernel, dtype):
    """The kernel's K/V store checks every slot before it copies one (a wrong slot mapping must not
    write past the pool); padding slots (-1) are skipped."""
    case = Case(9, 3, 64, 16, ((40, 1), (20, 1)), dtype=dtype)
    batch = make_batch(case)
    k_before, v_before = batch["k_cache"].clone(), batch["v_cache"].clone()
    metadata = batch["metadata"]
    num_slots = batch["k_cache"].shape[0] * case.block_size
    metadata.slot_mapping = metadata.slot_mapping.clone()
    metadata.slot_mapping[1] = num_slots  # token 0 would land in the pool first
    with pytest.raises(IndexError, match="past the KV pool"):
        kernel.forward(batch["q"], batch["k"], batch["v"], batch["k_cache"], batch["v_cache"], metadata,
                       batch["scale"])
    assert torch.equal(batch["k_cache"], k_before) and torch.equal(batch["v_cache"], v_before)


def test_shapes_beyond_the_kernel_take_the_reference_backend():
    """Chosen once, at start-up: the C kernel's backend only for shapes and dtypes it takes."""
    def backend_for(heads=32, block_size=4, dtype=torch.float32):
        return get_attention_backend(num_layers=1, num_blocks=8, block_size=block_size, num_heads=heads,
                                     num_kv_heads=1, head_dim=8, dtype=dtype, device="cpu")
    assert type(backend_for()) is TorchAttention  # 32 query heads on one KV head: over the kernel's 16
    assert type(backend_for(heads=16)) is cpu_attention.CpuAttention
    assert type(backend_for(heads=16, block_size=512)) is TorchAttention  # blocks over 256 tokens
    assert type(backend_for(heads=16, dtype=torch.float64)) is TorchAttention
    backend = backend_for()
    case = Case(32, 1, 8, 4, ((6, 1), (3, 3)))
    batch = make_batch(case)
    backend.k_cache, backend.v_cache = batch["k_cache"][None], batch["v_cache"][None]  # the context
    out = backend.forward(0, batch["q"], batch["k"], batch["v"], batch["metadata"])
    assert max_err_vs_dense(out[:batch["num_tokens"]], batch, case) < 1e-4


def test_a_build_without_openmp_runs_its_own_threads_and_matches(tmp_path, monkeypatch):
    """The fallback for a compiler without -fopenmp: the same kernel on pthreads."""
    monkeypatch.setenv("VLLM_COURSE_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_build, "_FLAG_SETS", (["-O2"],))
    path = cpu_build.build(SOURCE)
    assert path is not None
    kernel = Kernel(bind("paged_attention_cpu.c", path))
    case = KERNEL_CASES["smollm9-3_d64_bs16_long_and_spec"]
    batch = make_batch(case, seed=4)
    n = batch["num_tokens"]
    out = kernel.forward(batch["q"], batch["k"], batch["v"], batch["k_cache"], batch["v_cache"],
                         batch["metadata"], batch["scale"])[:n]
    assert max_err_vs_dense(out, batch, case) < 1e-4


def test_the_build_is_cached_per_source_and_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_COURSE_CACHE", str(tmp_path))
    path = cpu_build.build(SOURCE)
    assert path is not None and path.parent == tmp_path and path.exists()
    assert list(tmp_path.iterdir()) == [path]  # no half-built temporary left behind

    def no_compiling(*args, **kwargs):
        raise AssertionError("compiled again")
    monkeypatch.setattr(cpu_build, "_compile", no_compiling)
    assert cpu_build.build(SOURCE) == path


def test_a_compile_past_the_timeout_is_killed_with_its_children(tmp_path, monkeypatch, caplog):
    """A compiler driver's cc1 runs in a child process: a timeout that killed only the driver
    left it compiling on a core the engine needs. The whole group goes, and the next flags are
    tried; the plainer build that succeeds is logged as a slower kernel."""
    monkeypatch.setenv("VLLM_COURSE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_build, "_TIMEOUT_S", 1.0)
    pids = tmp_path / "pids"
    compiler = tmp_path / "cc"  # hangs (with a child, as gcc's cc1) when asked for OpenMP, else compiles
    compiler.write_text(f"""#!/bin/sh
case "$*" in *-fopenmp*) sleep 60 & echo $! >> {pids}; wait;; esac
exec {shutil.which("cc") or shutil.which("gcc")} "$@"
""")
    compiler.chmod(0o755)
    with caplog.at_level(logging.WARNING):
        path = cpu_build.build(CSRC / "fused_ops_cpu.c", compiler=str(compiler))
    assert path is not None and "slower kernel" in caplog.text
    children = [int(p) for p in pids.read_text().split()]
    assert children  # the OpenMP line was tried, and timed out
    for pid in children:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_without_a_compiler_the_torch_path_serves(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("VLLM_COURSE_CACHE", str(tmp_path))
    with caplog.at_level(logging.WARNING):
        assert cpu_build.build(SOURCE, compiler="false") is None  # a "compiler" that always fails
    assert "could not build" in caplog.text and list(tmp_path.iterdir()) == []

    monkeypatch.setattr(cpu_attention, "load_kernel", lambda: None)
    backend = get_attention_backend(num_layers=2, num_blocks=12, block_size=4, num_heads=4, num_kv_heads=2,
                                    head_dim=8, dtype=torch.float32, device="cpu")
    assert type(backend) is TorchAttention
    got, want = run_backend_steps(backend)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, atol=1e-5, rtol=1e-4)


def test_a_cache_it_cannot_write_means_no_kernel_not_a_crash(tmp_path, monkeypatch, caplog):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("VLLM_COURSE_CACHE", str(tmp_path / "a_file" / "cache"))
    with caplog.at_level(logging.WARNING):
        assert cpu_build.build(SOURCE) is None
    assert "could not build" in caplog.text


def test_bf16_decode_scores_on_amx_tiles_and_their_switch(kernel):
    """Where the CPU has AMX, bf16 rows' scores are taken on the tiles (keys read as they lie in the
    pool); the switch turns that off. Both ways within the bf16 bound of float64 attention (the
    cases above run the tiles already: a scale off by 1% in their scores fails 7 of them)."""
    has_amx = torch.cpu._is_amx_tile_supported()
    case = dataclasses.replace(SHAPES["smollm9-3_d64_bs16_long_and_spec"], dtype=torch.bfloat16)
    batch = make_batch(case, seed=7)
    args = (batch["q"], batch["k"], batch["v"], batch["k_cache"], batch["v_cache"], batch["metadata"],
            batch["scale"])
    try:
        for on in (1, 0):
            assert kernel.lib.attention_use_amx(on) == (on and has_amx)
            assert_matches_dense(kernel.forward(*args)[:batch["num_tokens"]], batch, case)
    finally:
        kernel.lib.attention_use_amx(int(has_amx))


def test_the_off_switch(monkeypatch):
    """VLLM_COURSE_CPU_ATTENTION=0 (envs.py), read when a backend is chosen: the torch reference."""
    monkeypatch.setenv("VLLM_COURSE_CPU_ATTENTION", "0")
    assert cpu_attention.load_kernel() is None
    backend = get_attention_backend(num_layers=1, num_blocks=8, block_size=4, num_heads=4, num_kv_heads=2,
                                    head_dim=8, dtype=torch.float32, device="cpu")
    assert type(backend) is TorchAttention
    monkeypatch.setenv("VLLM_COURSE_CPU_ATTENTION", "1")
    assert cpu_attention.load_kernel() is not None


def test_scores_hundreds_apart_stay_finite(kernel):
    """Scores that grow by more than exp's range from one block to the next: without rescaling
    by the running maximum, exp overflows to inf and the output is NaN."""
    case = Case(9, 3, 64, 16, ((300, 1), (129, 1), (40, 4)))
    batch = make_batch(case, seed=2)
    n, bs = batch["num_tokens"], case.block_size
    ramp = torch.arange(batch["k_cache"].shape[0] * bs, dtype=torch.float32).view(-1, bs, 1, 1)
    for cache in (batch["k_cache"], batch["v_cache"]):
        cache.mul_(1 + ramp / 4)  # later slots, larger keys: the maximum keeps growing
    batch["q"].mul_(8)
    ref_k, ref_v = batch["k_cache"].clone(), batch["v_cache"].clone()
    reshape_and_cache_ref(batch["k"], batch["v"], ref_k, ref_v, batch["metadata"].slot_mapping)
    want = paged_attention_ref(batch["q"][:n], ref_k, ref_v, batch["metadata"], batch["scale"])
    out = kernel.forward(batch["q"], batch["k"], batch["v"], batch["k_cache"], batch["v_cache"],
                         batch["metadata"], batch["scale"])[:n]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, atol=1e-5 * want.abs().max().item(), rtol=1e-4)  # values to ~1e3


@pytest.mark.parametrize("window", [None, 6, 21], ids=["full", "window6", "window21"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prefill_row_rounds_the_same_whichever_tile_it_lands_in(kernel, dtype, window):
    """A prefill's rows go through the kernel in tiles (here 5 rows of 3 query heads), each row's
    sums its own: the same 20 rows as one chunk, or as chunks of 11 and 9 (row 50 then alone in its
    tile, rows 51-55 one tile, not two), give the same bits. A tile-wide softmax maximum, say,
    would not. With a window the rows of a tile start at different keys, some in different blocks
    (window 6: rows of 52-56 keys start at keys 46-50, in blocks 2 and 3), and a tile walks from
    its earliest: a block wholly before a row's window must leave the row as it was."""
    case = Case(9, 3, 64, 16, ((47, 1), (60, 20)), dtype=dtype)  # a decode row first: the rows shift
    batch = make_batch(case, seed=5)
    q, k, v, scale, bs = batch["q"], batch["k"], batch["v"], batch["scale"], case.block_size
    caches = batch["k_cache"].clone(), batch["v_cache"].clone()  # the context only, as the chunks see it
    whole = kernel.forward(q, k, v, batch["k_cache"], batch["v_cache"], batch["metadata"], scale,
                           window=window)[1:21]
    table = batch["metadata"].block_tables[1].tolist()
    chunks = []
    for first, q_len in ((1, 11), (12, 9)):
        metadata = PagedAttentionMetadata.build([table], [40 + first - 1 + q_len], [q_len], bs)
        rows = slice(first, first + q_len)
        chunks.append(kernel.forward(q[rows], k[rows], v[rows], *caches, metadata, scale, window=window))
    assert torch.equal(torch.cat(chunks), whole)
    assert torch.equal(caches[0][table], batch["k_cache"][table])  # and stored the same K/V


def test_the_tiles_off_switch_attends_a_prefill_row_by_row(kernel, monkeypatch):
    """VLLM_COURSE_CPU_ATTENTION_TILES=0: a prefill's rows go through the row kernel, each then the
    same bits as that row decoded alone on its context; with tiles (the default) they are not."""
    case = Case(9, 3, 64, 16, ((45, 12),))
    batch = make_batch(case, seed=6)
    q, k, v, scale = batch["q"], batch["k"], batch["v"], batch["scale"]
    table = batch["metadata"].block_tables[0].tolist()
    caches = batch["k_cache"].clone(), batch["v_cache"].clone()
    kernel.forward(q, k, v, *caches, batch["metadata"], scale)  # every new row's K/V stored
    alone = torch.cat([kernel.forward(q[i:i + 1], k[i:i + 1], v[i:i + 1], *caches,
                                      PagedAttentionMetadata.build([table], [34 + i], [1], 16), scale)
                       for i in range(12)])
    tiled = kernel.forward(q, k, v, *caches, batch["metadata"], scale)[:12]
    monkeypatch.setenv("VLLM_COURSE_CPU_ATTENTION_TILES", "0")  # read as a backend is made
    assert torch.equal(kernel.forward(q, k, v, *caches, batch["metadata"], scale)[:12], alone)
    assert not torch.equal(tiled, alone)


# Sliding windows (HF's: position i sees keys i - W < j <= i): decode rows, verification rows, a chunk
# on a cached context and fresh prefills past SHORT_QUERY (the tiles) and under it (the row kernel);
# GQA, MQA, MHA, head sizes on and off the vectors' widths. Windows: one key, under a block, across
# blocks, and past every sequence (then the same bits as no window).
WINDOW_SHAPES = {
    "smollm9-3_d64_bs16": Case(9, 3, 64, 16, ((47, 1), (16, 1), (5, 1), (40, 3), (60, 20), (30, 30),
                                              (12, 12), (7, 7))),
    "gqa8-2_d128_bs32": Case(8, 2, 128, 32, ((70, 1), (33, 3), (75, 40), (40, 40))),
    "gqa6-2_d20_bs8": Case(6, 2, 20, 8, ((45, 1), (19, 4), (6, 6), (30, 12), (25, 25))),
    "mha4-4_d32_bs16": Case(4, 4, 32, 16, ((50, 20), (17, 1), (20, 20))),
    "mqa3-1_d5_bs4": Case(3, 1, 5, 4, ((23, 1), (7, 2), (23, 10), (14, 14))),
}
WINDOWS = (1, 5, 20, 1000)


def windowed_run(kernel, case, window, seed=11):
    """The kernel's output in a layer with `window`, the torch reference's with it, and the kernel's
    without it, over one batch."""
    batch = make_batch(case, seed=seed)
    n, metadata, scale = batch["num_tokens"], batch["metadata"], batch["scale"]
    q, k, v = batch["q"], batch["k"], batch["v"]
    ref_k, ref_v = batch["k_cache"].clone(), batch["v_cache"].clone()
    reshape_and_cache_ref(k, v, ref_k, ref_v, metadata.slot_mapping)
    want = paged_attention_ref(q[:n], ref_k, ref_v, metadata, scale, window=window)
    out = kernel.forward(q, k, v, batch["k_cache"], batch["v_cache"], metadata, scale, window=window)[:n]
    full = kernel.forward(q, k, v, batch["k_cache"], batch["v_cache"], metadata, scale)[:n]
    return out.clone(), want, full, batch


def assert_windowed_matches(out, want, full, batch, case, window):
    assert_matches_windowed_dense(out, batch, case, window)
    if case.dtype == torch.float32:
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
    else:  # the torch reference rounds to bf16 at every op
        torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)
    if window >= max(s for s, _ in case.seqs):  # a window past every sequence: no window at all
        assert torch.equal(out, full)
    else:  # the window matters here, far beyond the tolerances above: a kernel ignoring it fails
        assert (out.float() - full.float()).abs().max() > 0.1


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(WINDOW_SHAPES))
def test_the_kernel_attends_a_sliding_window_as_the_reference_does(kernel, name, dtype, window):
    case = dataclasses.replace(WINDOW_SHAPES[name], dtype=dtype)
    out, want, full, batch = windowed_run(kernel, case, window)
    assert_windowed_matches(out, want, full, batch, case, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_long_fresh_prefill_on_sdpa_gets_the_window_too(kernel, monkeypatch, dtype):
    """A fresh prefill past PREFILL_MAX_LEN (here lowered to 16) goes to gather + SDPA, which masks
    the same window; beside it a decode row and a chunk on a context in the kernel."""
    monkeypatch.setitem(cpu_attention.PREFILL_MAX_LEN, dtype, 16)
    case = Case(9, 3, 64, 16, ((40, 40), (33, 1), (45, 12), (24, 24)), dtype=dtype)
    assert not cpu_attention.uses_kernel(40, 40, dtype) and cpu_attention.uses_kernel(45, 12, dtype)
    for window in (6, 21):
        out, want, full, batch = windowed_run(kernel, case, window)
        assert_windowed_matches(out, want, full, batch, case, window)


def test_per_layer_windows_through_the_backend():
    """A model whose layer 0 slides (window 3) and layer 1 attends in full (Gemma's and Mistral's
    layout), through engine-like steps: prefills (one in tiles), decodes, a chunk on a cached context.
    Each layer as the torch reference with the same windows; layer 0 unlike a full layer."""
    args = dict(num_layers=2, num_blocks=10, block_size=4, num_heads=4, num_kv_heads=2, head_dim=8,
                dtype=torch.float32, device="cpu")
    backend = get_attention_backend(**args, sliding_windows=(3, None))
    assert isinstance(backend, cpu_attention.CpuAttention) and backend.windows == (3, None)
    reference = TorchAttention(2, 10, 4, 2, 8, torch.float32, "cpu", sliding_windows=(3, None))
    unwindowed = TorchAttention(2, 10, 4, 2, 8, torch.float32, "cpu")
    tables = {"a": [1, 3, 5, 7], "b": [2, 4, 6]}
    lengths = {"a": 0, "b": 0}
    g = torch.Generator().manual_seed(9)
    for step in ([("a", 12), ("b", 3)], [("a", 1), ("b", 1)], [("a", 1), ("b", 6)]):
        for req, n in step:
            lengths[req] += n
        metadata = PagedAttentionMetadata.build([tables[r] for r, _ in step], [lengths[r] for r, _ in step],
                                                [n for _, n in step], 4)
        num_tokens = sum(n for _, n in step)
        for layer in (0, 1):
            q = torch.randn(num_tokens, 4, 8, generator=g)
            k, v = torch.randn(2, num_tokens, 2, 8, generator=g)
            got = backend.forward(layer, q, k, v, metadata)
            want = reference.forward(layer, q, k, v, metadata)
            full = unwindowed.forward(layer, q, k, v, metadata)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
            if layer == 1:
                torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-4)
            else:
                assert (got - full).abs().max() > 0.1


def test_soft_capped_scores_take_the_torch_reference(caplog):
    """The kernel has no soft-capping: with logit_softcap the CPU backend is the torch reference,
    and the log says why."""
    args = dict(num_layers=2, num_blocks=8, block_size=4, num_heads=4, num_kv_heads=2, head_dim=8,
                dtype=torch.float32, device="cpu")
    with caplog.at_level(logging.INFO, logger=cpu_attention.__name__):
        backend = get_attention_backend(**args, sliding_windows=(4, None), logit_softcap=30.0)
    assert type(backend) is TorchAttention and backend.logit_softcap == 30.0 and backend.windows == (4, None)
    assert "soft-capping" in caplog.text
    assert type(get_attention_backend(**args, sliding_windows=(4, None))) is cpu_attention.CpuAttention
