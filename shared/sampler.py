"""The sampler: from a batch of logits to one token per row, each row with its own parameters.

Order: logprobs of the raw logits (vLLM's default) -> ban tokens (min_tokens) -> logit_bias -> penalties ->
greedy rows take the argmax -> temperature -> top-k -> top-p -> min-p (HF's warper order; vLLM
V1 applies min-p before top-p, which differs only when both are set) -> sample. Sampling
uses the exponential race (argmax of p / Exp(1) noise), so a row with a seed draws its noise
from its own generator and gets the same tokens whatever else is in the batch. Each of a
request's n samples has its own generator, seeded seed + index as vLLM seeds its n child requests,
so one sample's tokens never depend on when its siblings stop.

`sample()` leaves its results on the device (an engine that overlaps steps reads them later; on a
GPU their copy to the host is already queued, see SampledBatch.copy_to_host_async); calling the
sampler returns them as host lists."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import envs
from .sampling_params import SamplingParams


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of a [rows, vocab] tensor: the same indices (the first of equal maxima; a
    NaN counts as the largest), faster on a CPU. There torch's argmax carries an index beside the
    running maximum, element by element (2.2-2.5 ms for 32 rows of a 49152-token vocabulary on a
    Cascade Lake Xeon), while a plain maximum is vectorized. So: each chunk's maximum, the first
    chunk holding the row's maximum, and the argmax inside that chunk alone: 2.5-3x faster from 8
    rows of 49152 there, 4-6x on a 128256-token vocabulary."""
    rows, vocab = x.shape
    chunk = min(vocab & -vocab, 4096)  # the largest power of two dividing the vocabulary, capped
    if x.device.type != "cpu" or chunk < 128 or vocab == chunk or not rows or not x.is_contiguous() \
            or not envs.VLLM_COURSE_CHUNKED_ARGMAX:  # the off-switch (shared/envs.py)
        return x.argmax(dim=-1)
    blocks = x.view(rows, vocab // chunk, chunk)
    first = blocks.amax(dim=-1).argmax(dim=-1)  # argmax of equal chunk maxima: the first chunk
    return first * chunk + blocks[torch.arange(rows), first].argmax(dim=-1)


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row of the batch."""
    params: SamplingParams
    generator: torch.Generator | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    banned_token_ids: tuple[int, ...] = ()


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float] | None = None  # of each sampled token
    ranks: list[int] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


_TENSORS = ("token_ids", "logprobs", "ranks", "top_ids", "top_logprobs")


@dataclass
class SampledBatch:
    """The sampler's results, still on the device: nothing here has waited for the device."""
    token_ids: torch.Tensor  # [B] long
    logprobs: torch.Tensor | None = None  # [B]: of each sampled token
    ranks: torch.Tensor | None = None  # [B]
    top_ids: torch.Tensor | None = None  # [B, k]
    top_logprobs: torch.Tensor | None = None  # [B, k]
    num_top: list[int] | None = None  # how many of the k each row asked for

    def __post_init__(self) -> None:
        self._host: dict[str, torch.Tensor] | None = None  # copy_to_host_async's pinned copies
        self._ready = None  # ...and the CUDA event that marks them done

    def copy_to_host_async(self) -> SampledBatch:
        """On a GPU, queue the copy to the host now, right behind the kernels that sampled.

        Why: an engine that overlaps steps (part 05 on) launches step N+1 before it reads step N's
        tokens. A plain `.tolist()` at that point is queued on the stream behind step N+1's
        kernels, so it waits for N+1 too, and the GPU then idles while the host processes N: no
        overlap at all (on an H100, parts 05-15 ran 0.7x part 04 on 135M-parameter SmolLM2 before
        this). Copied here, into pinned memory (a copy the GPU does on its own) and marked with an
        event, `to_output` waits for this step alone. One stream keeps it simple: the copy holds
        the next step's kernels back by a few microseconds. A CPU's results are on the host already."""
        if self.token_ids.device.type != "cuda" or self._ready is not None:
            return self
        host = {}
        for name in _TENSORS:
            t = getattr(self, name)
            if t is not None:
                host[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host[name].copy_(t, non_blocking=True)
        self._ready = torch.cuda.Event()
        self._ready.record()
        self._host = host
        return self

    def to_output(self) -> SamplerOutput:
        """The results as host lists (waits for the device: for the copy alone if one was started)."""
        t = {name: getattr(self, name) for name in _TENSORS}
        if self._ready is not None:
            self._ready.synchronize()
            t.update(self._host)
        tokens = t["token_ids"].tolist()
        if t["logprobs"] is None:
            return SamplerOutput(tokens)
        tops = []
        ids = t["top_ids"].tolist() if t["top_ids"] is not None else None
        vals = t["top_logprobs"].tolist() if t["top_logprobs"] is not None else None
        for i, n in enumerate(self.num_top):
            tops.append(list(zip(ids[i][:n], vals[i][:n])) if n else [])
        return SamplerOutput(tokens, t["logprobs"].tolist(), t["ranks"].tolist(), tops)


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def make_generators(seed: int | None, n: int, device: torch.device) -> list[torch.Generator | None]:
    """One generator per sample of a request: sample i is seeded seed + i (vLLM's rule)."""
    return [make_generator(None if seed is None else seed + i, device) for i in range(n)]


def _token_counts(rows: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    counts = torch.zeros(len(rows), vocab + 1, device=device)
    width = max((len(r) for r in rows), default=0)
    if width:
        ids = torch.full((len(rows), width), vocab, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        ids = ids.to(device)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition (prompt and output, HF style), then presence and frequency (output only,
    OpenAI style)."""
    vocab, dev = logits.shape[1], logits.device
    out_counts = _token_counts([r.output_token_ids for r in rows], vocab, dev)
    rep = torch.tensor([r.params.repetition_penalty for r in rows], device=dev)[:, None]
    if (rep != 1.0).any():
        seen = (_token_counts([r.prompt_token_ids for r in rows], vocab, dev) + out_counts) > 0
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
    freq = torch.tensor([r.params.frequency_penalty for r in rows], device=dev)[:, None]
    pres = torch.tensor([r.params.presence_penalty for r in rows], device=dev)[:, None]
    return logits - freq * out_counts - pres * (out_counts > 0).to(logits.dtype)


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """OpenAI's logit_bias: add each row's bias to its named tokens (values in [-100, 100], so
    +-100 all but forces or forbids a token, as OpenAI describes it)."""
    rows_idx, cols, vals = [], [], []
    for i, r in enumerate(rows):
        for tok, bias in (r.params.logit_bias or {}).items():
            rows_idx.append(i)
            cols.append(tok)
            vals.append(bias)
    bias = torch.zeros_like(logits)
    dev = logits.device
    bias[torch.tensor(rows_idx, device=dev), torch.tensor(cols, device=dev)] = torch.tensor(
        vals, dtype=logits.dtype, device=dev)
    return logits + bias


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            min_p: torch.Tensor) -> torch.Tensor:
    """Mask with -inf every token outside a row's top-k, top-p nucleus or min-p floor.
    top_k: [B] long (0 = off), top_p, min_p: [B] float."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    return torch.empty_like(logits).scatter_(1, order, mask_sorted_logits(sorted_logits, top_k, top_p, min_p))


def mask_sorted_logits(sorted_logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       min_p: torch.Tensor) -> torch.Tensor:
    """apply_top_k_top_p_min_p on logits sorted in descending order, each row's first n of its
    vocabulary (n >= every row's top-k: the masks only ever look at a row's best tokens)."""
    width = sorted_logits.shape[1]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, width)).clamp(max=width)
    pos = torch.arange(width, device=sorted_logits.device)[None, :]
    drop = pos >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep a token while the mass *before* it is below top_p: the first token always stays.
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    drop |= probs < min_p[:, None] * probs[:, :1]
    return sorted_logits.masked_fill(drop, float("-inf"))


class Sampler:
    """The pipeline in reusable steps: `process_logits` (bans, logit_bias, penalties: what greedy
    decoding sees), `probs` (temperature and the masks: the distribution sampling draws from) and
    `exponential_noise` (the race's Exp(1) draws, seeded rows from their own generator).
    Speculative decoding's rejection sampler calls the same steps, so the p it verifies drafts
    against is exactly the p plain sampling would draw from."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        return self.sample(logits, rows).to_output()

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampledBatch:
        logits = logits.float()
        want_logprobs = [r.params.logprobs for r in rows]
        raw_logprobs = logits.log_softmax(dim=-1) if any(n is not None for n in want_logprobs) else None

        logits = self.process_logits(logits, rows)
        tokens = argmax_rows(logits)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            tokens[sampled] = self._sample(logits[sampled], [rows[i] for i in sampled])
        if raw_logprobs is None:
            return SampledBatch(tokens).copy_to_host_async()
        return self._gather_logprobs(raw_logprobs, tokens, want_logprobs).copy_to_host_async()

    @staticmethod
    def process_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """float32, then banned tokens (min_tokens) -> logit_bias -> penalties: what every row
        sees, greedy or not (greedy rows take the argmax of this). May return `logits` itself
        when no row changes anything: callers must not write into the result."""
        logits = logits.float()
        if any(r.banned_token_ids for r in rows):
            logits = logits.clone()
            for i, r in enumerate(rows):
                if r.banned_token_ids:
                    logits[i, list(r.banned_token_ids)] = float("-inf")
        if any(r.params.logit_bias for r in rows):
            logits = apply_logit_bias(logits, rows)
        if any(r.params.has_penalties for r in rows):
            logits = apply_penalties(logits, rows)
        return logits

    @staticmethod
    def probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Processed logits of non-greedy rows -> temperature -> top-k / top-p / min-p -> softmax:
        the distribution each row samples from (temperature 0 would divide by zero: greedy rows
        take the argmax of `process_logits` instead)."""
        dev = logits.device
        temp = torch.tensor([r.params.temperature for r in rows], device=dev)[:, None]
        logits = logits / temp
        if any(r.params.top_k or r.params.top_p < 1.0 or r.params.min_p > 0.0 for r in rows):
            logits = apply_top_k_top_p_min_p(
                logits,
                torch.tensor([r.params.top_k for r in rows], device=dev, dtype=torch.long),
                torch.tensor([r.params.top_p for r in rows], device=dev),
                torch.tensor([r.params.min_p for r in rows], device=dev))
        return logits.softmax(dim=-1)

    @staticmethod
    def exponential_noise(like: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """Exp(1) noise shaped like `like`, one row per generator: the unseeded rows in one draw
        from the global RNG, then each seeded row from its own generator, so a seeded row's noise
        is the same whatever else is in the batch."""
        noise = torch.empty_like(like)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), like.shape[1], device=like.device).exponential_()
        for i, g in enumerate(generators):
            if g is not None:
                noise[i].exponential_(generator=g)
        return noise

    @staticmethod
    def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        probs = Sampler.probs(logits, rows)
        # The exponential race: argmax p_i / E_i with E_i ~ Exp(1) is token i with probability p_i.
        noise = Sampler.exponential_noise(probs, [r.generator for r in rows])
        return argmax_rows(probs / noise)

    @staticmethod
    def _gather_logprobs(raw: torch.Tensor, tokens: torch.Tensor, want: list[int | None]) -> SampledBatch:
        chosen = raw.gather(1, tokens[:, None])[:, 0]
        ranks = (raw > chosen[:, None]).sum(dim=-1) + 1
        k = max(n or 0 for n in want)
        top_vals, top_ids = raw.topk(k, dim=-1) if k else (None, None)
        return SampledBatch(tokens, chosen, ranks, top_ids, top_vals, [n or 0 for n in want])
