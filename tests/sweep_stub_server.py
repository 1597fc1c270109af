"""A stand-in for part 15's server in `bench sweep`'s tests: an OpenAI-compatible streaming
completions endpoint whose speed at each grid point is scripted, so which point is best is known
before the sweep runs.

    python tests/sweep_stub_server.py --host H --port P --max-num-seqs S --max-num-batched-tokens T \\
        --plan '{"8,256": [0.05, 0.6], "16,512": "exit", "16,256": "hang"}' --pid-dir DIR

The plan maps "S,T" to [seconds to the first token, seconds between tokens], "exit" (the server
exits with status 1 before it listens, as on an invalid configuration) or "hang" (it never starts
listening); a point not in the plan streams without delay. The server writes its process id to a
file in --pid-dir when it starts, and touches DIR/requests-<pid> when a completion arrives. A flag
it does not know makes argparse exit with status 2, as the real server does."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request  # module level: FastAPI resolves the handler's annotations here
from fastapi.responses import StreamingResponse


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--plan", default="{}")
    p.add_argument("--pid-dir", required=True)
    args = p.parse_args()
    pid_dir = Path(args.pid_dir)
    (pid_dir / str(os.getpid())).write_text(f"{args.max_num_seqs},{args.max_num_batched_tokens}")
    step = json.loads(args.plan).get(f"{args.max_num_seqs},{args.max_num_batched_tokens}", [0.0, 0.0])
    if step == "exit":
        print("error: invalid configuration at this point", file=sys.stderr)
        sys.exit(1)
    if step == "hang":
        while True:
            time.sleep(1)
    first, gap = step
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stub", "object": "model"}]}

    def event(payload) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        (pid_dir / f"requests-{os.getpid()}").touch()
        n, prompt = body["max_tokens"], body["prompt"]

        async def stream():
            await asyncio.sleep(first)
            for i in range(n):
                if i:
                    await asyncio.sleep(gap)
                yield event({"object": "text_completion", "choices": [{"index": 0, "text": f" t{i}",
                                                                        "finish_reason": None}]})
            yield event({"object": "text_completion", "choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
            yield event({"object": "text_completion", "choices": [],
                         "usage": {"prompt_tokens": len(prompt), "completion_tokens": n,
                                   "total_tokens": len(prompt) + n}})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
