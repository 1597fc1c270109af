"""deploy/README.md's setups, run as written: each bash block's commands are read from the file,
`$MODEL` becomes a tiny random Llama, the ports become free ones, and every setup but multi-node
must serve completions on loopback. The data-parallel setups must give the single server's tokens
(each engine is a whole engine: same weights, same arithmetic); the disaggregated ones must route
through every prefill and decode server. The Dockerfile and compose file are checked for what can
be checked without a container runtime: they parse, and every path they copy or name exists."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from conftest import free_port, free_port_run
from test_part13_disagg import end, wait_healthy
from test_part15_server import MODEL, TINY, tiny_model_folder

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
PROMPTS = ["The capital of France is", "Once upon a time, in a quiet village,"]


def setups() -> dict[str, list[str]]:
    """Section title -> its commands (continuations joined, trailing `&` dropped)."""
    text = (DEPLOY / "README.md").read_text()
    found, title = {}, None
    for block in re.split(r"(^### .*$)", text, flags=re.M):
        if block.startswith("### "):
            title = block[4:].strip()
            continue
        code = re.search(r"```bash\n(.*?)```", block, flags=re.S)
        if title and code:
            joined = code.group(1).replace("\\\n", " ")
            found[title] = [line.strip().rstrip("&").strip() for line in joined.splitlines() if line.strip()]
    return found


SETUPS = setups()


def test_the_readme_has_every_setup_the_lesson_names():
    names = {name.split(":")[0].split(" ")[0] for name in SETUPS}
    assert {"Single", "Tensor", "Data", "1P1D", "xPyD", "Multi-node"} <= names, SETUPS.keys()
    assert any("x tensor parallelism" in name for name in SETUPS)


def localised(commands: list[str], folder: Path, ports: dict[str, str]) -> list[list[str]]:
    """The commands with the tiny model and free ports (the same README port -> the same free port)."""
    out = []
    for command in commands:
        command = re.sub(r"(?<=--port )(\d+)|(?<=127\.0\.0\.1:)(\d+)",
                         lambda m: ports.setdefault(m.group(0), str(free_port())), command)
        argv = shlex.split(command.replace("$MODEL", str(folder)))
        assert argv[:2] == ["python", "-m"], command
        argv[0] = sys.executable
        if argv[2] == "part15_full.server":
            argv += ["--served-model-name", MODEL, *TINY, "--num-threads", "1"]
        elif argv[2] == "part15_full.disagg_serve":
            # Free ports for the trio, not --port's neighbours and the default side channel (the
            # decode server's side channel is --kv-port + 1).
            argv += ["--prefill-port", str(free_port()), "--decode-port", str(free_port()),
                     "--kv-port", str(free_port_run(2))]
            argv += ["--num-threads", "1", "--", "--model", str(folder), "--served-model-name", MODEL, *TINY]
        out.append(argv)
    return out


def front_port(argv: list[str]) -> str:
    return argv[argv.index("--port") + 1]


def complete(url: str) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 6 and body["choices"][0]["finish_reason"] == "length"
        texts.append(body["choices"][0]["text"])
    return texts


def requests_served(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{"))


def run_setup(commands: list[list[str]], logs: Path) -> tuple[list[subprocess.Popen], list[str]]:
    procs, urls = [], []
    for i, argv in enumerate(commands):
        with open(logs / f"{i}.log", "wb") as f:
            procs.append(subprocess.Popen(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        urls.append(f"http://127.0.0.1:{front_port(argv)}")
    return procs, urls


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tiny_model_folder(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def single(folder, tmp_path_factory) -> list[str]:
    """The single server's greedy texts: what the data-parallel setups must reproduce."""
    (argv,) = localised(SETUPS["Single server"], folder, {})
    logs = tmp_path_factory.mktemp("single")
    procs, (url,) = run_setup([argv], logs)
    try:
        wait_healthy(url, procs, logs / "0.log")
        return complete(url)
    finally:
        end(procs)


