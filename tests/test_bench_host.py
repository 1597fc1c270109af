"""The host-overhead benchmark (shared/bench/host.py): the tiny model folder (a config and a real
tokenizer, random weights) and the per-step table over batch sizes, for two engines."""
from __future__ import annotations

import json

from transformers import AutoTokenizer

from shared.bench.host import run_host, save_json
from shared.bench.tiny_model import CONFIG, make_tiny_model


def test_the_tiny_model_has_its_shapes_and_a_tokenizer_that_decodes_every_id(tmp_path):
    path = make_tiny_model(tmp_path / "tiny")
    assert json.loads((path / "config.json").read_text())["hidden_size"] == CONFIG["hidden_size"] == 128
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == CONFIG["vocab_size"]
    assert all(isinstance(tok.decode([i]), str) for i in range(0, CONFIG["vocab_size"], 97))
    assert make_tiny_model(path) == path  # kept, not written again


def test_each_engine_at_each_batch_size(tmp_path):
    model = str(make_tiny_model(tmp_path / "tiny"))
    res = run_host("part15_full", [1, 4], compare=["part04_continuous_batching"], num_requests=8,
                   input_len="4:8", output_len="5", model=model)
    assert [(r.system, r.batch) for r in res.rows] == [("ours", 1), ("part04", 1), ("ours", 4), ("part04", 4)]
    assert all(r.error is None and r.output_tokens == 40 and r.ms_per_step > 0 for r in res.rows)
    row = res.rows[2]
    assert abs(row.ms_per_step - 1e3 * row.wall_s * 4 / 40) < 1e-9  # wall time over the steps 40 tokens need at 4
    lines = res.table().splitlines()
    assert lines[0].split() == ["ms", "per", "step", "batch", "1", "batch", "4"] and len(lines) == 3
    save_json(res, tmp_path / "host.json")
    saved = json.loads((tmp_path / "host.json").read_text())
    assert len(saved["rows"]) == 4 and saved["workload"]["num_requests"] == 8


def test_step_profile_counts_the_engine_steps_it_times(tmp_path):
    """shared/bench/step_profile.py (the GPU script's decode-step profile) on the CPU: one batch of 3
    prompts that fit one step, then 5 tokens each: a prefill step that samples the first token, 4
    decode steps; with async scheduling, one more (launched before the last tokens were known)."""
    from shared.bench.step_profile import profile_decode

    model = str(make_tiny_model(tmp_path / "tiny"))
    r = profile_decode("part15_full", model, 3, 5, 8, "cpu", None, "dummy", {"async_scheduling": False})
    assert r["steps"] == 5 and r["batch"] == 3 and r["device"] == "cpu"
    assert r["wall_ms_per_step"] > 0 and r["kernel_ms_per_step"] == 0.0
    assert profile_decode("part15_full", model, 3, 5, 8, "cpu", None, "dummy", {})["steps"] == 6
