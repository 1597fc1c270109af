"""The API server's own flags (the engine's are EngineConfig's): who may call it, from which web
origins, how requests are named, how it stops, and how chat output is parsed (tool calls, reasoning).

    --api-key KEY [KEY ...]          (or $VLLM_API_KEY) every /v1 route needs `Authorization: Bearer KEY`
    --allowed-origins '["https://app.example"]'   CORS, with --allowed-methods, --allowed-headers
                                     (JSON lists, default ["*"]) and --allow-credentials
    --enable-request-id-headers      every response carries X-Request-Id
    --shutdown-timeout 30            on SIGTERM, let requests in flight finish for up to 30 s
    --enable-auto-tool-choice --tool-call-parser hermes|llama3_json   tool_choice "auto" (serving_chat.py)
(--reasoning-parser is the engine's: EngineConfig, as in vLLM, since a grammar waits for the reasoning)

In vLLM: vllm/entrypoints/common/cli_args.py (FrontendArgs: api_key, allowed_origins,
allowed_methods, allowed_headers, allow_credentials, enable_request_id_headers, enable_auto_tool_choice,
tool_call_parser; reasoning_parser is an EngineArgs field there) and
vllm/engine/arg_utils.py (EngineArgs.shutdown_timeout); $VLLM_API_KEY in vllm/envs.py."""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field


def _json_list(value: str) -> list[str]:
    """vLLM's CORS flags take JSON lists: '["GET", "POST"]'."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not a JSON list: {value!r} ({e})") from None
    if not isinstance(parsed, list) or not all(isinstance(x, str) for x in parsed):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {value!r}")
    return parsed


@dataclass
class FrontendArgs:
    api_key: list[str] | None = None
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    enable_request_id_headers: bool = False
    # vLLM's default is 0: abort what is running at once. A drain only pays where the orchestrator
    # waits for it (Kubernetes: terminationGracePeriodSeconds > the timeout), so it is asked for.
    shutdown_timeout: float = 0.0
    # Tool calling (serving_chat.py)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    @property
    def api_keys(self) -> list[str]:
        """The keys in force: the flag's, else $VLLM_API_KEY's (the flag wins, as in vLLM)."""
        return [k for k in (self.api_key or [os.environ.get("VLLM_API_KEY")]) if k]

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--api-key", nargs="+", default=None, help="every /v1 route needs `Authorization: "
                       "Bearer <one of these>` (default: $VLLM_API_KEY; unset: no key)")
        for name in ("origins", "methods", "headers"):
            p.add_argument(f"--allowed-{name}", type=_json_list, default=["*"],
                           help=f"CORS: allowed {name}, a JSON list (default: [\"*\"])")
        p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies, "
                       "Authorization) in cross-origin requests")
        p.add_argument("--enable-request-id-headers", action="store_true", help="answer every request with an "
                       "X-Request-Id header: the client's own, else the id the server gave the request")
        p.add_argument("--shutdown-timeout", type=float, default=0.0, help="on SIGTERM or Ctrl-C: refuse new "
                       "requests (503) and let those in flight finish for up to this many seconds, then abort "
                       "what is left (default 0: abort at once)")
        from .tool_parsers import ToolParserManager

        p.add_argument("--enable-auto-tool-choice", action="store_true", help="allow tool_choice \"auto\" (the "
                       "default when a request has tools): the model may call tools, found by --tool-call-parser")
        p.add_argument("--tool-call-parser", choices=sorted(ToolParserManager.tool_parsers), default=None,
                       help="how the model writes tool calls (needed by --enable-auto-tool-choice)")

    @staticmethod
    def check_cli_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
        if args.enable_auto_tool_choice and not args.tool_call_parser:
            p.error("--enable-auto-tool-choice needs --tool-call-parser")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> FrontendArgs:
        return cls(args.api_key, args.allowed_origins, args.allowed_methods, args.allowed_headers,
                   args.allow_credentials, args.enable_request_id_headers, args.shutdown_timeout,
                   args.enable_auto_tool_choice, args.tool_call_parser)
