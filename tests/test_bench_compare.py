"""The throughput harness's --compare: another part (or the same part with another setting)
measured beside ours, each given only the engine settings its own config knows."""
from __future__ import annotations

from shared.bench.throughput import _compared_engine


def test_a_compared_part_gets_the_settings_its_config_knows():
    shared_kwargs = {"kv_cache_memory_mb": 64, "enable_chunked_prefill": False}
    e = _compared_engine("part04_continuous_batching", None, "cpu", "float32", shared_kwargs)
    assert e.name == "part04" and e.spec == "part04_continuous_batching"
    assert e.engine_kwargs == {"kv_cache_memory_mb": 64}  # part 04 has no chunked prefill


def test_a_compared_setting_overrides_and_names_the_system():
    e = _compared_engine("part05_async_sched:async_scheduling=False,max_num_seqs=8", None, "cpu",
                         "float32", {"max_num_seqs": 32})
    assert e.name == "part05 async_scheduling=False max_num_seqs=8"
    assert e.engine_kwargs == {"max_num_seqs": 8, "async_scheduling": False}
