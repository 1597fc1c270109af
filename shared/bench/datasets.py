"""The datasets of `bench serve`: where the benchmark's prompts and output lengths come from.

- random            random token ids from the tokenizer's vocabulary, lengths as given
                    (workload.make_workload: N or LOW:HIGH, or N with a --random-range-ratio).
- sharegpt          real conversations, in ShareGPT's shape: a JSON list (or JSONL, one per line)
  (sharegpt-jsonl)  of {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}.
                    The first human turn is the prompt; the gpt turn after it says how long the
                    answer should be (its token count is the request's max_tokens). As in vLLM,
                    pairs are dropped when the prompt or the answer is under 4 tokens, the prompt
                    over 1024, or both over 2048; the rest are shuffled (seeded), and repeated at
                    random when fewer than N survive.
- prefix_repetition num_prefixes random prefixes of prefix_len tokens, each followed by
                    N // num_prefixes random suffixes of suffix_len tokens: every prompt but the
                    first of its group finds prefix_len tokens in the prefix cache (part 07).

Every builder returns a workload.Workload, so the throughput harness can run the same requests.
Token-born prompts (random, prefix_repetition) are sent as token ids: no tokenizer round trip
changes their length. ShareGPT prompts keep their text (BenchRequest.prompt) and go as text.

In vLLM: vllm/benchmarks/datasets/datasets.py (v0.33.0: RandomDataset, ShareGPTDataset,
PrefixRepetitionRandomDataset, is_valid_sequence, maybe_oversample_requests, add_dataset_parser,
get_samples)."""
from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .workload import BenchRequest, Workload, make_workload, parse_range

DATASETS = ("random", "sharegpt", "sharegpt-jsonl", "prefix_repetition")
HUMAN_ROLES = ("human", "user")
GPT_ROLES = ("gpt", "assistant", "chatgpt", "bard", "bing")


def range_with_ratio(length: str | int, ratio: float) -> tuple[int, int]:
    """vLLM's --random-range-ratio: a length N becomes [floor(N(1-r)), ceil(N(1+r))]."""
    lo, hi = parse_range(length)
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--random-range-ratio {ratio}: must be in [0, 1)")
    if ratio == 0.0:
        return lo, hi
    if lo != hi:
        raise ValueError("--random-range-ratio needs a fixed length N, not a LOW:HIGH range")
    return max(1, math.floor(lo * (1 - ratio))), math.ceil(lo * (1 + ratio))


def random_dataset(token_pool: Sequence[int], num_prompts: int, input_len: str | int = 1024,
                   output_len: str | int = 128, seed: int = 0, range_ratio: float = 0.0) -> Workload:
    w = make_workload(num_requests=num_prompts, input_len=range_with_ratio(input_len, range_ratio),
                      output_len=range_with_ratio(output_len, range_ratio), seed=seed,
                      token_pool=token_pool)
    w.extra["dataset"] = "random"
    return w


# ---------------------------------------------------------------- ShareGPT


def is_valid_sequence(prompt_len: int, output_len: int, min_len: int = 4, max_prompt_len: int = 1024,
                      max_total_len: int = 2048, skip_min_output_len_check: bool = False) -> bool:
    """vLLM's pruning of real conversations: too-short pairs say nothing about a server, too-long
    ones would not fit a small model's context."""
    if prompt_len < min_len or prompt_len > max_prompt_len:
        return False
    if not skip_min_output_len_check and output_len < min_len:
        return False
    return prompt_len + output_len <= max_total_len


def read_sharegpt(path: str | Path) -> list[dict[str, Any]]:
    """The entries of a ShareGPT file: one JSON list, or JSON Lines (one entry per line)."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = [json.loads(line) for line in text.splitlines() if line.strip()]
    if isinstance(data, dict):  # a JSONL file holding a single entry
        data = [data]
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of conversations")
    return data


def first_exchange(entry: dict[str, Any]) -> tuple[str, str] | None:
    """(first human turn, the gpt turn after it), or None when the entry has no such pair."""
    turns = entry.get("conversations") or []
    for i, turn in enumerate(turns):
        if turn.get("from") in HUMAN_ROLES:
            answer = next((t for t in turns[i + 1:] if t.get("from") in GPT_ROLES), None)
            return None if answer is None else (turn.get("value") or "", answer.get("value") or "")
    return None


def sharegpt_dataset(path: str | Path, tokenizer: Any, num_prompts: int, seed: int = 0,
                     output_len: int | None = None, no_oversample: bool = False,
                     shuffle: bool = True) -> Workload:
    """`tokenizer` needs only encode(text) -> ids (an HF tokenizer does). `output_len` fixes every
    answer's length (vLLM's --sharegpt-output-len) instead of the gpt turn's."""
    pairs = [p for p in map(first_exchange, read_sharegpt(path)) if p is not None]
    rng = random.Random(seed)
    if shuffle:
        rng.shuffle(pairs)
    requests: list[BenchRequest] = []
    for prompt, answer in pairs:
        if len(requests) >= num_prompts:
            break
        ids = list(tokenizer.encode(prompt))
        out_len = len(tokenizer.encode(answer)) if output_len is None else output_len
        if is_valid_sequence(len(ids), out_len, skip_min_output_len_check=output_len is not None):
            requests.append(BenchRequest(ids, out_len, prompt=prompt))
    if not requests:
        raise ValueError(f"{path}: no conversation passed the length filter")
    if not no_oversample:
        requests += [rng.choice(requests) for _ in range(num_prompts - len(requests))]
    in_lens, out_lens = [r.prompt_len for r in requests], [r.output_len for r in requests]
    return Workload(requests, (min(in_lens), max(in_lens)), (min(out_lens), max(out_lens)), seed,
                    vocab_size=len(tokenizer) if hasattr(tokenizer, "__len__") else 0,
                    extra={"dataset": "sharegpt", "dataset_path": str(path),
                           "conversations_usable": len(pairs)})


