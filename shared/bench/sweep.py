"""`bench sweep`: vLLM's auto-tuning as one command. For each point of a grid of server flags
(`--max-num-seqs 8,16,32 --max-num-batched-tokens 256,512,1024` by default; any other flag with
`--grid FLAG=V1,V2`), start a server, run `bench serve` against it with one fixed workload, stop
it; then report the point with the highest request throughput among those that meet the
`--goodput` targets, a table of every point, and a plot.

A point meets the targets when no request failed and at least `--goodput-ratio` of its requests
(default 0.99) met every `--goodput` SLO; with `--goodput e2el:500` alone that is vLLM's
auto_tune criterion, P99 end-to-end latency within 500 ms. Without `--goodput` every point whose
requests all succeed qualifies. The request rate or concurrency is the one given (`--request-rate`,
`--max-concurrency`), the same at every point.

Every server runs in a session of its own and is stopped (SIGTERM to its process group, SIGKILL
after `--server-stop-timeout`) when its point is done, when it does not come up within
`--server-ready-timeout`, and when the sweep is interrupted (Ctrl-C, SIGTERM) or fails. On Linux a
server also dies with the sweep's process, however that ends. A server that refuses its command
line (exit status 2, argparse's) ends the sweep at once: the flag is wrong at every point. One
that exits otherwise before it is ready (an invalid combination at that point, say) is recorded
as a failed point and the sweep goes on.

    python -m part15_full.bench sweep --max-num-seqs 8,16,32,64 --max-num-batched-tokens 256,512,1024 \\
        --serve-cmd "python -m part15_full.server --dtype bfloat16" --dataset random \\
        --random-input-len 512 --random-output-len 128 --num-prompts 200 --request-rate 8 \\
        --goodput ttft:500 tpot:50 -o sweep_results

In vLLM: benchmarks/auto_tune/auto_tune.sh (the search over max_num_seqs x max_num_batched_tokens
under a latency bound) and vllm/benchmarks/sweep/serve.py (`vllm bench sweep serve`: a server per
parameter combination, `--serve-cmd`, `--server-ready-timeout`, `-o/--output-dir`)."""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from .serve import ServeConfig, _run_sync, config_from_args, run_serve_async
from .workload import Workload

DEFAULT_SERVE_CMD = f"{shlex.quote(sys.executable)} -m part15_full.server"
AXES = ("--max-num-seqs", "--max-num-batched-tokens")  # auto_tune's two, given as flags of their own


class SweepError(Exception):
    """The sweep cannot go on (a server refused its command line): say why, stop."""


@dataclass
class SweepPoint:
    flags: dict[str, str]  # the grid's flags at this point, e.g. {"--max-num-seqs": "16"}
    result: dict[str, Any] | None = None  # `bench serve --save-result`'s JSON of the run
    error: str | None = None  # why the point has no result (the server did not come up)
    good_completed: int | None = None  # requests that met every SLO (None: no --goodput)
    meets: bool = False  # no failed request, and enough requests met the SLOs
    server_log: str | None = None

    @property
    def label(self) -> str:
        return " ".join(f"{k} {v}" for k, v in self.flags.items())


@dataclass
class SweepResult:
    axes: list[tuple[str, list[str]]]
    points: list[SweepPoint]
    goodput: dict[str, float] | None
    goodput_ratio: float
    config: dict[str, Any] = field(default_factory=dict)  # the client's settings, the workload's shape

    @property
    def best(self) -> SweepPoint | None:
        ok = [p for p in self.points if p.meets]
        return max(ok, key=lambda p: p.result["request_throughput"]) if ok else None

    def table(self) -> str:
        return format_table(self)

    def to_dict(self) -> dict[str, Any]:
        best = self.best
        return {"axes": [[flag, values] for flag, values in self.axes], "goodput": self.goodput,
                "goodput_ratio": self.goodput_ratio, **self.config,
                "best": best.flags if best else None,
                "points": [{"flags": p.flags, "meets": p.meets, "good_completed": p.good_completed,
                            "error": p.error, "server_log": p.server_log, "result": p.result} for p in self.points]}


