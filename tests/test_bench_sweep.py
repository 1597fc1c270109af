"""`python -m part15_full.bench sweep` (shared/bench/sweep.py): a server per point of a grid,
`bench serve` against each, the best point that meets the SLOs.

Most tests run tests/sweep_stub_server.py as the server: its speed at each point is scripted with
margins of hundreds of milliseconds to seconds (sleeps only lengthen, so a point scripted to miss
a TTFT target always misses it), and it leaves a file named for its process id, so the tests can
check that every server the sweep started is gone. One test sweeps part 15's own server on a tiny
random model and checks the structure of the result, not its speeds."""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import free_port
from part15_full import bench
from shared.bench import sweep

ROOT = Path(__file__).resolve().parent.parent
STUB = Path(__file__).resolve().parent / "sweep_stub_server.py"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from test_part15_server import tiny_model_folder

    return tiny_model_folder(tmp_path_factory.mktemp("tiny"))


def stub_cmd(pid_dir: Path, plan: dict) -> str:
    return shlex.join([sys.executable, str(STUB), "--pid-dir", str(pid_dir), "--plan", json.dumps(plan)])


def client_flags(tiny: Path, prompts: int = 4, output_len: int = 6) -> list[str]:
    return ["--tokenizer", str(tiny), "--random-input-len", "4", "--random-output-len", str(output_len),
            "--num-prompts", str(prompts), "--no-progress", "--server-ready-timeout", "120"]


def started(pid_dir: Path) -> list[int]:
    return [int(f.name) for f in pid_dir.iterdir() if f.name.isdigit()]


