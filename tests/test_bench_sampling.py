"""The bench's --sampling (shared/bench/systems.py's Sampling): parsing refuses what no SamplingParams
takes, the pairs reach our engines' SamplingParams (sampled tokens are not the greedy ones; a seed
makes them repeat) and vLLM's through the peer runner (a fake `vllm`), the reports record them and
compare no tokens, and the HF baselines (greedy only) are refused. Tiny random model: seconds."""
from __future__ import annotations

import sys
import textwrap

import pytest

from shared.bench.host import run_host
from shared.bench.systems import GREEDY, Sampling, parse_sampling
from shared.bench.throughput import run_throughput
from shared.bench.tiny_model import make_tiny_model
from shared.bench.vllm_peer import VllmPeerSystem
from shared.bench.workload import make_workload


def test_parse_sampling_keeps_the_given_keys_and_refuses_unknown_ones():
    s = parse_sampling("temperature=1.0, top_p=0.9,top_k=50,repetition_penalty=1.1")
    assert s == Sampling(temperature=1.0, top_p=0.9, top_k=50, repetition_penalty=1.1) and not s.greedy
    assert s.kwargs() == {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.1}
    assert parse_sampling("seed=3").kwargs() == {"temperature": 1.0, "seed": 3}  # vLLM's default temperature
    assert parse_sampling(None) is GREEDY and GREEDY.kwargs() == {"temperature": 0.0}  # what the bench always sent
    with pytest.raises(ValueError, match=r"keys from .*temperature.*got 'temprature=1'"):
        parse_sampling("temprature=1")
    with pytest.raises(ValueError, match="top_k wants an integer, got '5.5'"):
        parse_sampling("top_k=5.5")
    with pytest.raises(ValueError, match="top_p must be in"):
        parse_sampling("top_p=0")
    assert Sampling.from_dict(s.to_dict()) == s and Sampling.from_dict(None) is GREEDY


def test_cli_refuses_an_unknown_key_before_loading_anything():
    from shared.bench.__main__ import main

    with pytest.raises(SystemExit, match="keys from"):
        main(["host", "--sampling", "nucleus=0.9"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny"))
    return model, make_workload(model, 4, "4:8", "6", seed=0)


def _run(tiny, sampling, **kw):
    model, w = tiny
    return run_throughput("part15_full", w, model=model, engine_kwargs={"load_format": "dummy", "max_num_seqs": 4},
                          baselines=(), floor=False, progress=False, keep_tokens=True, sampling=sampling, **kw)


def test_sampling_reaches_our_engines(tiny):
    greedy = _run(tiny, GREEDY, compare=["part04_continuous_batching"])
    seeded = parse_sampling("temperature=1.0,top_k=50,seed=7")
    first, again = _run(tiny, seeded, compare=["part04_continuous_batching"]), _run(tiny, seeded)
    for res in (greedy, first):
        assert all(s.error is None and s.lengths_ok for s in res.systems), [s.error for s in res.systems]
    for name in ("ours", "part04"):
        # Random weights of scale 1e-3: the logits are nearly flat, so temperature 1 draws all over the
        # vocabulary while greedy keeps its argmax; the seed makes the draw repeat.
        assert first.system(name).token_ids != greedy.system(name).token_ids
    assert again.system("ours").token_ids == first.system("ours").token_ids
    assert first.workload["sampling"] == {  # every field, for the JSON
        "temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": 0.0, "presence_penalty": 0.0,
        "frequency_penalty": 0.0, "repetition_penalty": 1.0, "seed": 7, "ignore_eos": True,
        "max_tokens": "output_len"}
    assert greedy.workload["sampling"]["temperature"] == 0.0
    table = first.table()
    assert "sampling: temperature=1.0, top_k=50, seed=7, ignore_eos" in table and "sampling:" not in greedy.table()
    row = {t: next(line for line in res.table().splitlines() if line.startswith("part04 "))
           for t, res in (("sampled", first), ("greedy", greedy))}
    assert row["sampled"].endswith(" not compared") and row["greedy"].endswith(" -")  # the same-tokens column
    assert first.system("part04").matches_ours is None


def test_unseeded_rounds_may_differ_and_hf_baselines_are_refused(tiny):
    res = _run(tiny, parse_sampling("temperature=1.0"), rounds=2)  # greedy would insist on equal rounds
    assert res.systems[0].error is None and len(res.systems[0].notes["round_walls_s"]) == 2
    with pytest.raises(ValueError, match="HF baselines .* greedy only"):
        run_throughput("part15_full", tiny[1], model=tiny[0], sampling=parse_sampling("temperature=1.0"),
                       floor=False)


def test_host_records_the_sampling(tiny):
    res = run_host("part15_full", [2], num_requests=4, input_len="4:8", output_len="3", model=tiny[0],
                   sampling=parse_sampling("temperature=0.8,top_p=0.9"))
    assert res.rows[0].error is None and res.rows[0].output_tokens == 12
    assert res.workload["sampling"]["top_p"] == 0.9 and res.workload["sampling"]["seed"] is None
    assert res.table().splitlines()[-1] == "sampling: temperature=0.8, top_p=0.9, ignore_eos, max_tokens=output_len"


# A vllm whose SamplingParams takes any keywords and whose LLM answers with the sampling it was given.
FAKE_VLLM = textwrap.dedent('''
    __version__ = "0.0.fake"
    class SamplingParams:
        def __init__(self, **kw):
            self.kw = kw
    class _Out:
        def __init__(self, ids): self.token_ids = ids
    class _Req:
        def __init__(self, ids): self.outputs = [_Out(ids)]
    class LLM:
        def __init__(self, **kw): pass
        def generate(self, prompts, params, use_tqdm=False):
            sp = params[0].kw
            assert sp["ignore_eos"] is True
            ids = [sp["top_k"] if "top_k" in sp else int(sp["temperature"])] * sp["max_tokens"]
            return [_Req(ids) for _ in prompts]
        def reset_prefix_cache(self):
            return True
''')


def test_sampling_reaches_vllm_through_the_runner(tmp_path, tiny):
    root = tmp_path / "site"
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    (root / "torch.py").write_text("__version__ = 'fake'\ndef set_num_threads(n): pass\n")
    w = tiny[1]
    for sampling, token in ((GREEDY, 0), (parse_sampling("temperature=1.0,top_k=50"), 50)):
        peer = VllmPeerSystem(sys.executable, "m", "float32", threads=2, env={"PYTHONPATH": str(root)},
                              load_timeout_s=20, generate_timeout_s=20, sampling=sampling)
        peer.load()
        try:
            assert peer.generate(w.requests) == [[token] * r.output_len for r in w.requests]
        finally:
            peer.close()
