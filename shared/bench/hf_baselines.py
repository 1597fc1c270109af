"""The two yardsticks every part is measured against, run on the same weights, device and dtype
as our engine:

- hf-generate        HF `model.generate` in static batches: what you get without an inference
                     engine. A batch runs until its longest request is done.
- hf-generate-batch  transformers' own continuous batching (the engine behind
                     `model.generate_batch`: paged KV cache, requests join and leave every step).

Both are greedy with EOS disabled (`eos_token_id=[]`), the HF spelling of ignore_eos, so each
request yields exactly its output_len tokens, the same tokens our engine must produce."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from .systems import BenchSystem, free_memory
from .workload import BenchRequest

# On CPU, transformers sizes the continuous-batching KV cache from *system RAM* (psutil) and
# its per-step token budget at 8192, which costs seconds of allocation per call and GBs of
# attention masks. We size both from the workload instead (see HFGenerateBatch.prepare).
CPU_MAX_BATCH_TOKENS = 512


def load_hf_model(path: str | Path, device: torch.device, dtype: torch.dtype,
                  attn_implementation: str = "sdpa", load_format: str = "auto") -> Any:
    """load_format "dummy": the config's shapes with random weights, drawn as our engine's
    (uniform in +-1e-3, seeded) but per HF's own parameters, so they are not the same numbers:
    the speed compares, the tokens do not."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if load_format == "dummy":
        from shared.weights import initialize_dummy_weights

        config = AutoConfig.from_pretrained(str(path))
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                     attn_implementation=attn_implementation)
        initialize_dummy_weights(model)
        return model.eval()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype,
                                                 attn_implementation=attn_implementation)
    return model.to(device).eval()


def _greedy_no_eos(model: Any, max_new_tokens: int | None = None) -> Any:
    from transformers import GenerationConfig

    pad = model.config.pad_token_id
    pad = pad if isinstance(pad, int) else 0  # any id will do: padded positions are masked out
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=[],
                            pad_token_id=pad)


