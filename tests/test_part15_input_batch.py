"""Part 15's step inputs from persistent state (input_batch.py): for every step of real engines on
randomized workloads (prefill chunks beside decodes, the previous step's tokens as placeholders,
n-gram drafts, recompute preemption and resumption, prefix-cache hits, requests aborted in the
middle of a batch), the tensors equal those the simple construction of parts 04-14 builds from the
same batch (part 14's runner builds the reference); and the block table's rows, reused and grown."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig

from part15_full.input_batch import BlockTable

from conftest import save_tiny

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("input_batch") / "tiny", LlamaConfig(**TINY), seed=0, scale=0.3)


def simple_inputs(batch, block_size: int):
    """Part 14's runner builds the step: Python lists per sequence, then one tensor per list."""
    from part14_quant.model_runner import ModelRunner as SimpleRunner

    simple = SimpleRunner.__new__(SimpleRunner)  # prepare_inputs reads only these three
    simple.block_size, simple.device, simple.drafter = block_size, torch.device("cpu"), None
    inp = SimpleRunner.prepare_inputs(simple, batch)
    as_list = lambda t: None if t is None else t.tolist()  # noqa: E731
    return (inp.input_ids.tolist(), inp.positions.tolist(), inp.metadata, inp.logits_indices.tolist(),
            as_list(inp.placeholder_slots), as_list(inp.placeholder_prev_rows))


class Checked:
    """Wraps a runner's prepare_inputs: every step's tensors against simple_inputs."""

    def __init__(self, runner):
        self.runner, self.steps, self.placeholders, self.drafts = runner, 0, 0, 0
        self.prepare = runner.prepare_inputs
        runner.prepare_inputs = self

    def __call__(self, batch, *args, **kwargs):
        inp = self.prepare(batch, *args, **kwargs)
        ids, positions, meta, last, slots, prev = simple_inputs(batch, self.runner.block_size)
        got = inp.metadata
        assert inp.input_ids.tolist() == ids and inp.positions.tolist() == positions
        assert inp.logits_indices.tolist() == last
        assert got.slot_mapping.tolist() == meta.slot_mapping.tolist()
        assert got.block_tables.tolist() == meta.block_tables.tolist()
        assert got.seq_lens.tolist() == meta.seq_lens.tolist()
        assert got.query_start_loc.tolist() == meta.query_start_loc.tolist()
        assert (got.max_query_len, got.max_seq_len) == (meta.max_query_len, meta.max_seq_len)
        assert got.slot_mapping.dtype == torch.int64 and got.block_tables.dtype == got.seq_lens.dtype == torch.int32
        assert (inp.placeholder_slots.tolist() if slots else None) == slots
        assert (inp.placeholder_prev_rows.tolist() if prev else None) == prev
        self.steps += 1
        self.placeholders += len(slots or [])
        self.drafts += sum(len(e.draft_token_ids) for e in batch)
        return inp


def run(tiny, monkeypatch, seed: int, **kw):
    """A randomized workload on a pool of 30 blocks of 4 tokens (preemptions): shared prefixes,
    lengths that need several chunks, aborts after a few steps. Returns the engine and its checker."""
    import part15_full.model_runner as model_runner
    from part15_full.config import EngineConfig
    from part15_full.engine import LLMEngine
    from shared.sampling_params import SamplingParams

    monkeypatch.setattr(model_runner, "num_blocks_for_budget", lambda *args: 30)
    config = EngineConfig(model=str(tiny), device="cpu", dtype="float32", num_threads=1, block_size=4,
                          max_num_batched_tokens=48, max_num_seqs=6, kv_cache_memory_mb=1, **kw)
    engine = LLMEngine(config)
    checked = Checked(engine.executor.runner)
    rng = random.Random(seed)
    prefix = [rng.randrange(2, 126) for _ in range(9)]
    ids = []
    for i in range(14):
        body = [rng.randrange(2, 126) for _ in range(rng.randrange(3, 40))]
        if i % 3 == 0:  # repetitive text: the n-gram proposer finds drafts
            body = body[:4] * 6
        prompt = (prefix if i % 2 else []) + body
        params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(4, 24), ignore_eos=True)
        ids.append(engine.add_request(engine.processor.process_inputs(prompt, params)).request_id)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps in (5, 9):  # an abort in the middle of running batches
            engine.abort_request(ids[steps])
    return engine, checked


