"""Part 08's rejection sampler, model-free: greedy verification is plain greedy decoding token for
token; bans, logit_bias and penalties shape p as the plain sampler shapes it; seeded sequences are
reproducible whatever the batch; no drafts is exactly the plain sampler; and, the point of the
algorithm, the emitted tokens follow the target distribution. That last check is a chi-square
goodness-of-fit test which must pass for the real sampler and must fail for three plausible
mistakes (residual p instead of max(0, p - q), acceptance min(1, q/p), accepting everything)."""
from __future__ import annotations

import pytest
import torch

import part08_specdec.rejection_sampler as rs_module
from conftest import chi2_pvalue
from part08_specdec.rejection_sampler import RejectionSampler, SpecDecodeMetadata
from shared.sampler import Sampler, SamplingRow, make_generator
from shared.sampling_params import SamplingParams

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0)


def verify(logits, rows, drafts, draft_probs=None):
    return RejectionSampler(Sampler())(logits, rows, SpecDecodeMetadata.from_drafts(drafts), draft_probs)


def peaked(argmaxes: list[int], vocab: int = 8) -> torch.Tensor:
    """One row per position whose argmax is the given token."""
    logits = torch.zeros(len(argmaxes), vocab)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


def seq_rows(params: SamplingParams, k: int, seed: int | None = None, **kw) -> list[SamplingRow]:
    """A sequence's k + 1 rows, all sharing one generator (as the engine builds them)."""
    g = make_generator(seed, CPU)
    return [SamplingRow(params, g, **kw) for _ in range(k + 1)]


# ---------------------------------------------------------------------------------------- greedy

@pytest.mark.parametrize("argmaxes, drafts, expected, accepted", [
    ([3, 1, 4, 7], [3, 1, 4], [3, 1, 4, 7], 3),  # all accepted, then the bonus token
    ([3, 1, 4, 7], [2, 1, 4], [3], 0),  # first draft rejected: the argmax replaces it
    ([3, 1, 4, 7], [3, 5, 4], [3, 1], 1),  # middle rejected: later drafts are dropped
    ([3, 1, 4, 7], [3, 1, 0], [3, 1, 4], 2),  # last rejected
    ([6], [], [6], 0),  # no drafts: one ordinary greedy token
])
def test_greedy_accepts_the_argmax_run(argmaxes, drafts, expected, accepted):
    out = verify(peaked(argmaxes), seq_rows(GREEDY, len(drafts)), [drafts])
    assert out.token_ids == [expected]
    assert out.num_accepted == [accepted]
    assert out.outputs[0].logprobs is None


def test_greedy_batch_of_sequences_with_different_k():
    argmaxes = [[1, 2, 3], [4], [5, 6], [7, 0, 1, 2]]
    drafts = [[1, 2], [], [0], [7, 0, 5]]
    logits = peaked([t for a in argmaxes for t in a])
    rows = [r for d in drafts for r in seq_rows(GREEDY, len(d))]
    out = verify(logits, rows, drafts)
    assert out.token_ids == [[1, 2, 3], [4], [5], [7, 0, 1]]
    assert out.num_accepted == [2, 0, 0, 2]


def test_greedy_ignores_draft_probs():
    """Greedy acceptance only asks whether the draft is the argmax, whatever q says."""
    q = torch.full((2, 8), 1 / 8)
    out = verify(peaked([3, 1, 4]), seq_rows(GREEDY, 2), [[3, 2]], draft_probs=q)
    assert out.token_ids == [[3, 1]]


# ---------------------------------------------------------------- bans, logit_bias and penalties

@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_forces_a_token_and_rejects_other_drafts(temperature):
    params = SamplingParams(temperature=temperature, logit_bias={5: 100.0})
    out = verify(torch.randn(3, 8, generator=torch.Generator().manual_seed(0)),
                 seq_rows(params, 2, seed=1), [[1, 2]])
    assert out.token_ids == [[5]] and out.num_accepted == [0]
    out = verify(torch.randn(3, 8), seq_rows(params, 2, seed=1), [[5, 5]])
    assert out.token_ids == [[5, 5, 5]] and out.num_accepted == [2]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_banned_token_is_rejected_and_never_emitted(temperature):
    """min_tokens bans EOS (token 7 here): a draft of EOS is rejected even where it is the
    target's favourite, and what replaces it is never EOS."""
    params = SamplingParams(temperature=temperature)
    for seed in range(20):
        out = verify(peaked([7, 7]), seq_rows(params, 1, seed=seed, banned_token_ids=(7,)), [[7]])
        assert out.num_accepted == [0] and out.token_ids[0][0] != 7


