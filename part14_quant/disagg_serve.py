"""One prefill server, one decode server and the proxy in front of them, on this host (1P1D).

    python -m part13_disagg.disagg_serve --port 8000 [--num-threads 1] [-- more server flags]

The OpenAI API is the proxy's, on --port; the prefill and decode servers listen on the next two
ports (or --prefill-port and --decode-port) and talk KV over NixlConnector side channels. /health
answers 200 once all three are up. SIGTERM or Ctrl-C ends all three (and the servers end with this
process even if it is killed); a server that exits on its own ends the other two, with exit code 1,
rather than leaving a proxy that answers 503 forever.

In vLLM: examples/online_serving/disaggregated_serving/ and the nixl integration test's run script
(tests/v1/kv_connector/nixl_integration/run_accuracy_test.sh) start the same three processes."""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading

from .proxy import build_app

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: the kernel sends it SIGTERM when this launcher dies, even by SIGKILL."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start_server(port: int, role: str, kv_port: int, extra: list[str]) -> subprocess.Popen:
    config = {"kv_connector": "NixlConnector", "kv_role": role, "kv_port": kv_port}
    cmd = [sys.executable, "-m", f"{__package__}.server", "--port", str(port), "--kv-transfer-config",
           json.dumps(config), *extra]
    return subprocess.Popen(cmd, preexec_fn=_die_with_parent)


def watch(servers: dict[str, subprocess.Popen], stopping: threading.Event, failed: threading.Event) -> None:
    """Ends this launcher (SIGTERM to itself, so uvicorn shuts down cleanly) when a server exits first;
    a non-zero code (a crash, a port in use) makes the launcher's own exit code 1."""
    def wait(role: str, server: subprocess.Popen) -> None:
        code = server.wait()
        if not stopping.is_set():
            print(f"disagg_serve: the {role} server exited with code {code}; stopping", file=sys.stderr, flush=True)
            if code != 0:
                failed.set()
            os.kill(os.getpid(), signal.SIGTERM)

    for role, server in servers.items():
        threading.Thread(target=wait, args=(role, server), daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--num-threads", type=int, default=None, help="CPU threads of each server")
    p.add_argument("--prefill-port", type=int, default=None, help="default: --port + 1")
    p.add_argument("--decode-port", type=int, default=None, help="default: --port + 2")
    p.add_argument("--kv-port", type=int, default=14579, help="the prefill server's side channel "
                   "(the decode server's is the next one)")
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.num_threads:
        extra = ["--num-threads", str(args.num_threads), *extra]
    prefill_port = args.prefill_port or args.port + 1
    decode_port = args.decode_port or args.port + 2
    servers = [start_server(prefill_port, "kv_producer", args.kv_port, extra),
               start_server(decode_port, "kv_consumer", args.kv_port + 1, extra)]
    stopping, failed = threading.Event(), threading.Event()

    def stop(*_) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        watch(dict(zip(("prefill", "decode"), servers)), stopping, failed)
        import uvicorn

        app = build_app([f"http://127.0.0.1:{prefill_port}"], [f"http://127.0.0.1:{decode_port}"])
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    except KeyboardInterrupt:
        pass
    finally:
        stopping.set()
        for s in servers:
            if s.poll() is None:
                s.terminate()
        for s in servers:
            try:
                s.wait(timeout=15)
            except subprocess.TimeoutExpired:
                s.kill()
                s.wait()
    if failed.is_set():
        sys.exit(1)


if __name__ == "__main__":
    main()