@pytest.mark.parametrize("seed", [0, 1])
def test_async_steps_with_chunks_preemption_prefix_hits_and_aborts(tiny, monkeypatch, seed):
    engine, checked = run(tiny, monkeypatch, seed)
    assert checked.steps > 20 and checked.placeholders > 0
    assert engine.scheduler.num_preemptions > 0
    assert engine.prefix_cache_stats.hits > 0
    assert_every_row_given_back(engine)


def assert_every_row_given_back(engine):
    """The rows of sequences that finished in the last step go back with the next step's batch."""
    inputs = engine.executor.runner.input_batch
    inputs.prepare([], engine.scheduler.finished_seq_ids)
    assert not inputs.block_table.row_of


def test_speculative_steps_with_drafts_and_preemption(tiny, monkeypatch):
    engine, checked = run(tiny, monkeypatch, 2, speculative_method="ngram", num_speculative_tokens=3,
                          prompt_lookup_min=2, prompt_lookup_max=3)
    assert checked.steps > 10 and checked.drafts > 0 and engine.scheduler.num_preemptions > 0
    assert_every_row_given_back(engine)


def test_the_block_table_writes_only_new_blocks_reuses_rows_and_grows():
    table = BlockTable(2, 8)
    a = table.row("a", [5, 6])
    assert table.table[a, :2].tolist() == [5, 6]
    table.table[a, 0] = 99  # a row's written blocks are not written again...
    assert table.row("a", [5, 6, 7]) == a and table.table[a, :3].tolist() == [99, 6, 7]  # ...only new ones
    b = table.row("b", [1])
    c = table.row("c", [2, 3])  # a third sequence: the table doubles
    assert len({a, b, c}) == 3 and table.table.shape == (4, 8)
    table.remove("a")
    assert table.table[a].tolist() == [0] * 8  # a freed row reads the null block again
    assert table.row("d", [4]) == a  # the lowest free row first
    assert table.table[a, :2].tolist() == [4, 0]


@pytest.mark.parametrize("wait", [True, False])
def test_a_host_set_is_refilled_only_after_its_copies_are_done(wait):
    """Copies from pinned memory run while the host goes on, so the host set a step used must not be
    refilled before they are done. A stand-in device whose copies run only when their event is waited
    on (or at the very end): with the event waited on, every step's device arrays hold that step's
    inputs; without it (`wait=False`), the set reused after NUM_SETS steps is overwritten first."""
    from part15_full.input_batch import NUM_SETS, InputBatch
    from part15_full.runner_messages import SequenceBatchEntry

    pending, copied = [], []

    class Event:  # a CUDA event over the stand-in's queue of copies
        def __init__(self, run):
            self.run = run

        def synchronize(self):
            self.run()

    class DeferredCopies(InputBatch):
        def to_device(self, step):
            def run():
                if job in pending:
                    pending.remove(job)
                    InputBatch.to_device(self, step)
                    copied.append((expected, step.input_ids.tolist(), step.positions.tolist(),
                                   step.metadata.slot_mapping.tolist()))
            job = run
            expected = (step.input_ids.tolist(), step.positions.tolist(), step.metadata.slot_mapping.tolist())
            pending.append(job)
            self._copied[step.host_set] = Event(run) if wait else None

        def _record(self):
            return None

    batch = DeferredCopies(32, 4, 8, 4, torch.device("cpu"), vocab_size=100, pad_to=(16, 4))
    for step in range(NUM_SETS + 2):  # step NUM_SETS reuses step 0's set
        entries = [SequenceBatchEntry([10 * step + i], 5 + step + i, [1, 2, 3, 4], None, seq_id=str(i))
                   for i in range(3)]
        batch.to_device(batch.prepare(entries))
    for job in list(pending):  # the device catches up
        job()
    mismatched = [got for expected, *got in copied if tuple(got) != expected]
    assert len(copied) == NUM_SETS + 2
    assert (mismatched == []) == wait, mismatched