def test_penalties_see_each_rows_history():
    """Row j's history includes drafts[:j] (the caller builds it): a frequency penalty on the
    drafted token flips the argmax at the next position, so the repeated draft is rejected."""
    logits = torch.tensor([[0.0, 1.0, 0.8], [0.0, 1.0, 0.8], [0.0, 1.0, 0.8]])
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    rows = [SamplingRow(params, output_token_ids=[1] * j) for j in range(3)]
    out = verify(logits, rows, [[1, 1]])
    assert out.token_ids == [[1, 2]] and out.num_accepted == [1]


def test_masked_draft_is_rejected_and_empty_residual_falls_back_to_p():
    """With q == p, a draft outside the target's top-k has p(x) = q(x) = 0: it is rejected and
    max(0, p - q) is all zero, so the recovered token comes from p (one of the top-k)."""
    logits = torch.tensor([[3.0, 2.0, 0.0, -1.0]] * 2)
    params = SamplingParams(temperature=1.0, top_k=2)
    q = Sampler.probs(logits[:1], [SamplingRow(params)])
    for seed in range(20):
        out = verify(logits, seq_rows(params, 1, seed=seed), [[3]], draft_probs=q)
        assert out.num_accepted == [0] and out.token_ids[0][0] in (0, 1)


def test_draft_equal_to_target_is_always_accepted():
    logits = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=0.8)
    q = Sampler.probs(logits[:3], [SamplingRow(params)] * 3)
    for seed in range(20):
        assert verify(logits, seq_rows(params, 3, seed=seed), [[seed % 6, 2, 4]], q).num_accepted == [3]


# ---------------------------------------------------------------------------------- randomness

WATCHED = SamplingParams(temperature=1.3)


def _watched_logits() -> torch.Tensor:
    return torch.randn(4, 20, generator=torch.Generator().manual_seed(99))


def _mixed_batch(watch_seed: int, position: int):
    """Four sequences; the watched one (seeded, 3 drafts, fixed logits) sits at `position`."""
    watched = (_watched_logits(), [4, 9, 4], seq_rows(WATCHED, 3, watch_seed))
    others = [(torch.randn(3, 20), [1, 2], seq_rows(SamplingParams(temperature=0.7), 2)),
              (torch.randn(1, 20), [], seq_rows(SamplingParams(temperature=1.0), 0, seed=5)),
              (torch.randn(5, 20), [0, 0, 0, 0], seq_rows(GREEDY, 4))]
    batch = others[:position] + [watched] + others[position:]
    return (torch.cat([b[0] for b in batch]), [r for b in batch for r in b[2]], [b[1] for b in batch])


def test_seeded_sequence_reproducible_whatever_the_batch():
    alone = [verify(_watched_logits(), seq_rows(WATCHED, 3, seed), [[4, 9, 4]]).token_ids[0]
             for seed in range(8)]
    assert len({tuple(t) for t in alone}) > 1  # the seed matters
    for position in range(4):
        torch.manual_seed(position)  # the unseeded neighbours differ from run to run
        for seed in range(8):
            logits, rows, drafts = _mixed_batch(seed, position)
            assert verify(logits, rows, drafts).token_ids[position] == alone[seed]