class HFGenerate(BenchSystem):
    """Static batching with HF `generate`: requests are cut into batches of `batch_size` in
    arrival order; each batch is left-padded to its longest prompt and decodes until its longest
    output. The extra tokens the shorter requests of a batch generate past their own output_len
    are computed (that waste is exactly what continuous batching removes) but not counted: each
    request keeps only its first output_len tokens, and throughput counts only those."""

    name = "hf-generate"

    def __init__(self, model_path: str | Path, device: torch.device, dtype: torch.dtype,
                 batch_size: int = 8, attn_implementation: str = "sdpa", load_format: str = "auto"):
        super().__init__()
        self.path, self.device, self.dtype = model_path, device, dtype
        self.batch_size, self.attn, self.load_format = batch_size, attn_implementation, load_format
        self.model: Any = None
        self.notes = {"batch_size": batch_size, "attn_implementation": attn_implementation}

    def load(self) -> None:
        self.model = load_hf_model(self.path, self.device, self.dtype, self.attn, self.load_format)

    @torch.inference_mode()
    def _batch(self, requests: list[BenchRequest]) -> list[list[int]]:
        longest = max(r.prompt_len for r in requests)
        config = _greedy_no_eos(self.model, max(r.output_len for r in requests))
        ids = torch.full((len(requests), longest), config.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(requests), longest), dtype=torch.long)
        for i, r in enumerate(requests):  # left padding: every row's last prompt token lines up
            ids[i, longest - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
            mask[i, longest - r.prompt_len:] = 1
        out = self.model.generate(ids.to(self.device), attention_mask=mask.to(self.device),
                                  generation_config=config)
        new = out[:, longest:].tolist()
        return [row[:r.output_len] for row, r in zip(new, requests)]

    def generate(self, requests: list[BenchRequest], progress: bool = False) -> list[list[int]]:
        batches = [requests[i:i + self.batch_size] for i in range(0, len(requests), self.batch_size)]
        outputs: list[list[int]] = []
        for batch in tqdm(batches, desc=self.name, unit="batch", disable=not progress):
            outputs += self._batch(batch)
        return outputs

    def close(self) -> None:
        self.model = None
        free_memory()


class HFGenerateBatch(BenchSystem):
    """transformers' continuous batching. `model.generate_batch(inputs, generation_config)` takes
    one max_new_tokens for all prompts; to give each request its own output_len (as our engine
    and vLLM do) we drive the same machinery the way generate_batch does internally:
    `continuous_batching_context_manager` -> `manager.add_request(ids, max_new_tokens=...)` ->
    `manager.get_result()` until every request is finished.

    The manager (KV cache allocation, CUDA-graph capture on GPU) is built by the untimed warm-up
    and kept on the model (`persistent_manager=True`) for the timed run, as a server would keep
    it. Attention: plain "sdpa"; transformers 5.23 switches to its paged cache by itself and
    warns that the older "paged|sdpa" spelling is deprecated (only "paged|eager" still needs it).
    """

    name = "hf-generate-batch"

    def __init__(self, model_path: str | Path, device: torch.device, dtype: torch.dtype,
                 attn_implementation: str = "sdpa", max_batch_tokens: int | None = None,
                 max_num_seqs: int | None = None, load_format: str = "auto"):
        super().__init__()
        self.path, self.device, self.dtype, self.attn = model_path, device, dtype, attn_implementation
        self.load_format = load_format
        self.max_batch_tokens = max_batch_tokens or (CPU_MAX_BATCH_TOKENS if device.type == "cpu" else None)
        self.max_num_seqs = max_num_seqs
        self.model: Any = None
        self.cb_config: Any = None
        self._session = 0

    def load(self) -> None:
        self.model = load_hf_model(self.path, self.device, self.dtype, self.attn, self.load_format)

    def prepare(self, requests: list[BenchRequest]) -> None:
        from transformers import ContinuousBatchingConfig

        defaults = ContinuousBatchingConfig()
        # Tokens per KV page: `page_size` in recent transformers, `block_size` before (5.17).
        page = getattr(defaults, "page_size", None) or defaults.block_size
        # Room for every request's whole sequence at once: HF never has to evict, like an
        # engine whose KV pool is big enough for the workload.
        blocks = sum(math.ceil((r.prompt_len + r.output_len) / page) for r in requests) + 1
        self.cb_config = ContinuousBatchingConfig(
            num_blocks=blocks, max_batch_tokens=self.max_batch_tokens,
            max_requests_per_batch=self.max_num_seqs or len(requests))
        self.notes = {"attn_implementation": self.attn, "num_blocks": blocks, "page_size": page,
                      "max_batch_tokens": self.max_batch_tokens or "auto",
                      "max_requests_per_batch": self.max_num_seqs or len(requests)}

    # No torch.inference_mode() here: the manager's thread allocates its static tensors under
    # no_grad, and tensors born in inference mode cannot be updated in place outside it
    # ("Inplace update to inference tensor outside InferenceMode is not allowed").
    @torch.no_grad()
    def generate(self, requests: list[BenchRequest], progress: bool = False) -> list[list[int]]:
        self._session += 1
        ids = [f"s{self._session}_{i}" for i in range(len(requests))]
        results: dict[str, Any] = {}
        with self.model.continuous_batching_context_manager(
                generation_config=_greedy_no_eos(self.model), continuous_batching_config=self.cb_config,
                persistent_manager=True, warmup=True, block=True) as manager, \
                tqdm(total=len(requests), desc=self.name, unit="req", disable=not progress) as bar:
            for rid, r in zip(ids, requests):
                manager.add_request(r.prompt_token_ids, request_id=rid, max_new_tokens=r.output_len)
            while len(results) < len(requests):
                out = manager.get_result(timeout=1.0)
                if out is None:
                    if not manager.is_running():
                        fatal = manager.background_thread_status.fatal_error
                        raise RuntimeError(f"transformers' generation thread stopped: {fatal!r}")
                    continue
                if out.is_finished():
                    if out.error is not None:
                        raise RuntimeError(f"request {out.request_id} failed in transformers: {out.error}")
                    results[out.request_id] = out
                    bar.update(1)
        return [list(results[rid].generated_tokens) for rid in ids]

    def close(self) -> None:
        if self.model is not None:
            self.model.destroy_cached_continuous_batching_manager()
        self.model = None
        free_memory()
