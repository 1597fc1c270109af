"""Part 15's sampler (sampler.py) on the persistent batch's tensors (sampling_metadata.py) against the
shared sampler every earlier part uses: the same tokens, logprobs and ranks for every knob (greedy
rows beside seeded random ones, temperature, top-k alone and with top-p and min-p, each penalty,
tokens banned until min_tokens, logit_bias), with a history whose newest token is still in flight
(patched in on the device), and with rows written once and reused across steps."""
from __future__ import annotations

import random
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from part15_full.sampler import Sampler
from part15_full.sampling_metadata import SamplingState
from shared.sampler import Sampler as RowSampler, SamplingRow, make_generator
from shared.sampling_params import SamplingParams

V = 300


@dataclass
class Entry:  # the two fields of a SequenceBatchEntry the sampling metadata reads
    sampling: SamplingRow
    prev_row: int | None = None


KNOBS = [
    dict(temperature=0.0),
    dict(temperature=0.7),
    dict(temperature=1.0, top_k=5),
    dict(temperature=1.3, top_k=40, top_p=0.8),
    dict(temperature=0.9, top_p=0.5),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=1.0, top_k=20, min_p=0.05, top_p=0.95),
    dict(temperature=1.0, repetition_penalty=1.3),
    dict(temperature=0.0, repetition_penalty=0.8, frequency_penalty=0.5),
    dict(temperature=1.0, presence_penalty=1.0, frequency_penalty=-0.5, top_k=10),
    dict(temperature=1.0, logit_bias={3: 5.0, 17: -100.0, 250: 2.5}),
    dict(temperature=0.0, logit_bias={9: 100.0}),
    dict(temperature=1.0, logprobs=3),
    dict(temperature=0.0, logprobs=0),
    dict(temperature=1.0, top_k=V + 50),  # larger than the vocabulary: no limit
]


def rows_for(knobs: list[dict], rng: random.Random, step: int) -> list[SamplingRow]:
    rows = []
    for i, k in enumerate(knobs):
        params = SamplingParams(max_tokens=64, seed=1000 + i, **k)
        prompt = [rng.randrange(V) for _ in range(rng.randrange(1, 12))]
        output = [rng.randrange(V) for _ in range(step + rng.randrange(0, 3))]
        banned = (0, 7, 11)[:1 + i % 3] if i % 4 == 1 else ()
        rows.append(SamplingRow(params, make_generator(params.seed, torch.device("cpu")), prompt, output, banned))
    return rows


def check(knobs: list[dict], steps: int, seed: int, in_flight: bool = False) -> int:
    """Steps of a batch through both samplers, each row with its own generator in each (advancing
    alike). Returns how many tokens were compared."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    ours, ref = Sampler(), RowSampler()
    state = SamplingState(len(knobs) + 3, V)
    order = list(range(len(knobs)))
    rng.shuffle(order)
    rows = np.array([r + 2 for r in order], dtype=np.int64)  # persistent rows, not batch order
    ref_rows = rows_for(knobs, rng, 0)
    ours_rows = [replace(r, generator=make_generator(r.params.seed, torch.device("cpu"))) for r in ref_rows]
    prev_sampled = torch.tensor([rng.randrange(V) for _ in range(len(knobs) + 4)])
    compared = 0
    for step in range(steps):
        logits = torch.randn(len(knobs), V) * 3
        entries = []
        for i, (r_ref, r_ours) in enumerate(zip(ref_rows, ours_rows)):
            prev_row = (i + step) % len(prev_sampled) if in_flight and r_ref.params.has_penalties else None
            if prev_row is not None:  # ours lacks its newest token: the device holds it
                r_ref = ref_rows[i] = replace(r_ref, output_token_ids=r_ref.output_token_ids + [int(prev_sampled[prev_row])])
            entries.append(Entry(r_ours, prev_row))
            if not state.written[rows[i]]:
                state.write(int(rows[i]), r_ours)
        meta = state.metadata(rows, entries)
        # Bans, logit_bias and penalties: the very same logits (a penalty on one token seldom moves a sample).
        assert torch.equal(Sampler.process_logits(logits, meta, prev_sampled), RowSampler.process_logits(logits, ref_rows))
        want = ref.sample(logits.clone(), ref_rows).to_output()
        got = ours.sample(logits.clone(), meta, prev_sampled).to_output()
        assert got.token_ids == want.token_ids, step
        assert got.logprobs == want.logprobs and got.ranks == want.ranks and got.top_logprobs == want.top_logprobs
        compared += len(got.token_ids)
        # The next step: each row's history grows by its token; the banned rows' bans lift.
        for i, tok in enumerate(want.token_ids):
            ours_rows[i] = replace(ours_rows[i], output_token_ids=ref_rows[i].output_token_ids + [tok],
                                   banned_token_ids=() if step else ours_rows[i].banned_token_ids)
            ref_rows[i] = replace(ref_rows[i], output_token_ids=ref_rows[i].output_token_ids + [tok],
                                  banned_token_ids=ours_rows[i].banned_token_ids)
    return compared


@pytest.mark.parametrize("seed", [0, 1])
def test_every_knob_samples_the_shared_samplers_tokens(seed):
    assert check(KNOBS, steps=6, seed=seed) == 6 * len(KNOBS)


def test_every_random_row_with_a_top_k_samples_among_its_candidates_alone():
    """Every random row has a top-k, so only the best max(top_k) are sorted: still the same tokens
    (a seeded row's noise is drawn over the whole vocabulary and read at its candidates)."""
    knobs = [k for k in KNOBS if k.get("top_k", 0) or k["temperature"] == 0.0]
    assert check(knobs, steps=8, seed=3) == 8 * len(knobs)


def test_a_history_token_still_in_flight_is_patched_in_from_the_device():
    assert check(KNOBS, steps=4, seed=5, in_flight=True) == 4 * len(KNOBS)


def test_penalties_on_every_row_are_applied_in_place():
    knobs = [k for k in KNOBS if any(name.endswith("_penalty") for name in k)]
    assert len(knobs) == 3 and check(knobs, steps=4, seed=7, in_flight=True) == 4 * len(knobs)


def test_a_wrong_candidate_set_is_caught():
    """The check above fails on a sampler that keeps one candidate fewer than the largest top-k."""
    from part15_full import sampler as module

    real = module.mask_sorted_logits

    def one_short(best, top_k, top_p, min_p):
        return real(best, (top_k - 1).clamp(min=1), top_p, min_p)
    module.mask_sorted_logits = one_short
    try:
        with pytest.raises(AssertionError):
            check([dict(temperature=1.0, top_k=3)] * 4, steps=6, seed=0)
    finally:
        module.mask_sorted_logits = real


def test_rows_are_written_once_and_freed():
    state = SamplingState(2, V)
    row = SamplingRow(SamplingParams(temperature=0.5, top_k=7, seed=3), make_generator(3, torch.device("cpu")))
    state.write(1, row)
    meta = state.metadata(np.array([1]), [Entry(row)])
    assert meta.row("temperature").tolist() == [0.5] and meta.max_top_k == 7 and meta.generators[0][0] == 0
    assert not meta.all_greedy and meta.all_random and not meta.penalties
    state.remove(1)
    assert not state.written[1] and 1 not in state.generators
    state.grow(5)
    assert state.params.shape[1] == 5 and not state.written[4]
