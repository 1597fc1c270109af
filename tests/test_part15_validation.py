"""Part 15's configuration is validated in one place (config.py's `_problems`), and every entry point
calls it before a process starts or a weight loads: the server's main, LLMEngine (the offline LLM and
AsyncLLM build one), and the engine-core clients. No model is loaded here: the model path does not
exist, so an entry point that loaded first would fail on the path instead."""
from __future__ import annotations

import pytest

from part15_full.config import EngineConfig

MISSING = "/does/not/exist"

# (overrides, a fragment of the message): the static checks LLMEngine and core_client.py made
# themselves before, each now one of validate()'s.
MOVED = [
    (dict(speculative_method="medusa"), "--speculative-method must be one of unset, ngram, draft_model"),
    (dict(speculative_method="ngram", num_speculative_tokens=0), "--num-speculative-tokens must be at least 1"),
    (dict(speculative_model="some/draft"), "--speculative-model needs --speculative-method draft_model"),
    (dict(max_num_seqs=64, max_num_batched_tokens=32),
     "--max-num-batched-tokens (32) must be at least --max-num-seqs (64)"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=512, max_model_len=4096),
     "--no-enable-chunked-prefill needs --max-num-batched-tokens (512) >= --max-model-len (4096)"),
    (dict(preemption_mode="bogus"), "--preemption-mode must be one of recompute, swap, got 'bogus'"),
    (dict(preemption_mode="swap", speculative_method="draft_model", kv_offloading_size=1.0),
     "--preemption-mode swap does not swap a draft model's KV cache"),
]
MOVED_DP = [  # core_client.py's: the engines a host runs, and the port engines elsewhere connect to
    (dict(data_parallel_size=2, data_parallel_size_local=3), "--data-parallel-size-local must be in [0, "),
    (dict(data_parallel_size=4, data_parallel_size_local=2), "--data-parallel-rpc-port"),
]


@pytest.mark.parametrize("overrides,message", MOVED, ids=[",".join(o) for o, _ in MOVED])
def test_the_engines_checks_are_validates(overrides, message):
    with pytest.raises(ValueError, match="invalid configuration") as e:
        EngineConfig(**overrides).validate()
    assert message in str(e.value), str(e.value)


@pytest.mark.parametrize("overrides,message", MOVED_DP, ids=[",".join(o) for o, _ in MOVED_DP])
def test_the_clients_checks_are_validates(overrides, message):
    with pytest.raises(ValueError, match="invalid configuration") as e:
        EngineConfig(**overrides).validate()
    assert message in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="--data-parallel-rpc-port"):  # a --headless host's engines, too
        EngineConfig(data_parallel_size=2).validate(headless=True)


@pytest.mark.parametrize("overrides,message", MOVED, ids=[",".join(o) for o, _ in MOVED])
def test_llm_validates_before_it_loads_anything(overrides, message, monkeypatch):
    import part15_full.engine as engine
    from part15_full import LLM

    # A valid configuration gets as far as the model, which does not exist: a late check would fail there.
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(model=MISSING, device="cpu")

    def no_executor(config):
        raise AssertionError("an executor was built before the configuration was validated")

    monkeypatch.setattr(engine, "make_executor", no_executor)
    with pytest.raises(ValueError, match="invalid configuration") as e:
        LLM(model=MISSING, device="cpu", **overrides)
    assert message in str(e.value) and MISSING not in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="invalid configuration"):
        engine.LLMEngine(EngineConfig(model=MISSING, device="cpu", **overrides))


def test_the_engine_core_clients_validate_before_an_engine_starts(monkeypatch):
    import part15_full.core_client as core_client

    def no_engines(*args, **kwargs):
        raise AssertionError("an engine process was started before the configuration was validated")

    monkeypatch.setattr(core_client, "start_engines", no_engines)
    with pytest.raises(ValueError, match="invalid configuration") as e:
        core_client.AsyncMPClient(EngineConfig(model=MISSING, device="cpu", preemption_mode="bogus"))
    assert "--preemption-mode" in str(e.value)
    with pytest.raises(ValueError, match="invalid configuration") as e:  # before the router refuses the policy
        core_client.DPAsyncMPClient(EngineConfig(model=MISSING, device="cpu", data_parallel_size=2,
                                                 routing_policy="random", data_parallel_size_local=3))
    assert "--routing-policy" in str(e.value) and "--data-parallel-size-local" in str(e.value)


