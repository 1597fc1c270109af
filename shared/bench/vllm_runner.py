#!/usr/bin/env python3
"""The vLLM side of the peer benchmark: a standalone script (stdlib + vllm only) run by the peer
environment's own python, never imported by the course's code, so vLLM's pinned torch and
transformers never meet ours. `shared/bench/vllm_peer.py` drives it; by hand:

    /path/to/peer-venv/bin/python shared/bench/vllm_runner.py --input ops.jsonl --output out.jsonl

Protocol (vllm-peer/2): JSON lines in, one JSON line out per op, in order.

    {"op": "load", "model": DIR, "dtype": "float32", "threads": 2, "max_model_len": 8192,
     "kv_cache_bytes": 1073741824, "max_num_seqs": null, "max_num_batched_tokens": null,
     "seed": 0, "enforce_eager": true, "load_format": "auto", "llm_kwargs": {}, "env": {}}
        -> {"ok": true, "load_s": ..., "versions": {...}, "settings": {...}}
    {"op": "generate", "requests": [{"prompt_token_ids": [...], "output_len": N}, ...],
     "sampling": {"temperature": 1.0, "top_p": 0.9, ...}}
        -> {"ok": true, "wall_s": ..., "cpu_s": ..., "token_ids": [[...], ...]}
           vllm.SamplingParams(**sampling) for every request (no "sampling": greedy, temperature
           0), with ignore_eos, max_tokens = output_len; wall_s times only
           llm.generate (with building its SamplingParams and reading the ids back, as the
           harness times our engine), never start-up
    {"op": "reset"} -> {"ok": true, "reset": true}   (llm.reset_prefix_cache(), between rounds)
    {"op": "close"} -> {"ok": true}, then exit 0

Every reply carries "protocol" and "op"; a failed op answers {"ok": false, "error": ...,
"traceback": ...} (a failed load then exits 1). Replies go to --output (default: the real
stdout). Everything else anything prints, vLLM's logs and its child processes' included, goes to
stderr: fd 1 is pointed at fd 2 before vLLM is imported, so the reply channel stays clean."""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback

PROTOCOL = "vllm-peer/2"