# ---------------------------------------------------------------- the grid


def parse_values(flag: str, text: str) -> list[str]:
    """'8,16,32' -> ['8', '16', '32'] for a size flag (positive integers, no repeats)."""
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values:
        raise ValueError(f"{flag} {text!r}: give comma-separated values, e.g. {flag} 8,16")
    bad = [v for v in values if not v.isdigit() or int(v) < 1]
    if bad:
        raise ValueError(f"{flag} {text!r}: {', '.join(bad)} is not a positive integer")
    if len(set(values)) != len(values):
        raise ValueError(f"{flag} {text!r}: a value is repeated")
    return values


def parse_grid_flag(text: str) -> tuple[str, list[str]]:
    """'num-speculative-tokens=2,4' (or '--num-speculative-tokens=2,4') -> the flag and its values.
    For an on/off flag, true/false give --flag / --no-flag."""
    name, sep, values = text.partition("=")
    name = "--" + name.strip().lstrip("-")
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or name == "--" or not items:
        raise ValueError(f"--grid {text!r}: want FLAG=V1,V2,... (e.g. --grid num-speculative-tokens=2,4)")
    if len(set(items)) != len(items):
        raise ValueError(f"--grid {text!r}: a value is repeated")
    return name, items


def grid_axes(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    axes = []
    for flag in AXES:
        text = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if text is not None:
            axes.append((flag, parse_values(flag, text)))
    for text in args.grid or []:
        axes.append(parse_grid_flag(text))
    names = [flag for flag, _ in axes]
    if len(set(names)) != len(names):
        raise ValueError(f"a flag is on two axes of the grid: {', '.join(names)}")
    if not axes:
        raise ValueError("the grid is empty: give --max-num-seqs and/or --max-num-batched-tokens "
                         "(comma-separated values), or --grid FLAG=V1,V2")
    return axes


def grid_points(axes: Sequence[tuple[str, Sequence[str]]]) -> list[dict[str, str]]:
    """Every combination, the first axis slowest."""
    return [dict(zip([f for f, _ in axes], combo)) for combo in itertools.product(*(v for _, v in axes))]


def flag_args(flags: dict[str, str]) -> list[str]:
    out = []
    for flag, value in flags.items():
        if value.lower() in ("true", "false"):
            out.append(flag if value.lower() == "true" else "--no-" + flag.removeprefix("--"))
        else:
            out += [flag, value]
    return out


# ---------------------------------------------------------------- one server at a time


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    """Whether nothing listens there (connections of an earlier server closing do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _die_with_parent() -> None:
    """In the child, before exec: on Linux, SIGTERM when the process that started it goes away."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ServerProcess:
    """A server started in a session (process group) of its own, so that stopping it stops every
    process it started (engine cores, tensor-parallel ranks) too."""

    def __init__(self, cmd: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.cmd, self.log_path = cmd, log_path
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, env=env,
                                     preexec_fn=_die_with_parent if sys.platform == "linux" else None)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, lines: int = 12) -> str:
        self.log.flush()
        text = self.log_path.read_text(errors="replace").strip().splitlines()
        return "\n".join(text[-lines:])

    def wait_ready(self, url: str, timeout_s: float) -> None:
        """Until GET url/v1/models answers 200. Raises SweepError if the server refused its command
        line, RuntimeError if it exited otherwise or did not come up in time."""
        import httpx

        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5, trust_env=False) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    msg = f"the server exited with status {code} before it was ready:\n{self.log_tail()}"
                    if code == 2:  # argparse: a flag the server does not know, or a bad value
                        raise SweepError(f"the server refused its command line ({shlex.join(self.cmd)}):\n"
                                         f"{self.log_tail()}")
                    raise RuntimeError(msg)
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{url}/v1/models").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the server was not ready after {timeout_s:g} s "
                                       f"(--server-ready-timeout):\n{self.log_tail()}")
                time.sleep(0.25)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the server's process group, SIGKILL if it is still there after timeout_s."""
        try:
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait()
            with contextlib.suppress(ProcessLookupError):  # what it started and left behind
                os.killpg(self.proc.pid, signal.SIGKILL)
        finally:
            self.log.close()


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While the sweep runs (in the main thread), SIGTERM unwinds it as Ctrl-C does, so the
    server of the current point is stopped on the way out."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# ---------------------------------------------------------------- the sweep