def test_an_engine_on_a_headless_host_passes_its_own_validation(monkeypatch):
    """A --headless host's flags may leave --data-parallel-size-local unset (one engine there): its
    engines are told the ranks they run, so LLMEngine's validate() (headless=False) accepts what the
    server's validate(headless=True) accepted."""
    import part15_full.core_client as core_client

    started = {}

    class FakeProcess:
        def __init__(self, target, args, name):
            started[args[1]] = args[0]

        def start(self):
            pass

    class FakeContext:
        Process = FakeProcess

    monkeypatch.setattr(core_client.mp, "get_context", lambda method: FakeContext())
    headless = EngineConfig(device="cpu", data_parallel_size=4, data_parallel_start_rank=2,
                            data_parallel_rpc_port=13345, data_parallel_address="10.0.0.1")
    headless.validate(headless=True)
    with pytest.raises(ValueError, match="--data-parallel-start-rank"):  # as an engine would have read it
        headless.validate()
    core_client.start_engines(headless, range(2, 3), "tcp://10.0.0.1:13345", "tcp://10.0.0.1:13346")
    assert list(started) == [2]
    engine_config = started[2]
    assert (engine_config.data_parallel_size_local, engine_config.data_parallel_start_rank) == (1, 2)
    engine_config.validate()
    engine_config.validate()  # it changes nothing: a second call answers as the first
    # The API server's host: engines 0..local-1.
    started.clear()
    front = EngineConfig(device="cpu", data_parallel_size=2)
    front.validate()
    core_client.start_engines(front, range(2), "tcp://127.0.0.1:1", "tcp://127.0.0.1:2")
    for rank, config in started.items():
        assert (config.data_parallel_size_local, config.data_parallel_start_rank) == (2, 0)
        config.validate()


def test_data_parallelism_with_ranks_across_nodes_is_refused(monkeypatch):
    monkeypatch.delenv("NNODES", raising=False)
    with pytest.raises(ValueError, match="invalid configuration") as e:
        EngineConfig(data_parallel_size=2, tensor_parallel_size=4, nnodes=2, node_rank=0, master_addr="10.0.0.1",
                     master_port=29500).validate()
    message = str(e.value)
    for flag in ("--data-parallel-size 2 with --nnodes 2", "--tensor-parallel-size", "--pipeline-parallel-size",
                 "--nnodes 1", "--data-parallel-size-local", "--data-parallel-address", "--data-parallel-rpc-port",
                 "--headless"):
        assert flag in message, (flag, message)
    # Data parallelism alone, on one host or over two; tensor parallelism alone across nodes.
    EngineConfig(data_parallel_size=2, tensor_parallel_size=2).validate()
    EngineConfig(data_parallel_size=4, data_parallel_size_local=2, data_parallel_rpc_port=13345,
                 data_parallel_address="10.0.0.1").validate()
    EngineConfig(data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=2,
                 data_parallel_rpc_port=13345, data_parallel_address="10.0.0.1").validate(headless=True)
    tp = dict(tensor_parallel_size=4, nnodes=2, master_addr="10.0.0.1", master_port=29500)
    EngineConfig(node_rank=0, **tp).validate()
    EngineConfig(node_rank=1, **tp).validate(headless=True)
    # Unset, --nnodes is the launcher's $NNODES, which the mp backend's ranks read.
    monkeypatch.setenv("NNODES", "2")
    with pytest.raises(ValueError, match=r"--data-parallel-size 2 with \$NNODES=2"):
        EngineConfig(data_parallel_size=2, tensor_parallel_size=2).validate()
    EngineConfig(data_parallel_size=2).validate()  # one process an engine: no rank reads $NNODES


def test_validate_accepts_what_the_engine_can_run(monkeypatch):
    """Connectors registered in this process (kv_connector_factory.py) and CUDA graphs on a CPU with
    VLLM_COURSE_GRAPH_STAND_IN=1 are refused only where the engine cannot run them."""
    from part15_full.kv_connector_factory import KVConnectorFactory

    mine = EngineConfig(device="cpu", kv_transfer_config={"kv_connector": "MyConnector"})
    with pytest.raises(ValueError, match="unknown kv_connector 'MyConnector'"):
        mine.validate()
    monkeypatch.setattr(KVConnectorFactory, "_registry", dict(KVConnectorFactory._registry))
    KVConnectorFactory.register_connector("MyConnector", "course_test_connector", "MyConnector")
    mine.validate()

    graphs = EngineConfig(device="cpu", compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"})
    monkeypatch.delenv("VLLM_COURSE_GRAPH_STAND_IN", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        graphs.validate()
    monkeypatch.setenv("VLLM_COURSE_GRAPH_STAND_IN", "1")
    graphs.validate()