def _version(dist: str) -> str | None:
    """An installed distribution's version, without importing it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


class Runner:
    def __init__(self) -> None:
        self.llm = None
        self.sampling_params_cls = None

    # ------------------------------------------------------------------ ops

    def load(self, msg: dict) -> dict:
        threads = int(msg.get("threads") or os.cpu_count() or 1)
        # CPU-backend knobs, before vllm is imported (its envs are read lazily, but its worker
        # processes are spawned with this environment). The caller's own settings win.
        env = {
            "VLLM_TARGET_DEVICE": "cpu",
            # Same threading as our engine: `threads` OpenMP/torch threads, not pinned to cores.
            # vLLM's "auto" would reserve a core for its scheduler process, leaving 1 of 2 here.
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": str(threads),
            # The engine core in this process, the model on the uni-process executor, like our
            # engine. vLLM's default puts engine core and worker in two more processes that
            # busy-poll shared memory for each other (vLLM's "auto" binding reserves a core for
            # that), which a 2-core machine cannot spare; it also started ~3x slower here (57 s
            # against 17 s). VLLM_ENABLE_V1_MULTIPROCESSING=1 in the caller's env restores it.
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            **{k: str(v) for k, v in (msg.get("env") or {}).items()},
        }
        for key, value in env.items():
            os.environ.setdefault(key, value)
        # The thread count is the caller's own setting too, given in the message: it wins over an
        # OMP_NUM_THREADS inherited from the shell (or a test worker's), which would size vLLM's
        # OpenMP pool apart from its torch threads.
        os.environ["OMP_NUM_THREADS"] = env["OMP_NUM_THREADS"]

        t0 = time.perf_counter()
        import torch
        import vllm
        from vllm import LLM, SamplingParams

        torch.set_num_threads(threads)
        model = msg["model"]
        # A folder with only config.json (random weights, load_format "dummy") has no tokenizer:
        # the prompts are token ids anyway, and outputs are read as ids, never as text.
        has_tokenizer = msg.get("tokenizer") is not None or any(
            os.path.exists(os.path.join(model, f)) for f in ("tokenizer.json", "tokenizer_config.json",
                                                              "tokenizer.model"))
        load_format = msg.get("load_format")
        kwargs = {
            "model": model,
            "tokenizer": (msg.get("tokenizer") or model) if has_tokenizer else None,
            "skip_tokenizer_init": None if has_tokenizer else True,
            "load_format": load_format if load_format not in (None, "auto") else None,
            "dtype": msg.get("dtype", "float32"),
            "max_model_len": msg.get("max_model_len"),
            "enforce_eager": msg.get("enforce_eager", True),
            "seed": msg.get("seed", 0),
            "kv_cache_memory_bytes": msg.get("kv_cache_bytes"),
            "max_num_seqs": msg.get("max_num_seqs"),
            "max_num_batched_tokens": msg.get("max_num_batched_tokens"),
            "disable_log_stats": True,
            **(msg.get("llm_kwargs") or {}),
        }
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        self.llm = LLM(**kwargs)
        self.sampling_params_cls = SamplingParams
        load_s = time.perf_counter() - t0

        versions = {"vllm": vllm.__version__, "torch": torch.__version__,
                    "transformers": _version("transformers"), "python": platform.python_version()}
        return {"load_s": load_s, "versions": versions, "settings": self._settings(kwargs)}

    def _settings(self, kwargs: dict) -> dict:
        """What vLLM actually chose (its config after platform defaults), for the report."""
        out = {"llm_kwargs": kwargs,
               "env": {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS",
                                                      "VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD",
                                                      "VLLM_ENABLE_V1_MULTIPROCESSING")
                       if os.environ.get(k) is not None}}
        try:
            cfg = self.llm.llm_engine.vllm_config
            out.update(
                dtype=str(cfg.model_config.dtype).removeprefix("torch."),
                max_model_len=cfg.model_config.max_model_len,
                block_size=cfg.cache_config.block_size,
                num_kv_blocks=getattr(cfg.cache_config, "num_gpu_blocks", None),
                max_num_seqs=cfg.scheduler_config.max_num_seqs,
                max_num_batched_tokens=cfg.scheduler_config.max_num_batched_tokens,
                chunked_prefill=getattr(cfg.scheduler_config, "enable_chunked_prefill", None),
                prefix_caching=getattr(cfg.cache_config, "enable_prefix_caching", None),
                enforce_eager=cfg.model_config.enforce_eager,
                compilation_mode=str(getattr(cfg.compilation_config, "mode", None)),
                executor=cfg.parallel_config.distributed_executor_backend)
        except Exception as e:  # noqa: BLE001 - settings are a report, never a failure
            out["settings_error"] = f"{type(e).__name__}: {e}"
        return out

    def generate(self, msg: dict) -> dict:
        if self.llm is None:
            raise RuntimeError("generate before load")
        requests = msg["requests"]
        prompts = [{"prompt_token_ids": list(r["prompt_token_ids"])} for r in requests]
        sp = self.sampling_params_cls
        t0, c0 = time.perf_counter(), time.process_time()
        sampling = msg.get("sampling") or {"temperature": 0.0}
        params = [sp(**sampling, max_tokens=int(r["output_len"]), ignore_eos=True) for r in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=bool(msg.get("progress", False)))
        token_ids = [list(o.outputs[0].token_ids) for o in outputs]
        wall_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
        # cpu_s: CPU time of this process only (all of vLLM's compute when its engine runs
        # in-process; cpu_s / wall_s well under the thread count means the machine was busy).
        return {"wall_s": wall_s, "cpu_s": cpu_s, "token_ids": token_ids}

    def reset(self, msg: dict) -> dict:
        if self.llm is None:
            raise RuntimeError("reset before load")
        return {"reset": bool(self.llm.reset_prefix_cache())}

    def close(self, msg: dict) -> dict:
        self.llm = None
        return {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="vLLM peer runner (" + PROTOCOL + ")")
    ap.add_argument("--input", default="-", help="JSON-lines ops (default: stdin)")
    ap.add_argument("--output", default="-", help="JSON-lines replies (default: stdout)")
    args = ap.parse_args(argv)

    if args.output == "-":
        reply_stream = os.fdopen(os.dup(1), "w", buffering=1)
    else:
        reply_stream = open(args.output, "w", buffering=1)
    sys.stdout.flush()
    os.dup2(2, 1)  # from here on, any print (ours, vLLM's, its children's) lands on stderr
    in_stream = sys.stdin if args.input == "-" else open(args.input)

    def reply(op: str, body: dict) -> None:
        reply_stream.write(json.dumps({"protocol": PROTOCOL, "op": op, **body}) + "\n")
        reply_stream.flush()

    runner = Runner()
    for line in in_stream:
        if not line.strip():
            continue
        op = "?"
        try:
            msg = json.loads(line)
            op = msg.get("op", "?")
            handler = {"load": runner.load, "generate": runner.generate, "reset": runner.reset,
                       "close": runner.close}.get(op)
            if handler is None:
                raise ValueError(f"unknown op {op!r}")
            body = handler(msg)
        except Exception as e:  # noqa: BLE001 - reported to the caller, who decides
            reply(op, {"ok": False, "error": f"{type(e).__name__}: {e}",
                       "traceback": traceback.format_exc(limit=12)})
            if op == "load":
                return 1
            continue
        reply(op, {"ok": True, **body})
        if op == "close":
            break
    reply_stream.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