def run_sweep(axes: list[tuple[str, list[str]]], config: ServeConfig, workload: Workload, tokenizer: Any,
              serve_cmd: Sequence[str], host: str = "127.0.0.1", port: int | None = None,
              ready_timeout_s: float = 600.0, stop_timeout_s: float = 30.0, goodput_ratio: float = 0.99,
              log_dir: str | Path | None = None, progress: bool = False,
              on_point: Callable[[int, SweepPoint], None] | None = None) -> SweepResult:
    """Start a server per grid point (serve_cmd + --host/--port + the point's flags), benchmark it
    with `config` and `workload`, stop it. The servers' logs go to log_dir (a temporary folder when
    None). on_point(i, point) is called as each point finishes."""
    if not 0.0 < goodput_ratio <= 1.0:
        raise ValueError(f"--goodput-ratio {goodput_ratio}: must be in (0, 1]")
    log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="sweep-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    result = SweepResult(axes, [SweepPoint(flags) for flags in grid_points(axes)], config.goodput, goodput_ratio,
                         {"serve_cmd": list(serve_cmd), "request_rate": str(config.request_rate),
                          "max_concurrency": config.max_concurrency, "workload": _shape(workload)})
    with sigterm_as_interrupt():
        for i, point in enumerate(result.points):
            point_port = port or free_port(host)
            if not port_is_free(host, point_port):
                raise SweepError(f"port {point_port} on {host} is taken: another server is listening there")
            cmd = [*serve_cmd, "--host", host, "--port", str(point_port), *flag_args(point.flags)]
            log_path = log_dir / f"server-{i}.log"
            point.server_log = str(log_path)
            server = ServerProcess(cmd, log_path)
            try:
                server.wait_ready(f"http://{host}:{point_port}", ready_timeout_s)
                config.url = f"http://{host}:{point_port}"
                res = _run_sync(run_serve_async(config, workload, tokenizer, progress))
                point.result = res.vllm_result()
                point.good_completed = res.metrics.good_completed
                n = len(res.records)
                good = n if config.goodput is None else (point.good_completed or 0)
                point.meets = res.metrics.failed == 0 and n > 0 and good >= goodput_ratio * n
            except RuntimeError as e:  # the server did not come up, or failed the warm-up request: go on
                point.error = str(e)
            finally:
                server.stop(stop_timeout_s)
            if on_point is not None:
                on_point(i, point)
    return result


def _shape(w: Workload) -> dict[str, Any]:
    d = w.describe()
    return {k: d[k] for k in ("num_requests", "input_len", "output_len", "seed", "prompt_tokens", "output_tokens")
            if k in d} | {k: v for k, v in w.extra.items() if k in ("dataset", "tokenizer")}


# ---------------------------------------------------------------- report


def point_row(p: SweepPoint, goodput: bool) -> dict[str, str]:
    r = p.result
    row = {flag.removeprefix("--").replace("-", "_"): value for flag, value in p.flags.items()}
    if r is None:
        row["status"] = "failed: " + (p.error or "?").splitlines()[0][:70]
        return row
    row.update({"req/s": f"{r['request_throughput']:.2f}", "out tok/s": f"{r['output_throughput']:.1f}"})
    if goodput:
        n = r["completed"] + r["failed"]
        row["good"] = f"{p.good_completed}/{n}"
    for key, name in (("median_ttft_ms", "TTFT p50 ms"), ("p99_ttft_ms", "TTFT p99 ms"),
                      ("median_tpot_ms", "TPOT p50 ms"), ("p99_e2el_ms", "E2EL p99 ms")):
        if key in r:
            row[name] = f"{r[key]:.1f}"
    row["status"] = "meets" if p.meets else ("failed requests" if r["failed"] else "misses the targets")
    return row


