"""InputProcessor: a prompt and its sampling parameters in, a validated EngineCoreRequest out.

Everything that can be refused is refused here, before the request reaches any engine: an empty
prompt, token ids outside the vocabulary, a prompt plus max_tokens longer than the context, a
request that could not run even alone in the KV pool, an empty cache_salt. With data parallelism
the API server runs this itself (it knows the model's config and the smallest engine's pool), so a
bad request costs no engine anything and gets its 400 at once. What comes out is plain data (the
token ids, the parameters, the salt): the engine that runs it builds its own Request from it.

Request fields (part 15, request_fields.py): bad words become token sequences here (the tokenizer is
here), `truncate_prompt_tokens` keeps the prompt's last N tokens, and a non-zero `priority` needs
`--scheduling-policy priority` (vLLM refuses it otherwise).

Structured outputs (part 15): the constraint is compiled here once, so a malformed schema, regex or
grammar is refused before it is queued (the backend caches it, so the engine's compile is cheap).

In vLLM: vllm/v1/engine/input_processor.py (InputProcessor, run in the API server process)."""
from __future__ import annotations

import itertools
import time

from shared.config import ModelConfig
from shared.errors import InvalidRequestError
from shared.tokenizer import Tokenizer

from .block_utils import cdiv
from .messages import EngineCoreRequest
from .sampling_params import SamplingParams
from .structured_output.manager import StructuredOutputManager


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, model_config: ModelConfig, max_model_len: int, num_blocks: int,
                 block_size: int, structured: StructuredOutputManager | None = None,
                 structured_outputs_backend: str = "auto", speculative_method: str | None = None,
                 scheduling_policy: str = "fcfs"):
        self.tokenizer, self.model_config, self.max_model_len = tokenizer, model_config, max_model_len
        self.num_blocks, self.block_size = num_blocks, block_size
        eos = model_config.eos_token_ids
        if not eos and tokenizer.eos_token_id is not None:
            eos = (tokenizer.eos_token_id,)
        self.eos_token_ids = tuple(eos)
        self._ids = itertools.count()
        self.structured = structured or StructuredOutputManager(structured_outputs_backend, tokenizer,
                                                                model_config.vocab_size, list(self.eos_token_ids))
        self.speculative_method = speculative_method
        self.scheduling_policy = scheduling_policy

    def process_inputs(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                       cache_salt: str | None = None, kv_transfer_params: dict | None = None,
                       priority: int = 0) -> EngineCoreRequest:
        """Tokenize and validate; the EngineCoreRequest that comes out can run on any engine."""
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if priority != 0 and self.scheduling_policy != "priority":
            raise InvalidRequestError(f"Got priority {priority} but priority scheduling is not enabled "
                                      f"(--scheduling-policy priority)", "priority")
        keep = getattr(params, "truncate_prompt_tokens", None)
        if keep == -1:  # as many as the model's length leaves room for
            keep = max(self.max_model_len - (params.max_tokens or 1), 1)
        if keep is not None and len(ids) > keep:
            ids = ids[-keep:]
            text = self.tokenizer.decode(ids, skip_special_tokens=False) if text is not None else None
        if getattr(params, "bad_words", None) or getattr(params, "allowed_token_ids", None):
            if self.speculative_method:
                name = "bad_words" if params.bad_words else "allowed_token_ids"
                raise InvalidRequestError(f"{name} is not supported with speculative decoding", name)
            params.update_from_tokenizer(self.tokenizer)
        self._validate(ids, params)
        if getattr(params, "prompt_logprobs", None) is not None:  # part 15 (prompt_logprobs.py)
            if self.speculative_method:  # vLLM cannot give them there either
                raise InvalidRequestError("prompt_logprobs is not supported with speculative decoding", "prompt_logprobs")
            if kv_transfer_params:  # the prompt's KV comes from another engine: no logits here
                raise InvalidRequestError("prompt_logprobs cannot be combined with kv_transfer_params",
                                          "prompt_logprobs")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidRequestError("cache_salt must be a non-empty string", "cache_salt")
        if params.stop and not self.tokenizer.available:
            raise InvalidRequestError("stop strings need a tokenizer; this model has none (use stop_token_ids)",
                                      "stop")
        if getattr(params, "structured_outputs", None) is not None:
            if self.speculative_method == "draft_model":
                # The draft model samples its drafts on the device inside the step, so they cannot be
                # cut to the grammar first (the ngram proposer's can).
                raise InvalidRequestError("structured outputs are not supported with --speculative-method "
                                          "draft_model (ngram works)", "structured_outputs")
            self.structured.validate(params)
        usable = self.num_blocks - 1  # all but the null block
        if self.worst_case_blocks(len(ids), params) > usable:
            raise InvalidRequestError(
                f"this request may need {self.worst_case_blocks(len(ids), params)} KV blocks but the pool has "
                f"{usable}; lower max_tokens or n, or raise --kv-cache-memory-mb", "max_tokens")
        return EngineCoreRequest(request_id or str(next(self._ids)), ids, params, time.time(), text, cache_salt,
                                 kv_transfer_params, priority)

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
        params.verify_vocab(vocab)
        wanted = len(ids) + (params.max_tokens or 1)
        if wanted > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {wanted} tokens ({len(ids)} in the prompt, {params.max_tokens or 1} for the "
                f"completion). Please reduce the length of the prompt or max_tokens.", "max_tokens"
                if params.max_tokens and len(ids) < self.max_model_len else "prompt")

    def worst_case_blocks(self, prompt_len: int, params: SamplingParams) -> int:
        """Blocks the request's sequences need to run alone to the end: if that does not fit
        the whole pool, it could be preempted forever, so it is refused at the door."""
        longest = min(self.max_model_len, prompt_len + (params.max_tokens or self.max_model_len))
        return params.n * cdiv(longest, self.block_size)
