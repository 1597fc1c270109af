"""Part 13: prefill/decode disaggregation through KV connectors, with real server processes.

- Through the proxy, a prefill server process and a decode server process (NixlConnector, a real
  transfer over the side channel) give exactly the tokens of one part 12 engine: completions and
  chat, streamed and not, n = 2 with seeds, logprobs.
- The decode engine computes no prompt token but the last; a prefix already in its device cache is
  not transferred again.
- Failures: the prefill server gone before the decode engine reads its KV: `kv_load_failure_policy`
  recompute answers correctly, fail answers a shaped 503; blocks nobody reads expire and are freed;
  nothing is leaked on either side and no process outlives its test.
- ExampleConnector: a second engine, and the same one after a restart, find the prefix on disk.
- The 1P1D launcher serves through its proxy and ends all three processes on SIGTERM.
- `--kv-transfer-config` is validated (unknown fields and values refused).
The proxy itself is tested against fake servers in test_part13_proxy.py; part 12's host tier as the
OffloadingConnector runs part 12's own tests (test_part12_offload.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from conftest import free_port, free_port_run, greedy, release_memory, running_server
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("release_memory_after_each_test")

ROOT = Path(__file__).resolve().parent.parent
MODEL = "SmolLM2-135M-Instruct"
COMMON = ["--device", "cpu", "--dtype", "float32", "--kv-cache-memory-mb", "64", "--num-threads", "1"]


def nixl(role: str, **extra) -> dict:
    return {"kv_connector": "NixlConnector", "kv_role": role, "kv_connector_extra_config": extra}


def start_server(port: int, kv: dict, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "part13_disagg.server", "--port", str(port), *COMMON,
           "--kv-transfer-config", json.dumps(kv)]
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def tail(log: Path) -> str:
    """The log's end without the access lines of health polls, which would hide why a server is down."""
    return "\n".join(line for line in log.read_text().splitlines() if '"GET /health' not in line)[-3000:]


def wait_healthy(url: str, procs: list[subprocess.Popen], log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert all(p.poll() is None for p in procs), tail(log)
        assert time.monotonic() < deadline, f"{url} did not come up:\n{tail(log)}"
        time.sleep(0.2)


def end(procs) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.fixture(scope="module")
def reference():
    from part12_offload import LLM

    return LLM(device="cpu", dtype="float32", kv_cache_memory_mb=64)


@pytest.fixture(scope="module")
def disagg(tmp_path_factory):
    """A prefill server and a decode server (real processes) and the proxy in front of them."""
    from part13_disagg.proxy import build_app

    logs = tmp_path_factory.mktemp("disagg")
    p_port, d_port = free_port(), free_port()
    procs = [start_server(p_port, nixl("kv_producer"), logs / "prefill.log"),
             start_server(d_port, nixl("kv_consumer"), logs / "decode.log")]
    try:
        wait_healthy(f"http://127.0.0.1:{p_port}", procs, logs / "prefill.log")
        wait_healthy(f"http://127.0.0.1:{d_port}", procs, logs / "decode.log")
        with running_server(build_app([f"http://127.0.0.1:{p_port}"], [f"http://127.0.0.1:{d_port}"])) as url:
            yield url
    finally:
        end(procs)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village, there lived"]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_through_the_proxy_equal_one_engine(disagg, reference, stream):
    want = reference.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2))
    seeded = reference.generate(PROMPTS[0], SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=10))[0]
    c = client(disagg)
    for prompt, w in zip(PROMPTS, want):
        kw = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
        if stream:
            chunks = [ch for ch in c.completions.create(**kw, stream=True) if ch.choices]
            text = "".join(ch.choices[0].text for ch in chunks)
            lps = [x for ch in chunks if ch.choices[0].logprobs for x in ch.choices[0].logprobs.token_logprobs]
        else:
            r = c.completions.create(**kw)
            text, lps = r.choices[0].text, r.choices[0].logprobs.token_logprobs
        assert text == w.outputs[0].text
        want_lps = [d[t].logprob for t, d in zip(w.outputs[0].token_ids, w.outputs[0].logprobs)]
        assert lps == pytest.approx(want_lps, abs=1e-4)
    r = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0.8, seed=3, n=2)
    assert sorted(ch.text for ch in r.choices) == sorted(o.text for o in seeded.outputs)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_through_the_proxy_equals_one_engine(disagg, reference, stream):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = reference.tokenizer.apply_chat_template(messages)
    want = reference.generate(ids, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
    c = client(disagg)
    if stream:
        text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True) if ch.choices)
    else:
        text = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                         temperature=0).choices[0].message.content
    assert text == want


