"""The benchmark workload: N requests with random-token prompts and fixed output lengths.

Random tokens rather than real text because a throughput number should depend only on the
shapes (prompt and output lengths), never on what the text happens to say; and token ids rather
than text, so that no tokenizer round trip changes a prompt's length. Every system under test
(our engine, HF `generate`, HF `generate_batch`, a server) gets exactly the same requests: the
workload is a pure function of the tokenizer's vocabulary (of the config's, for a model without a
tokenizer) and the seed, as in `vllm bench`'s random dataset."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int  # generated with ignore_eos, so exactly this many tokens come back
    # The text a dataset of real conversations started from (datasets.py's sharegpt); None for
    # token-born prompts. A server is sent this text as is, never a decode of the ids.
    prompt: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class Workload:
    requests: list[BenchRequest]
    input_len: tuple[int, int]  # inclusive range the prompt lengths were drawn from
    output_len: tuple[int, int]
    seed: int
    vocab_size: int  # size of the pool the prompt tokens were drawn from
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. the tokenizer it was built from

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    def describe(self) -> dict[str, Any]:
        """Everything needed to rebuild the workload, plus its totals (for the JSON report)."""
        return {"num_requests": self.num_requests, "input_len": list(self.input_len),
                "output_len": list(self.output_len), "seed": self.seed,
                "token_pool_size": self.vocab_size, "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens,
                "prompt_lens": [r.prompt_len for r in self.requests],
                "output_lens": [r.output_len for r in self.requests], **self.extra}


def parse_range(text: str | int | Sequence[int]) -> tuple[int, int]:
    """'32:256' -> (32, 256) (inclusive); '128' or 128 -> (128, 128)."""
    if isinstance(text, int):
        lo = hi = text
    elif isinstance(text, str):
        lo_s, _, hi_s = text.partition(":")
        lo, hi = int(lo_s), int(hi_s or lo_s)
    else:
        lo, hi = (int(x) for x in text)
    if not 1 <= lo <= hi:
        raise ValueError(f"bad length range {text!r}: need 1 <= low <= high")
    return lo, hi


def allowed_token_ids(tokenizer: Any) -> list[int]:
    """Every id of the tokenizer except special ones (BOS/EOS/PAD, chat markers): a prompt full
    of EOS or <|im_start|> tokens is not a prompt anyone sends. Ids past len(tokenizer) (padding
    rows some checkpoints add to the embedding) have no token and are left out too."""
    special = set(tokenizer.all_special_ids)
    special |= {i for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items()
                if getattr(tok, "special", False)}
    return [i for i in range(len(tokenizer)) if i not in special]


def load_tokenizer(model: str | Path | None) -> Any:
    """The HF tokenizer of a model (None: the embedded default model)."""
    from transformers import AutoTokenizer

    from shared.weights import resolve_model_path

    return AutoTokenizer.from_pretrained(str(resolve_model_path(None if model is None else str(model))))


def model_token_pool(model: str | Path | None) -> tuple[list[int], Any]:
    """(ids to draw prompts from, the HF tokenizer or None) for a model folder / hub id (None: the
    embedded model). A folder without a tokenizer (random weights: --load-format dummy) gives
    every id of its config's vocabulary."""
    from shared.tokenizer import has_tokenizer
    from shared.weights import load_config, resolve_model_path

    path = resolve_model_path(None if model is None else str(model))
    if not has_tokenizer(path):
        return list(range(load_config(path).vocab_size)), None
    tokenizer = load_tokenizer(path)
    return allowed_token_ids(tokenizer), tokenizer


def make_workload(tokenizer: Any = None, num_requests: int = 32,
                  input_len: str | int | tuple[int, int] = (32, 256),
                  output_len: str | int | tuple[int, int] = (16, 128), seed: int = 0,
                  token_pool: Sequence[int] | None = None) -> Workload:
    """Draw the workload. `tokenizer` is an HF tokenizer, a model folder / hub id, or None for
    the embedded model; alternatively give `token_pool` (the ids to draw from) directly."""
    if token_pool is None:
        if tokenizer is None or isinstance(tokenizer, (str, Path)):
            token_pool, tokenizer = model_token_pool(tokenizer)
        else:
            token_pool = allowed_token_ids(tokenizer)
    pool = np.asarray(token_pool, dtype=np.int64)
    in_range, out_range = parse_range(input_len), parse_range(output_len)
    # One generator, drawn in a fixed order (lengths first, then each prompt), so the same seed
    # always gives the same requests whatever machine or system runs them.
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(in_range[0], in_range[1] + 1, size=num_requests)
    out_lens = rng.integers(out_range[0], out_range[1] + 1, size=num_requests)
    requests = [BenchRequest(pool[rng.integers(0, len(pool), size=int(n))].tolist(), int(m))
                for n, m in zip(in_lens, out_lens)]
    extra = {"tokenizer": getattr(tokenizer, "name_or_path", None)} if tokenizer is not None else {}
    return Workload(requests, in_range, out_range, seed, len(pool), extra)


def workload_to_dict(w: Workload) -> dict[str, Any]:
    """The full workload, prompts included (to replay it elsewhere)."""
    return {**w.describe(), "requests": [asdict(r) for r in w.requests]}