def format_table(res: SweepResult) -> str:
    """Every point, one row each, the best marked with *; then auto_tune's closing line."""
    best = res.best
    rows = [point_row(p, res.goodput is not None) for p in res.points]
    cols = list(dict.fromkeys(k for row in rows for k in row if k != "status")) + ["status"]
    widths = {c: max(len(c), *(len(row.get(c, "")) for row in rows)) for c in cols}
    lines = ["  " + "  ".join(c.rjust(widths[c]) if c != "status" else c for c in cols)]
    for p, row in zip(res.points, rows):
        mark = "* " if p is best else "  "
        lines.append(mark + "  ".join(row.get(c, "").rjust(widths[c]) if c != "status" else row.get(c, "")
                                      for c in cols))
    target = ("every request succeeds" if res.goodput is None else
              f"{res.goodput_ratio:.0%} of requests meet " + " ".join(f"{k}:{v:g}" for k, v in res.goodput.items()))
    lines.append(f"targets: {target}")
    if best is None:
        lines.append("no point meets the targets")
    else:
        lines.append(f"best: {best.label} ({best.result['request_throughput']:.2f} req/s, "
                     f"{best.result['output_throughput']:.1f} output tok/s)")
    seqs = best.flags.get("--max-num-seqs", 0) if best else 0
    tokens = best.flags.get("--max-num-batched-tokens", 0) if best else 0
    thr = best.result["request_throughput"] if best else 0
    lines.append(f"best_max_num_seqs: {seqs}, best_num_batched_tokens: {tokens}, best_throughput: {thr:.2f}")
    return "\n".join(lines)