def assert_gone(pids: list[int], timeout: float = 15.0) -> None:
    """Every process (and process group) has ended; a zombie handed to init is reaped meanwhile."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, f"server {pid} is still running"
            time.sleep(0.1)


# ---------------------------------------------------------------- the best point, on the stub

# (seconds to the first token, seconds between tokens) per "max_num_seqs,max_num_batched_tokens".
# With 4 requests of 6 tokens sent at once, a point's run lasts about one request: 8,256 about
# 3.05 s, 8,512 about 1.55 s, 16,256 about 0.7 s but every first token after 700 ms, past the
# 600 ms target; 16,512 exits before it listens.
PLAN = {"8,256": [0.05, 0.6], "8,512": [0.05, 0.3], "16,256": [0.7, 0.0], "16,512": "exit"}


def test_sweep_picks_the_fastest_point_that_meets_the_slos_and_stops_every_server(tiny, tmp_path, capsys):
    pids, out = tmp_path / "pids", tmp_path / "out"
    pids.mkdir()
    rc = bench.main(["sweep", "--max-num-seqs", "8,16", "--max-num-batched-tokens", "256,512",
                     "--serve-cmd", stub_cmd(pids, PLAN), "--goodput", "ttft:600", "-o", str(out),
                     "--port", str(free_port()), *client_flags(tiny)])  # one port, each server in turn
    printed = capsys.readouterr().out
    assert rc == 0
    assert_gone(started(pids))
    assert len(started(pids)) == 4  # one server per point, the one that failed included

    data = json.loads((out / "sweep.json").read_text())
    assert data["best"] == {"--max-num-seqs": "8", "--max-num-batched-tokens": "512"}
    points = {tuple(p["flags"].values()): p for p in data["points"]}
    assert list(points) == [("8", "256"), ("8", "512"), ("16", "256"), ("16", "512")]
    for key in (("8", "256"), ("8", "512")):
        assert points[key]["meets"] and points[key]["good_completed"] == 4
        assert points[key]["result"]["completed"] == 4 and points[key]["result"]["total_output_tokens"] == 24
    assert not points["16", "256"]["meets"] and points["16", "256"]["good_completed"] == 0
    assert points["16", "256"]["result"]["completed"] == 4  # served every request, but too late
    assert points["16", "512"]["result"] is None and "status 1" in points["16", "512"]["error"]
    assert "invalid configuration at this point" in points["16", "512"]["error"]  # the server's own words
    assert sorted(f.name for f in out.glob("bench-*.json")) == ["bench-0.json", "bench-1.json", "bench-2.json"]
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    table = printed[printed.index("  max_num_seqs"):]
    rows = table.splitlines()
    assert rows[2].startswith("* ") and rows[2].split()[1:3] == ["8", "512"]  # the best, marked
    assert "misses the targets" in rows[3] and "failed: the server exited with status 1" in rows[4]
    assert "best_max_num_seqs: 8, best_num_batched_tokens: 512, best_throughput:" in table
    assert "targets: 99% of requests meet ttft:600" in table


def test_a_server_that_never_comes_up_is_stopped(tiny, tmp_path, capsys):
    pids = tmp_path / "pids"
    pids.mkdir()
    rc = bench.main(["sweep", "--max-num-seqs", "8", "--serve-cmd", stub_cmd(pids, {"8,1024": "hang"}),
                     *client_flags(tiny), "--server-ready-timeout", "2"])
    printed = capsys.readouterr().out
    assert rc == 1 and "not ready after 2 s" in printed and "no point meets the targets" in printed
    assert len(started(pids)) == 1
    assert_gone(started(pids))


@pytest.mark.parametrize("argv, message", [
    ([], "the grid is empty"),
    (["--max-num-seqs", ""], "give comma-separated values"),
    (["--max-num-seqs", "8,x"], "x is not a positive integer"),
    (["--max-num-batched-tokens", "256,256"], "a value is repeated"),
    (["--grid", "num-speculative-tokens"], "want FLAG=V1,V2"),
    (["--max-num-seqs", "8", "--grid", "max-num-seqs=1,2"], "a flag is on two axes"),
    (["--max-num-seqs", "8", "--base-url", "http://127.0.0.1:9"], "the sweep starts its own servers"),
    (["--max-num-seqs", "8", "--goodput", "itl:5"], "goodput"),
    (["--max-num-seqs", "8", "--serve-cmd", ""], "--serve-cmd is empty"),
    (["--max-num-seqs", "8", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_sweep_refuses_an_empty_grid_and_bad_flags_before_starting_anything(tiny, tmp_path, capsys, argv, message):
    pids = tmp_path / "pids"
    pids.mkdir()
    with pytest.raises(SystemExit) as e:
        bench.main(["sweep", "--serve-cmd", stub_cmd(pids, {}), *client_flags(tiny), *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert started(pids) == []


def test_sweep_ends_at_a_flag_the_server_refuses(tiny, tmp_path, capsys):
    pids, out = tmp_path / "pids", tmp_path / "out"
    pids.mkdir()
    rc = bench.main(["sweep", "--max-num-seqs", "8,16", "--grid", "no-such-server-flag=1,2",
                     "--serve-cmd", stub_cmd(pids, {}), "-o", str(out), *client_flags(tiny)])
    err = capsys.readouterr().err
    assert rc == 2 and "the server refused its command line" in err
    assert "unrecognized arguments: --no-such-server-flag 1" in err  # argparse's words, from the server's log
    assert [f.name for f in out.glob("server-*.log")] == ["server-0.log"]  # no second start


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_sweep_stops_its_server(tiny, tmp_path, sig):
    """The sweep in a process of its own, its server answering slowly; the signal arrives while the
    benchmark waits on it."""
    pids = tmp_path / "pids"
    pids.mkdir()
    cmd = [sys.executable, "-m", "part15_full.bench", "sweep", "--max-num-seqs", "8,16",
           "--serve-cmd", stub_cmd(pids, {"8,1024": [60.0, 0.0]}), *client_flags(tiny)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not list(pids.glob("requests-*")):  # the server is up and a request is in flight
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and "interrupted: the sweep stopped the server it had started" in err
    assert len(started(pids)) == 1  # the second point never started
    assert_gone(started(pids))


# ---------------------------------------------------------------- the report alone


def _point(seqs: str, thr: float | None, meets: bool) -> sweep.SweepPoint:
    result = None if thr is None else {"request_throughput": thr, "output_throughput": 10 * thr, "completed": 4,
                                       "failed": 0, "median_ttft_ms": 12.0, "p99_e2el_ms": 99.0}
    return sweep.SweepPoint({"--max-num-seqs": seqs}, result, None if thr else "the server exited", None, meets)


def test_table_and_plot_of_one_axis():
    import matplotlib

    matplotlib.use("Agg")
    res = sweep.SweepResult([("--max-num-seqs", ["8", "16", "32"])],
                            [_point("8", 1.0, True), _point("16", 3.0, False), _point("32", None, False)], None, 0.99)
    assert res.best is res.points[0]  # the faster 16 misses the targets
    table = res.table()
    assert table.splitlines()[1].startswith("* ") and "best: --max-num-seqs 8 (1.00 req/s" in table
    assert "best_max_num_seqs: 8, best_num_batched_tokens: 0, best_throughput: 1.00" in table
    fig = sweep.plot_sweep(res)
    assert len(fig.axes[0].patches) == 3
    none = sweep.SweepResult(res.axes, [_point("8", 1.0, False)], None, 0.99)
    assert none.best is None and "no point meets the targets" in none.table()
    assert sweep.grid_points([("--a", ["1", "2"]), ("--b", ["x", "y"])]) == [
        {"--a": "1", "--b": "x"}, {"--a": "1", "--b": "y"}, {"--a": "2", "--b": "x"}, {"--a": "2", "--b": "y"}]
    assert sweep.flag_args({"--enable-prefix-caching": "false", "--max-num-seqs": "8"}) == [
        "--no-enable-prefix-caching", "--max-num-seqs", "8"]


# ---------------------------------------------------------------- part 15's own server


def test_sweep_of_part15_servers_on_a_tiny_model(tiny, tmp_path, capsys, monkeypatch):
    started_pids = []

    class Recorded(sweep.ServerProcess):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            started_pids.append(self.pid)

    monkeypatch.setattr(sweep, "ServerProcess", Recorded)
    serve = shlex.join([sys.executable, "-m", "part15_full.server", "--model", str(tiny), "--load-format", "dummy",
                        "--device", "cpu", "--dtype", "float32", "--kv-cache-memory-mb", "16"])
    out = tmp_path / "out"
    rc = bench.main(["sweep", "--max-num-seqs", "1,4", "--max-num-batched-tokens", "16,64", "--serve-cmd", serve,
                     "--max-concurrency", "4", "-o", str(out), *client_flags(tiny, prompts=4, output_len=4)])
    printed = capsys.readouterr().out
    assert rc == 0 and len(started_pids) == 4
    for pid in started_pids:  # the server and anything it started: its whole process group
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)
    data = json.loads((out / "sweep.json").read_text())
    assert [p["flags"] for p in data["points"]] == sweep.grid_points(
        [("--max-num-seqs", ["1", "4"]), ("--max-num-batched-tokens", ["16", "64"])])
    for p in data["points"]:
        r = p["result"]
        assert p["meets"] and (r["completed"], r["failed"]) == (4, 0)
        assert r["total_output_tokens"] == 16  # the servers' usage chunks, read from their streams
    fastest = max(data["points"], key=lambda p: p["result"]["request_throughput"])
    assert data["best"] == fastest["flags"]
    assert "best_max_num_seqs:" in printed and (out / "sweep.png").exists()