def in_process(kv: dict, **kw):
    """An engine of this process behind its server (its counters are readable), with a connector."""
    from part13_disagg import LLM

    return LLM(device="cpu", dtype="float32", kv_cache_memory_mb=64, kv_transfer_config=kv, **kw)


def serve(llm):
    from part13_disagg.async_llm import AsyncLLM
    from part13_disagg.server import build_app

    return running_server(build_app(AsyncLLM(llm.engine), MODEL))


def pool_full(llm) -> bool:
    kv = llm.engine.kv_cache_manager
    return kv.num_free_blocks == llm.engine.executor.num_blocks - 1 and not kv.req_to_blocks


def prefill_then_decode(p_url: str, d_url: str, prompt, **body) -> httpx.Response:
    """The proxy's two requests, by hand."""
    first = httpx.post(f"{p_url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                          "kv_transfer_params": {"do_remote_decode": True}}, timeout=60)
    assert first.status_code == 200, first.text
    params = first.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_block_ids"]
    return httpx.post(f"{d_url}/v1/completions", json={"model": MODEL, "prompt": prompt, "kv_transfer_params": params,
                                                        "max_tokens": 8, "temperature": 0, **body}, timeout=60)


def test_the_decode_engine_computes_only_the_last_prompt_token_and_reuses_its_cache(reference, tmp_path):
    """A real prefill process; the decode engine in this process, so its steps can be counted."""
    p_port = free_port()
    prefill = start_server(p_port, nixl("kv_producer"), tmp_path / "prefill.log")
    decode = in_process(nixl("kv_consumer"))
    try:
        wait_healthy(f"http://127.0.0.1:{p_port}", [prefill], tmp_path / "prefill.log")
        scheduled: dict[str, int] = {}
        schedule = decode.engine.scheduler.schedule

        def counting():
            out = schedule()
            for seq, n in out.scheduled:
                if seq.num_output_tokens <= 1:  # its prompt tokens (and the first sample)
                    scheduled[seq.request.request_id] = scheduled.get(seq.request.request_id, 0) + n
            return out

        decode.engine.scheduler.schedule = counting
        worker = decode.engine.executor.runner.kv_connector
        prompt = reference.tokenizer.encode("A long shared prefix about paged attention and KV caches. " * 6)
        with serve(decode) as d_url:
            r = prefill_then_decode(f"http://127.0.0.1:{p_port}", d_url, prompt, ignore_eos=True)
            assert r.status_code == 200, r.text
            want = reference.generate(prompt, greedy(8))[0].outputs[0].text
            assert r.json()["choices"][0]["text"] == want
            assert list(scheduled.values()) == [1]  # one prompt token computed: the last
            first_blocks = worker.blocks_received
            assert first_blocks == -(-(len(prompt) - 1) // 16)
            # The same prefix again: the decode engine's own cache has its full blocks.
            r = prefill_then_decode(f"http://127.0.0.1:{p_port}", d_url, prompt + [42], ignore_eos=True)
            assert r.status_code == 200
            assert worker.blocks_received - first_blocks < first_blocks  # only what its cache lacks
        assert pool_full(decode)
    finally:
        end([prefill])
        decode.shutdown()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_prefill_engine_gone_before_the_read(reference, tmp_path, policy):
    """The prefill server dies after answering and before the decode engine pulls its KV."""
    p_port = free_port()
    prefill = start_server(p_port, nixl("kv_producer"), tmp_path / "prefill.log")
    decode = in_process({**nixl("kv_consumer", transfer_timeout_s=3), "kv_load_failure_policy": policy})
    try:
        wait_healthy(f"http://127.0.0.1:{p_port}", [prefill], tmp_path / "prefill.log")
        prompt = "The three primary colors are red, yellow and"
        first = httpx.post(f"http://127.0.0.1:{p_port}/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        params = first.json()["kv_transfer_params"]
        end([prefill])
        with serve(decode) as d_url:
            r = httpx.post(f"{d_url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 8,
                                                            "temperature": 0, "kv_transfer_params": params}, timeout=60)
            if policy == "recompute":
                want = reference.generate(prompt, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
            else:
                assert r.status_code == 503 and "could not be loaded" in r.json()["error"]["message"]
            ok = httpx.post(f"{d_url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
            assert ok.status_code == 200  # it keeps serving
        assert pool_full(decode)
    finally:
        end([prefill])
        decode.shutdown()


def test_blocks_nobody_reads_expire_and_are_freed():
    prefill = in_process(nixl("kv_producer", blocks_expiry_s=1))
    try:
        with serve(prefill) as p_url:
            body = {"model": MODEL, "prompt": "Blocks held for a decode engine that never comes.", "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": True}}
            assert httpx.post(f"{p_url}/v1/completions", json=body).status_code == 200
            assert prefill.engine.scheduler.sending  # held for the reader
            deadline = time.monotonic() + 15
            while prefill.engine.scheduler.sending and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not prefill.engine.scheduler.sending and pool_full(prefill)
    finally:
        prefill.shutdown()


def test_a_decode_request_aborted_while_its_kv_is_loading_frees_its_blocks(tmp_path):
    """The client leaves while the decode engine waits for KV from a prefill server that is gone: the
    blocks stay with the copy until it gives up, then go back to the pool."""
    p_port = free_port()
    prefill = start_server(p_port, nixl("kv_producer"), tmp_path / "prefill.log")
    decode = in_process(nixl("kv_consumer", transfer_timeout_s=3))
    try:
        wait_healthy(f"http://127.0.0.1:{p_port}", [prefill], tmp_path / "prefill.log")
        prompt = "A request whose client leaves before its KV arrives, and whose blocks must come back."
        first = httpx.post(f"http://127.0.0.1:{p_port}/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        params = first.json()["kv_transfer_params"]
        os.killpg(prefill.pid, signal.SIGSTOP)  # alive but silent: the pull waits for its timeout
        with serve(decode) as d_url:
            with pytest.raises(httpx.ReadTimeout):  # the client gives up while the KV is loading
                httpx.post(f"{d_url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 8,
                                                           "kv_transfer_params": params},
                           timeout=httpx.Timeout(30, read=1.0))
            assert decode.engine.scheduler.loading  # its blocks are still the copy's
            deadline = time.monotonic() + 15
            while not pool_full(decode) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert pool_full(decode) and not decode.engine.scheduler.loading
    finally:
        os.killpg(prefill.pid, signal.SIGCONT)
        end([prefill])
        decode.shutdown()


def test_example_connector_finds_the_prefix_on_disk_in_another_engine_and_after_a_restart(reference, tmp_path):
    kv = {"kv_connector": "ExampleConnector", "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
    prompt = reference.tokenizer.encode("Stored once, read by every engine that sees this prefix again. " * 4)
    want = reference.generate(prompt, greedy(6))[0].outputs[0].token_ids
    computed = []
    for _ in range(3):  # the writer, a second engine, and a restart of it
        llm = in_process(kv)
        schedule = llm.engine.scheduler.schedule
        counts = []
        llm.engine.scheduler.schedule = lambda: (out := schedule(), counts.append(out.num_batched_tokens))[0]
        assert llm.generate(prompt, greedy(6))[0].outputs[0].token_ids == want
        computed.append(sum(counts))
        assert pool_full(llm)
        llm.shutdown()
        del llm, schedule  # let this engine go before the next one loads (two at once: +1 GB)
        release_memory()
    stored = (len(prompt) - 1) // 16 * 16
    assert computed[1] == computed[2] == computed[0] - stored
    assert len(list(tmp_path.glob("*.safetensors"))) == (len(prompt) - 1) // 16 + (len(prompt) % 16 == 0)


def launch(port: int, log: Path, *server_flags: str) -> subprocess.Popen:
    # the decode server's side channel is --kv-port + 1
    ports = ["--prefill-port", str(free_port()), "--decode-port", str(free_port()), "--kv-port", str(free_port_run(2))]
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", "part13_disagg.disagg_serve", "--port", str(port), *ports,
                                 "--num-threads", "1", "--", *server_flags], cwd=ROOT, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)


def test_the_launcher_serves_and_ends_all_three_on_sigterm(reference, tmp_path):
    port = free_port()
    log = tmp_path / "launcher.log"
    launcher = launch(port, log, *COMMON[:-2])
    try:
        wait_healthy(f"http://127.0.0.1:{port}", [launcher], log, timeout=180)
        r = client(f"http://127.0.0.1:{port}").completions.create(model=MODEL, prompt="The capital of France is",
                                                                   max_tokens=6, temperature=0)
        want = reference.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=6))
        assert r.choices[0].text == want[0].outputs[0].text
        children = [int(x) for x in subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True,
                                                   text=True).stdout.split()]
        assert len(children) == 2
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 20
        while any(Path(f"/proc/{c}").exists() for c in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(Path(f"/proc/{c}").exists() for c in children)
    finally:
        end([launcher])


def test_the_launcher_stops_when_a_server_fails_to_start(tmp_path):
    """A server that exits (here: a flag it refuses) must end the launcher with code 1, not leave a proxy
    answering 503 forever."""
    log = tmp_path / "launcher.log"
    launcher = launch(free_port(), log, *COMMON[:-2], "--no-such-flag")
    try:
        assert launcher.wait(timeout=120) == 1, tail(log)
        assert "server exited with code 2; stopping" in log.read_text()
        assert subprocess.run(["pgrep", "-g", str(launcher.pid)], capture_output=True).stdout == b""
    finally:
        end([launcher])


def test_bad_kv_transfer_configs_are_refused():
    from part13_disagg.config import KVTransferConfig

    with pytest.raises(ValueError, match="unknown field"):
        KVTransferConfig.from_cli('{"kv_connector": "NixlConnector", "kv_rol": "kv_both"}')
    with pytest.raises(ValueError, match="kv_role"):
        KVTransferConfig.from_cli({"kv_connector": "NixlConnector", "kv_role": "both"})
    with pytest.raises(ValueError, match="fail or recompute"):
        KVTransferConfig.from_cli({"kv_connector": "NixlConnector", "kv_load_failure_policy": "retry"})
    with pytest.raises(ValueError, match="unknown kv_connector"):
        in_process({"kv_connector": "MooncakeConnector"})


def test_the_factory_imports_a_connector_only_when_one_is_built(tmp_path, monkeypatch):
    """kv_connector_factory.py registers a module and a class by name and imports the module when a
    connector of that name is built, not before; a connector of one's own registers the same way."""
    import sys

    from part13_disagg.config import KVTransferConfig
    from part13_disagg.kv_connector import KVConnectorRole
    from part13_disagg.kv_connector_factory import KVConnectorFactory, make_connector

    (tmp_path / "course_test_connector.py").write_text(
        "from part13_disagg.kv_connector import KVConnectorBase\n\n\nclass MyConnector(KVConnectorBase):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(KVConnectorFactory, "_registry", dict(KVConnectorFactory._registry))
    KVConnectorFactory.register_connector("MyConnector", "course_test_connector", "MyConnector")
    assert "course_test_connector" not in sys.modules
    for role in KVConnectorRole:
        connector = make_connector(KVTransferConfig("MyConnector"), role, 16)
        assert type(connector).__name__ == "MyConnector" and connector.role is role
    monkeypatch.delitem(sys.modules, "course_test_connector")
    with pytest.raises(ValueError, match="already registered"):
        KVConnectorFactory.register_connector("ExampleConnector", ".example_connector", "ExampleConnector")