def plot_sweep(res: SweepResult, ax: Any = None) -> Any:
    """Request throughput at every point: a heatmap over two axes (the first down, the second
    across), bars otherwise. Points that miss the targets are hatched, the best is outlined.
    Returns the figure."""
    import matplotlib.pyplot as plt
    import numpy as np

    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 4.2))
    fig = ax.figure
    thr = [p.result["request_throughput"] if p.result else math.nan for p in res.points]
    best = res.best
    if len(res.axes) == 2:
        (f0, v0), (f1, v1) = res.axes
        grid = np.array(thr, dtype=float).reshape(len(v0), len(v1))
        im = ax.imshow(grid, cmap="viridis", aspect="auto")
        fig.colorbar(im, ax=ax, label="request throughput (req/s)")
        ax.set_xticks(range(len(v1)), v1)
        ax.set_yticks(range(len(v0)), v0)
        ax.set_xlabel(f1)
        ax.set_ylabel(f0)
        top = np.nanmax(grid) if np.isfinite(grid).any() else 1.0
        for k, p in enumerate(res.points):
            i, j = divmod(k, len(v1))
            text = "failed" if p.result is None else f"{thr[k]:.2f}" + ("" if p.meets else "\nmisses")
            ax.text(j, i, text, ha="center", va="center", fontsize=9,
                    color="black" if np.isfinite(thr[k]) and thr[k] > 0.6 * top else "white")
            if p is best:
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=3))
    else:
        labels = [p.label.replace("--", "") for p in res.points]
        bars = ax.bar(range(len(thr)), [0 if math.isnan(t) else t for t in thr], color="tab:blue")
        for p, bar in zip(res.points, bars):
            if not p.meets:
                bar.set_hatch("//")
                bar.set_alpha(0.5)
            if p is best:
                bar.set_edgecolor("red")
                bar.set_linewidth(3)
        ax.set_xticks(range(len(thr)), labels, rotation=30, ha="right")
        ax.set_ylabel("request throughput (req/s)")
    ax.set_title("sweep: request throughput per point" + (" (best outlined)" if best else ""))
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- CLI


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The grid, the servers, then every `bench serve` flag (the client's side)."""
    from .serve import add_cli_args as add_serve_args

    g = parser.add_argument_group("the grid (one server per combination)")
    g.add_argument("--max-num-seqs", default=None, metavar="N,N,...", help="values of the server's --max-num-seqs")
    g.add_argument("--max-num-batched-tokens", default=None, metavar="N,N,...",
                   help="values of the server's --max-num-batched-tokens")
    g.add_argument("--grid", action="append", default=None, metavar="FLAG=V1,V2",
                   help="another server flag as an axis (repeatable); true/false for on/off flags")
    s = parser.add_argument_group("the servers")
    s.add_argument("--serve-cmd", default=DEFAULT_SERVE_CMD,
                   help="the server's command line, flags common to every point included; --host, "
                        "--port and the point's flags are appended (default: part 15's server)")
    s.add_argument("--server-ready-timeout", type=float, default=600.0,
                   help="seconds a server may take to answer /v1/models")
    s.add_argument("--server-stop-timeout", type=float, default=30.0,
                   help="seconds after SIGTERM before SIGKILL")
    s.add_argument("-o", "--output-dir", default=None,
                   help="write sweep.json, sweep.png, each point's bench JSON and server log here")
    s.add_argument("--goodput-ratio", type=float, default=0.99,
                   help="share of requests that must meet every --goodput SLO for a point to qualify")
    add_serve_args(parser)
    # Each point's server gets a port of its own (a free one unless --port): never a default that
    # some other server may already hold, which would answer the readiness check instead.
    parser.set_defaults(port=None)


def run_cli(args: argparse.Namespace) -> SweepResult:
    """Run `bench sweep` from parsed flags: print each point as it ends, then the table; with
    --output-dir save the JSON, each point's result and the plot. ValueError or SweepError: a bad
    flag or a server that refuses its command line, before or at the first start."""
    if args.base_url is not None:
        raise ValueError("--base-url: the sweep starts its own servers (give --host/--port to choose where)")
    if args.save_result or args.result_filename or args.result_dir:
        raise ValueError("--save-result/--result-filename/--result-dir: the sweep saves with --output-dir")
    axes = grid_axes(args)
    serve_cmd = shlex.split(args.serve_cmd)
    if not serve_cmd:
        raise ValueError("--serve-cmd is empty")
    config, workload, tokenizer = config_from_args(args)
    out = Path(args.output_dir) if args.output_dir else None
    points = grid_points(axes)
    grid = " x ".join(f"{flag} {','.join(values)}" for flag, values in axes)
    print(f"sweep: {len(points)} points ({grid}), "
          f"{workload.num_requests} requests each at request rate {args.request_rate}, "
          f"max concurrency {args.max_concurrency}")

    def report(i: int, p: SweepPoint) -> None:
        if p.result is None:
            print(f"[{i + 1}/{len(points)}] {p.label}: {p.error}", flush=True)
        else:
            r = p.result
            print(f"[{i + 1}/{len(points)}] {p.label}: {r['request_throughput']:.2f} req/s, "
                  f"{r['output_throughput']:.1f} output tok/s, {r['completed']} completed, {r['failed']} failed"
                  + (f", {p.good_completed} met the SLOs" if p.good_completed is not None else ""), flush=True)
            if out is not None:
                (out / f"bench-{i}.json").write_text(json.dumps(r))

    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    res = run_sweep(axes, config, workload, tokenizer, serve_cmd, args.host, args.port, args.server_ready_timeout,
                    args.server_stop_timeout, args.goodput_ratio, out, not args.no_progress, report)
    print(res.table())
    if out is not None:
        (out / "sweep.json").write_text(json.dumps({"date": datetime.now().strftime("%Y%m%d-%H%M%S"),
                                                    **res.to_dict()}, indent=2))
        import matplotlib

        if "matplotlib.pyplot" not in sys.modules:
            matplotlib.use("Agg")  # no display needed: the figure goes to a file
        import matplotlib.pyplot as plt

        fig = plot_sweep(res)
        fig.savefig(out / "sweep.png", dpi=120)
        plt.close(fig)
        print(f"wrote {out / 'sweep.json'} and {out / 'sweep.png'}")
    return res