@pytest.mark.parametrize("title", [t for t in SETUPS if t.startswith(("Tensor", "Data"))])
def test_parallel_setups_serve(title, folder, single, tmp_path):
    (argv,) = localised(SETUPS[title], folder, {})
    procs, (url,) = run_setup([argv], tmp_path)
    try:
        wait_healthy(url, procs, tmp_path / "0.log", timeout=240)
        texts = complete(url)
        if "--tensor-parallel-size" not in argv:
            assert texts == single  # whole engines behind a router: the single server's tokens
    finally:
        end(procs)


def disaggregated(title: str) -> list[str]:
    """xPyD's block adds a prefill and a decode server to 1P1D's two and restarts the proxy."""
    if title.startswith("xPyD"):
        return [c for c in SETUPS[next(t for t in SETUPS if t.startswith("1P1D"))] if "part15_full.server" in c] \
            + SETUPS[title]
    return SETUPS[title]


@pytest.mark.parametrize("title", [t for t in SETUPS if t.startswith(("1P1D", "xPyD"))])
def test_disaggregated_setups_route_through_every_server(title, folder, tmp_path):
    commands = localised(disaggregated(title), folder, {})
    procs, urls = run_setup(commands, tmp_path)
    try:
        for i, (proc, url) in enumerate(zip(procs, urls)):
            wait_healthy(url, [proc], tmp_path / f"{i}.log", timeout=240)
        complete(urls[-1])
        servers = urls[:-1]
        # Round robin per role: two requests reach both servers of a role in 2P2D, one in 1P1D.
        assert all(requests_served(url) == 2 / (len(servers) // 2) for url in servers), \
            [requests_served(url) for url in servers]
    finally:
        end(procs)


def test_the_one_command_1p1d_launcher(folder, tmp_path):
    block = SETUPS[next(t for t in SETUPS if t.startswith("1P1D"))]
    line = re.search(r"`(python -m part15_full\.disagg_serve [^`]*)`",
                     (DEPLOY / "README.md").read_text()).group(1)
    assert block  # the launcher is named in the 1P1D section's text
    (argv,) = localised([line], folder, {})
    procs, (url,) = run_setup([argv], tmp_path)
    try:
        wait_healthy(url, procs, tmp_path / "0.log", timeout=240)
        complete(url)
    finally:
        end(procs)


def test_dockerfile_copies_what_exists_and_runs_the_server():
    lines = [line.strip() for line in (DEPLOY / "Dockerfile").read_text().splitlines()]
    instructions = [line.split()[0] for line in lines if line and not line.startswith("#")]
    known = {"FROM", "ARG", "ENV", "WORKDIR", "RUN", "COPY", "EXPOSE", "STOPSIGNAL", "ENTRYPOINT", "CMD"}
    assert instructions[0] == "FROM" and set(instructions) <= known, instructions
    for line in lines:
        if line.startswith("COPY"):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), source
        if line.startswith(("ENTRYPOINT", "CMD")):
            json.loads(line.split(maxsplit=1)[1])  # exec form, so SIGTERM reaches the server
    entry = json.loads(next(line for line in lines if line.startswith("ENTRYPOINT")).split(maxsplit=1)[1])
    assert entry[:3] == ["python", "-m", "part15_full.server"]


def test_compose_runs_1p1d_with_a_grace_period_beyond_the_drain():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"prefill", "decode", "proxy"}
    roles = {}
    for name in ("prefill", "decode"):
        command = services[name]["command"]
        roles[name] = json.loads(command[command.index("--kv-transfer-config") + 1])["kv_role"]
        timeout = float(command[command.index("--shutdown-timeout") + 1])
        assert float(services[name]["stop_grace_period"].rstrip("s")) > timeout
        assert (ROOT / services[name]["build"]["context"].replace("..", ".") /
                services[name]["build"]["dockerfile"]).exists()
    assert roles == {"prefill": "kv_producer", "decode": "kv_consumer"}
    proxy = services["proxy"]["command"]
    ports = {name: services[name]["command"][services[name]["command"].index("--port") + 1]
             for name in ("prefill", "decode")}
    assert proxy[proxy.index("--prefill") + 1].endswith(ports["prefill"])
    assert proxy[proxy.index("--decode") + 1].endswith(ports["decode"])
    assert all(services["proxy"]["depends_on"][s]["condition"] == "service_healthy" for s in ("prefill", "decode"))