# ---------------------------------------------------------------- prefix repetition


def prefix_repetition_dataset(token_pool: Sequence[int], num_prompts: int, prefix_len: int = 256,
                              suffix_len: int = 256, num_prefixes: int = 10, output_len: int = 128,
                              seed: int = 0, shuffle: bool = True) -> Workload:
    """num_prefixes * (num_prompts // num_prefixes) requests (a remainder is dropped, as in vLLM),
    shuffled so the groups interleave on arrival."""
    per_prefix = num_prompts // num_prefixes if num_prefixes > 0 else 0
    if per_prefix == 0:
        raise ValueError(f"num_prompts ({num_prompts}) must be >= num_prefixes ({num_prefixes}) >= 1")
    if prefix_len < 0 or suffix_len < 0 or prefix_len + suffix_len < 1 or output_len < 1:
        raise ValueError("need prefix_len, suffix_len >= 0 (not both 0) and output_len >= 1")
    pool = np.asarray(token_pool, dtype=np.int64)
    rng = np.random.default_rng(seed)

    def draw(n: int) -> list[int]:
        return pool[rng.integers(0, len(pool), size=n)].tolist()

    requests = []
    for _ in range(num_prefixes):
        prefix = draw(prefix_len)
        requests += [BenchRequest(prefix + draw(suffix_len), output_len) for _ in range(per_prefix)]
    if shuffle:
        requests = [requests[i] for i in rng.permutation(len(requests))]
    total = prefix_len + suffix_len
    return Workload(requests, (total, total), (output_len, output_len), seed, len(pool),
                    extra={"dataset": "prefix_repetition", "prefix_len": prefix_len,
                           "suffix_len": suffix_len, "num_prefixes": num_prefixes})


# ---------------------------------------------------------------- CLI


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    """The dataset flags, under vLLM's names (plus the course's short aliases)."""
    parser.add_argument("--dataset-name", "--dataset", dest="dataset_name", default="random",
                        choices=DATASETS, help="where prompts come from (default: random)")
    parser.add_argument("--dataset-path", default=None, help="the ShareGPT .json / .jsonl file")
    parser.add_argument("--num-prompts", type=int, default=1000, help="requests to send")
    parser.add_argument("--seed", type=int, default=0, help="of the dataset and the arrival times")
    parser.add_argument("--no-oversample", action="store_true",
                        help="sharegpt: send fewer than --num-prompts rather than repeat some")
    parser.add_argument("--disable-shuffle", action="store_true",
                        help="keep the file's / the groups' order")
    parser.add_argument("--input-len", default=None, help="shorthand for --random-input-len")
    parser.add_argument("--output-len", type=int, default=None,
                        help="fixed output length for every dataset (random, sharegpt, prefix_repetition)")
    g = parser.add_argument_group("random dataset")
    g.add_argument("--random-input-len", default="1024", help="N, or LOW:HIGH (inclusive)")
    g.add_argument("--random-output-len", default="128", help="N, or LOW:HIGH (inclusive)")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="draw lengths from [N(1-r), N(1+r)], r in [0, 1)")
    g = parser.add_argument_group("sharegpt dataset")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="override every answer's length (default: the gpt turn's token count)")
    g = parser.add_argument_group("prefix_repetition dataset")
    g.add_argument("--prefix-repetition-prefix-len", "--prefix-len", dest="prefix_len", type=int,
                   default=256, help="tokens every prompt of a group shares")
    g.add_argument("--prefix-repetition-suffix-len", "--suffix-len", dest="suffix_len", type=int,
                   default=256, help="random tokens after the prefix")
    g.add_argument("--prefix-repetition-num-prefixes", "--num-prefixes", dest="num_prefixes", type=int,
                   default=10, help="groups; each gets num_prompts // num_prefixes prompts")
    g.add_argument("--prefix-repetition-output-len", dest="prefix_output_len", type=int, default=128)


def get_samples(args: argparse.Namespace, token_pool: Sequence[int] | None, tokenizer: Any) -> Workload:
    """The workload the parsed flags describe (token_pool: ids random prompts are drawn from)."""
    name, path = args.dataset_name, args.dataset_path
    if name in ("random", "prefix_repetition"):
        if path is not None:
            raise ValueError(f"--dataset-name {name} takes no --dataset-path (did you mean sharegpt?)")
        if token_pool is None:
            raise ValueError(f"the {name} dataset needs a tokenizer or a vocabulary to draw ids from")
    if name == "random":
        return random_dataset(token_pool, args.num_prompts, args.input_len or args.random_input_len,
                              args.output_len or args.random_output_len, args.seed, args.random_range_ratio)
    if name == "prefix_repetition":
        return prefix_repetition_dataset(token_pool, args.num_prompts, args.prefix_len, args.suffix_len,
                                         args.num_prefixes, args.output_len or args.prefix_output_len,
                                         args.seed, shuffle=not args.disable_shuffle)
    if path is None:
        raise ValueError(f"--dataset-name {name} needs --dataset-path FILE")
    if tokenizer is None:
        raise ValueError("the sharegpt dataset needs a tokenizer to count tokens")
    return sharegpt_dataset(path, tokenizer, args.num_prompts, args.seed,
                            args.output_len or args.sharegpt_output_len, args.no_oversample,
                            shuffle=not args.disable_shuffle)
