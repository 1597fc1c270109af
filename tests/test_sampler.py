"""The sampler against references written independently here: greedy, seeds, top-k / top-p /
min-p masks, penalties, banned tokens, the sampled distribution itself, and logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from shared.sampler import (Sampler, SamplingRow, apply_penalties, apply_top_k_top_p_min_p, argmax_rows,
                            make_generator)
from shared.sampling_params import SamplingParams

CPU = torch.device("cpu")


def row(seed: int | None = None, **kwargs) -> SamplingRow:
    params = SamplingParams(seed=seed, **kwargs)
    return SamplingRow(params, make_generator(seed, CPU))


def random_logits(batch: int, vocab: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=g) * scale


# ---------------------------------------------------------------------------------------- greedy

def test_greedy_is_argmax():
    logits = random_logits(16, 100, seed=1)
    out = Sampler()(logits, [row(temperature=0.0) for _ in range(16)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None


@pytest.mark.parametrize("rows,vocab", [(1, 49152), (33, 49152), (5, 128256), (3, 151936), (4, 50000), (2, 4096)])
def test_argmax_in_chunks_is_torch_argmax(rows, vocab):
    """argmax_rows (chunk maxima, then one chunk's argmax) against torch's own argmax, on the rows
    where a chunked search goes wrong: the maximum tied in two chunks and twice in one (the first
    wins), a NaN (counts as the largest, the first one wins), a row of -inf (index 0), and the
    maximum in the last place. Vocabularies with no power-of-two chunk (50000) or a single one
    (4096) take torch's argmax."""
    x = random_logits(rows, vocab, seed=rows)
    x[0, [vocab // 2 + 7, 3]] = 100.0
    if rows > 4:
        x[rows - 1, vocab - 1] = 100.0
    if rows > 2:
        x[1, [vocab - 2, vocab // 3]] = float("nan")
        x[2] = float("-inf")
    if rows > 3:
        x[3, [vocab - 9, vocab - 5]] = 50.0  # tied inside the last chunk
    want = x.argmax(dim=-1)
    assert torch.equal(argmax_rows(x), want)
    assert want[0] == 3 and (rows <= 4 or want[rows - 1] == vocab - 1)


def test_greedy_rows_unaffected_by_sampled_rows_and_top_k_one_is_greedy():
    logits = random_logits(6, 50, seed=2)
    rows = [row(temperature=0.0), row(temperature=1.5), row(temperature=0.0),
            row(temperature=2.0, top_k=1), row(seed=3, temperature=1.0, top_p=1e-6), row(temperature=0.0)]
    out = Sampler()(logits, rows)
    argmax = logits.argmax(dim=-1).tolist()
    for i in (0, 2, 3, 4, 5):  # greedy, top_k=1 and a tiny nucleus all reduce to the argmax
        assert out.token_ids[i] == argmax[i]


def test_make_generator():
    assert make_generator(None, CPU) is None
    a, b = make_generator(7, CPU), make_generator(7, CPU)
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))


# ---------------------------------------------------------------------------------------- seeds

def _run_steps(layout: list[SamplingRow], steps: int, vocab: int, watch: int) -> list[int]:
    """Sample `steps` times with the same logits for the watched row; other rows get their own."""
    sampler = Sampler()
    tokens = []
    for step in range(steps):
        logits = random_logits(len(layout), vocab, seed=1000 + step, scale=0.5)
        logits[watch] = random_logits(1, vocab, seed=step, scale=0.5)[0]
        tokens.append(sampler(logits, layout).token_ids[watch])
    return tokens


def test_seeded_row_reproducible_whatever_the_batch():
    vocab, steps = 64, 30
    alone = _run_steps([row(seed=42)], steps, vocab, watch=0)
    torch.manual_seed(123)  # the global RNG must not matter for a seeded row
    batch = [row(temperature=1.0), row(seed=7, top_k=5), row(seed=42), row(temperature=0.0)]
    in_batch = _run_steps(batch, steps, vocab, watch=2)
    batch2 = [row(seed=42), row(seed=9, top_p=0.5), row(temperature=0.7)]
    first = _run_steps(batch2, steps, vocab, watch=0)
    assert alone == in_batch == first
    # A different seed gives a different sequence (64-way nearly flat choices over 30 steps).
    other = _run_steps([row(seed=43)], steps, vocab, watch=0)
    assert other != alone
    # And sampling really samples: a flat-ish distribution does not give one token throughout.
    assert len(set(alone)) > 5


def test_unseeded_rows_follow_global_rng():
    logits = random_logits(8, 64, seed=5, scale=0.3)
    torch.manual_seed(11)
    a = Sampler()(logits, [row() for _ in range(8)]).token_ids
    torch.manual_seed(11)
    b = Sampler()(logits, [row() for _ in range(8)]).token_ids
    assert a == b


# --------------------------------------------------------------------------------- top-k / top-p

def _kept(masked: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(masked)


def _off(batch: int):
    return (torch.zeros(batch, dtype=torch.long), torch.ones(batch), torch.zeros(batch))


@pytest.mark.parametrize("k", [1, 2, 7, 50, 99])
def test_top_k_keeps_exactly_k(k):
    batch, vocab = 12, 100
    logits = random_logits(batch, vocab, seed=k)
    _, top_p, min_p = _off(batch)
    masked = apply_top_k_top_p_min_p(logits, torch.full((batch,), k), top_p, min_p)
    kept = _kept(masked)
    assert (kept.sum(dim=-1) == k).all()
    expected = torch.zeros_like(kept)
    expected.scatter_(1, logits.topk(k, dim=-1).indices, True)
    assert torch.equal(kept, expected)
    # Surviving logits are unchanged.
    assert torch.equal(masked[kept], logits[kept])


def test_top_k_zero_or_larger_than_vocab_is_off():
    logits = random_logits(3, 20, seed=3)
    _, top_p, min_p = _off(3)
    masked = apply_top_k_top_p_min_p(logits, torch.tensor([0, 20, 1000]), top_p, min_p)
    assert torch.equal(masked, logits)


def _reference_mask(logits: torch.Tensor, top_k: list[int], top_p: list[float],
                    min_p: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's warpers in HF's order (top-k, top-p, min-p), each on the distribution left by the one
    before, in float64. Returns (kept mask, distance of each decision from its threshold)."""
    batch, vocab = logits.shape
    kept = torch.ones(batch, vocab, dtype=torch.bool)
    margin = torch.full((batch, vocab), math.inf, dtype=torch.float64)
    for b in range(batch):
        x = logits[b].double()
        if top_k[b] > 0:
            kth = x.topk(min(top_k[b], vocab)).values[-1]
            kept[b] &= x >= kth
        if top_p[b] < 1.0:
            # HF TopPLogitsWarper: sort ascending, drop while the cumulative mass <= 1 - top_p.
            probs = x.masked_fill(~kept[b], -math.inf).softmax(-1)
            asc, idx = probs.sort()
            cum = asc.cumsum(-1)
            drop = cum <= 1 - top_p[b]
            drop[-1] = False  # min_tokens_to_keep = 1
            kept[b, idx[drop]] = False
            m = (cum - (1 - top_p[b])).abs()
            margin[b, idx] = torch.minimum(margin[b, idx], m)
        if min_p[b] > 0.0:
            probs = x.masked_fill(~kept[b], -math.inf).softmax(-1)
            floor = min_p[b] * probs.max()
            kept[b] &= probs >= floor
            margin[b] = torch.minimum(margin[b], (probs - floor).abs() / probs.max())
    return kept, margin


@pytest.mark.parametrize("top_k, top_p, min_p", [
    (0, 0.9, 0.0),
    (0, 0.5, 0.0),
    (0, 0.05, 0.0),
    (0, 1.0, 0.1),
    (0, 1.0, 0.5),
    (10, 0.8, 0.0),
    (10, 1.0, 0.2),
    (0, 0.7, 0.3),
    (25, 0.95, 0.05),
])
def test_masks_match_independent_reference(top_k, top_p, min_p):
    batch, vocab = 64, 200
    logits = random_logits(batch, vocab, seed=int(top_p * 1000 + min_p * 100 + top_k))
    masked = apply_top_k_top_p_min_p(logits, torch.full((batch,), top_k),
                                     torch.full((batch,), top_p), torch.full((batch,), min_p))
    expected, margin = _reference_mask(logits, [top_k] * batch, [top_p] * batch, [min_p] * batch)
    # Decisions within float32 rounding of their threshold may legitimately go either way.
    clear = margin > 1e-5
    assert clear.float().mean() > 0.99
    assert torch.equal(_kept(masked)[clear], expected[clear])
    assert (_kept(masked).sum(-1) >= 1).all()  # the most likely token always survives
    assert torch.equal(masked[_kept(masked)], logits[_kept(masked)])


def test_per_row_parameters_are_independent():
    batch, vocab = 4, 80
    logits = random_logits(batch, vocab, seed=9)
    top_k, top_p, min_p = [0, 5, 0, 0], [1.0, 1.0, 0.6, 1.0], [0.0, 0.0, 0.0, 0.25]
    masked = apply_top_k_top_p_min_p(logits, torch.tensor(top_k), torch.tensor(top_p),
                                     torch.tensor(min_p))
    expected, margin = _reference_mask(logits, top_k, top_p, min_p)
    assert (margin > 1e-5).all()
    assert torch.equal(_kept(masked), expected)
    assert _kept(masked)[0].all()


# ------------------------------------------------------------------------------------ penalties

def _reference_penalties(logits: list[float], prompt: list[int], output: list[int],
                         rep: float, presence: float, frequency: float) -> list[float]:
    out = list(logits)
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):
        out[t] -= frequency * output.count(t) + presence
    return out


def test_penalties_match_plain_python():
    vocab = 30
    logits = random_logits(4, vocab, seed=21)
    specs = [
        dict(repetition_penalty=1.3, presence_penalty=0.0, frequency_penalty=0.0),
        dict(repetition_penalty=1.0, presence_penalty=0.7, frequency_penalty=0.4),
        dict(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.1),
        dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0),
    ]
    prompts = [[1, 2, 3, 3, 29], [4, 5], [], [0, 1, 2]]
    outputs = [[3, 7, 7, 7], [5, 5, 6, 9, 9, 9], [1, 1, 2], [8]]
    rows = [SamplingRow(SamplingParams(**s), None, p, o) for s, p, o in zip(specs, prompts, outputs)]
    got = apply_penalties(logits.clone(), rows)
    for i, s in enumerate(specs):
        ref = _reference_penalties(logits[i].tolist(), prompts[i], outputs[i], s["repetition_penalty"],
                                   s["presence_penalty"], s["frequency_penalty"])
        assert torch.allclose(got[i], torch.tensor(ref), atol=1e-6), i


def test_presence_and_frequency_ignore_prompt_tokens():
    logits = random_logits(1, 10, seed=22)
    r = SamplingRow(SamplingParams(presence_penalty=1.0, frequency_penalty=1.0), None,
                    prompt_token_ids=[1, 2, 3], output_token_ids=[])
    assert torch.equal(apply_penalties(logits.clone(), [r]), logits)


def test_penalties_change_greedy_choice():
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0]])
    plain = Sampler()(logits, [SamplingRow(SamplingParams(temperature=0.0), None, [], [1])])
    assert plain.token_ids == [1]
    penalised = Sampler()(logits, [SamplingRow(SamplingParams(temperature=0.0, presence_penalty=0.5),
                                               None, [], [1])])
    assert penalised.token_ids == [2]
    rep = Sampler()(logits, [SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=1.2),
                                         None, [1], [])])
    assert rep.token_ids == [2]  # 3.0 / 1.2 = 2.5 < 2.9


def test_banned_tokens_never_sampled():
    vocab = 6
    logits = torch.tensor([[10.0, 9.0, 0.0, 0.0, 0.0, 0.0]]).repeat(2000, 1)
    rows = [SamplingRow(SamplingParams(temperature=1.0), None, banned_token_ids=(0, 1))
            for _ in range(1999)]
    rows.append(SamplingRow(SamplingParams(temperature=0.0), None, banned_token_ids=(0,)))
    out = Sampler()(logits, rows)
    assert all(t not in (0, 1) for t in out.token_ids[:-1])
    assert set(out.token_ids[:-1]) == {2, 3, 4, 5}  # the rest stays uniform among the allowed
    assert out.token_ids[-1] == 1  # greedy with 0 banned takes the runner-up
    assert all(0 <= t < vocab for t in out.token_ids)


# ------------------------------------------------------------------------------- distributions

def _assert_frequencies(tokens: list[int], probs: torch.Tensor) -> None:
    """Each token's observed frequency within 5 standard errors of its probability: with N draws
    the frequency of a token of probability p has sd sqrt(p(1-p)/N); tokens of probability 0
    must never appear."""
    n = len(tokens)
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double()
    freq = counts / n
    p = probs.double()
    tol = 5 * torch.sqrt(p * (1 - p) / n) + 1e-12
    assert ((freq - p).abs() <= tol).all(), (freq, p)
    assert (counts[p == 0] == 0).all()
    # Pearson chi-square over the non-zero cells; 99.99% quantile of chi2 with up to 9 dof < 34.
    nz = p > 0
    chi2 = (((counts[nz] - n * p[nz]) ** 2) / (n * p[nz])).sum().item()
    assert chi2 < 34.0, chi2


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_sampled_frequencies_follow_softmax(temperature):
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.2, 1.4])
    n = 20000
    torch.manual_seed(int(temperature * 10))
    out = Sampler()(base.repeat(n, 1), [row(temperature=temperature) for _ in range(n)])
    _assert_frequencies(out.token_ids, (base / temperature).softmax(-1))


def test_sampled_frequencies_with_top_k_top_p_min_p():
    base = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    n = 20000
    torch.manual_seed(3)
    cases = [dict(top_k=3), dict(top_p=0.8), dict(min_p=0.3)]
    for params in cases:
        out = Sampler()(base.repeat(n, 1), [row(temperature=1.0, **params) for _ in range(n)])
        ref = base.softmax(-1).double()
        # Truncated distributions, derived by hand from the definitions.
        if "top_k" in params:
            keep = torch.tensor([1, 1, 1, 0, 0, 0, 0, 0], dtype=torch.bool)
        elif "top_p" in params:
            before = ref.cumsum(-1) - ref  # mass of the more likely tokens (base is sorted)
            keep = before < 0.8
        else:
            keep = ref >= 0.3 * ref.max()
        target = torch.where(keep, ref, torch.zeros_like(ref))
        _assert_frequencies(out.token_ids, target / target.sum())


def test_seeded_row_samples_the_right_distribution():
    """One seeded generator drawn many times still samples softmax(logits)."""
    base = torch.tensor([0.3, -0.2, 1.0, 0.0, -1.0])
    r = row(seed=1234, temperature=1.0)
    sampler = Sampler()
    tokens = [sampler(base[None], [r]).token_ids[0] for _ in range(4000)]
    _assert_frequencies(tokens, base.softmax(-1))


# ------------------------------------------------------------------------------------ logprobs

def test_logprobs_are_raw_log_softmax_with_rank_and_sorted_top():
    batch, vocab = 6, 40
    logits = random_logits(batch, vocab, seed=31)
    rows = [row(temperature=0.0, logprobs=5),
            row(seed=1, temperature=0.8, top_k=10, logprobs=3),
            row(seed=2, temperature=1.3, repetition_penalty=1.5, logprobs=0),
            row(temperature=0.0),  # wants none
            row(seed=3, temperature=2.0, presence_penalty=2.0, logprobs=20),
            row(seed=4, temperature=1.0, min_p=0.2, logprobs=1)]
    for r in rows:
        r.output_token_ids = [0, 1, 2]
        r.prompt_token_ids = [3, 4]
    out = Sampler()(logits, rows)
    raw = logits.double().log_softmax(-1)
    assert out.logprobs is not None and out.ranks is not None and out.top_logprobs is not None
    for i, r in enumerate(rows):
        tok = out.token_ids[i]
        want = r.params.logprobs
        if want is None:
            continue
        # Raw: before temperature, penalties and truncation (vLLM's default logprobs mode).
        assert out.logprobs[i] == pytest.approx(raw[i, tok].item(), abs=1e-5)
        assert out.ranks[i] == 1 + int((raw[i] > raw[i, tok]).sum())
        top = out.top_logprobs[i]
        assert len(top) == want
        ids = [t for t, _ in top]
        vals = [v for _, v in top]
        assert vals == sorted(vals, reverse=True)
        assert ids == raw[i].topk(want).indices.tolist() if want else ids == []
        for t, v in top:
            assert v == pytest.approx(raw[i, t].item(), abs=1e-5)
    assert out.ranks[0] == 1  # greedy picks rank 1


def test_logprob_of_greedy_token_is_max():
    logits = random_logits(3, 25, seed=41)
    out = Sampler()(logits, [row(temperature=0.0, logprobs=2) for _ in range(3)])
    for i in range(3):
        assert out.ranks[i] == 1
        assert out.top_logprobs[i][0][0] == out.token_ids[i]
        assert out.top_logprobs[i][0][1] == pytest.approx(out.logprobs[i], abs=1e-6)
        assert math.exp(out.logprobs[i]) == pytest.approx(logits[i].softmax(-1).max().item(), rel=1e-5)