def test_no_drafts_is_exactly_the_plain_sampler():
    """k_s = 0 everywhere: the same tokens and logprobs as Sampler.sample, for seeded and
    unseeded rows alike (the same random draws in the same order)."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(4)) * 2
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.9),
              SamplingParams(temperature=1.2, top_p=0.8, seed=11), SamplingParams(temperature=1.0, top_k=5),
              SamplingParams(temperature=0.7, min_p=0.05, seed=12, logprobs=0),
              SamplingParams(temperature=1.5)]
    for trial in range(5):
        torch.manual_seed(trial)
        plain = Sampler()(logits, [SamplingRow(p, make_generator(p.seed, CPU)) for p in params])
        torch.manual_seed(trial)
        spec = verify(logits, [SamplingRow(p, make_generator(p.seed, CPU)) for p in params], [[]] * 6)
        assert spec.token_ids == [[t] for t in plain.token_ids]
        assert spec.num_accepted == [0] * 6
        assert [o.logprobs[0] for o in spec.outputs] == plain.logprobs
        assert [o.ranks[0] for o in spec.outputs] == plain.ranks
        assert [o.top_logprobs[0] for o in spec.outputs] == plain.top_logprobs


def test_logprobs_score_each_token_under_its_own_rows_raw_logits():
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(6))
    drafts = [int(t) for t in logits[:3].argmax(dim=-1)]  # greedy accepts all three
    params = SamplingParams(temperature=0.0, logprobs=3, logit_bias={0: 1.0})  # raw: bias not seen
    out = verify(logits, seq_rows(params, 3), [drafts]).outputs[0]
    raw = logits.log_softmax(dim=-1)
    assert len(out.token_ids) == 4
    for j, tok in enumerate(out.token_ids):
        assert out.logprobs[j] == pytest.approx(raw[j, tok].item())
        assert out.ranks[j] == int((raw[j] > raw[j, tok]).sum()) + 1
        vals, ids = raw[j].topk(3)
        assert out.top_logprobs[j] == list(zip(ids.tolist(), vals.tolist()))


# ------------------------------------------------------------------------ the target distribution

VOCAB, K, N = 6, 3, 10_000
P_LOGITS = torch.tensor([1.2, 0.3, -0.4, 0.9, 0.0, -0.6])
Q = torch.tensor([0.05, 0.35, 0.25, 0.05, 0.2, 0.1])  # a poor draft: far from p
POINT_DRAFT = 1  # the n-gram case's fixed guess


def _step(num_seqs: int, point_mass: bool) -> list[list[int]]:
    """One verification step for num_seqs identical sequences. p is the same at every position
    and whatever the history, so the emitted stream must be i.i.d. p."""
    if point_mass:
        drafts, q = [[POINT_DRAFT] * K] * num_seqs, None
    else:
        drafts = torch.multinomial(Q, num_seqs * K, replacement=True).view(num_seqs, K).tolist()
        q = Q.expand(num_seqs * K, VOCAB)
    rows = [SamplingRow(SamplingParams(temperature=1.0))] * (num_seqs * (K + 1))
    return verify(P_LOGITS.expand(num_seqs * (K + 1), VOCAB), rows, drafts, q).token_ids


def _stream_pvalues(point_mass: bool) -> tuple[float, float]:
    """p-values of the first emitted token against p, and of the first two tokens of the stream
    (a second step for sequences that emitted one token) against p x p."""
    torch.manual_seed(1234)
    streams = _step(N, point_mass)
    short = [i for i, s in enumerate(streams) if len(s) < 2]
    for i, more in zip(short, _step(len(short), point_mass) if short else []):
        streams[i] = streams[i] + more
    p = P_LOGITS.softmax(dim=-1)
    first = torch.bincount(torch.tensor([s[0] for s in streams]), minlength=VOCAB)
    pairs = torch.bincount(torch.tensor([s[0] * VOCAB + s[1] for s in streams]), minlength=VOCAB ** 2)
    return chi2_pvalue(first, p), chi2_pvalue(pairs, torch.outer(p, p).flatten())


WRONG = {
    "residual_is_p": ("residual_probs", lambda p, q: p),
    "accept_min_q_over_p": ("accept_drafts", lambda u, p_x, q_x: u * p_x < q_x),
    "accept_always": ("accept_drafts", lambda u, p_x, q_x: torch.ones_like(u, dtype=torch.bool)),
}


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft_model", "ngram"])
def test_emitted_tokens_follow_the_target_distribution(point_mass):
    first, pairs = _stream_pvalues(point_mass)
    assert first > 1e-3 and pairs > 1e-3, (first, pairs)


# With a point mass q(x) = 1 >= p(x), so min(1, q/p) is "accept always": one n-gram case less.
@pytest.mark.parametrize("mistake, point_mass", [(m, pm) for m in WRONG for pm in (False, True)
                                                 if not (pm and m == "accept_min_q_over_p")])
def test_the_fit_test_catches_a_wrong_sampler(monkeypatch, mistake, point_mass):
    name, wrong = WRONG[mistake]
    monkeypatch.setattr(rs_module, name, wrong)
    first, pairs = _stream_pvalues(point_mass)
    assert min(first, pairs) < 1e-6, (first, pairs)
