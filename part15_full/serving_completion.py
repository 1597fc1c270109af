"""/v1/completions responses with `echo` and `prompt_logprobs` (protocol_logprobs.py), as vLLM builds them.

With echo, each choice's text is the prompt's text (token-id prompts are decoded) followed by the
completion's; with `logprobs`, the prompt's tokens come first in `tokens`, `token_logprobs` and
`top_logprobs` (the first token has nothing before it: null in both), then the generated ones, and
`text_offset` runs over both. With `max_tokens: 0` the choice holds the prompt alone. Every choice
carries `prompt_logprobs` (null unless asked): per prompt token a dict token id -> {logprob, rank,
decoded_token}, the first null. A stream echoes the prompt in each choice's first chunk.
Logprobs below -9999 (a token the model rules out) are written as -9999, as vLLM does.

In vLLM: vllm/entrypoints/openai/completion/serving.py (request_output_to_completion_response,
completion_stream_generator, _create_completion_logprobs)."""
from __future__ import annotations

import dataclasses

from shared.outputs import CompletionOutput, Logprob
from shared.protocol import CompletionChoice, CompletionLogprobs, CompletionResponse, CompletionStreamResponse
from shared.serving import OpenAIServing

from .outputs import PromptLogprobs, RequestOutput
from .protocol import CompletionRequest

LOGPROB_FLOOR = -9999.0  # JSON has no -inf


class CompletionChoiceWithPrompt(CompletionChoice):
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class CompletionResponseWithPrompt(CompletionResponse):
    choices: list[CompletionChoiceWithPrompt]


def clamp(prompt_logprobs: PromptLogprobs | None) -> PromptLogprobs | None:
    if prompt_logprobs is None:
        return None
    return [None if e is None else {t: dataclasses.replace(lp, logprob=max(lp.logprob, LOGPROB_FLOOR))
                                    for t, lp in e.items()} for e in prompt_logprobs]


def _echoed(serving: OpenAIServing, req: CompletionRequest, out: RequestOutput, c: CompletionOutput,
            with_prompt: bool) -> tuple[str, list[int], list | None]:
    """(text, token ids, logprob entries) of one choice's piece, the prompt first when echoed here."""
    if not (req.echo and with_prompt):
        return c.text, c.token_ids, c.logprobs
    prompt = out.prompt if out.prompt is not None else \
        serving.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
    prompt_lps = getattr(out, "prompt_logprobs", None)
    if req.echo_only:
        return prompt, list(out.prompt_token_ids), prompt_lps
    lps = None if req.logprobs is None else [*(prompt_lps or [None] * len(out.prompt_token_ids)), *(c.logprobs or [])]
    return prompt + c.text, [*out.prompt_token_ids, *c.token_ids], lps


def _logprobs(serving: OpenAIServing, ids: list[int], entries: list, top_n: int, offset: int) -> CompletionLogprobs:
    lp = CompletionLogprobs()
    for tid, entry in zip(ids, entries):
        if entry is None:  # the prompt's first token
            tok = serving.tokenizer.decode([tid], skip_special_tokens=False)
            lp.token_logprobs.append(None)
            lp.top_logprobs.append(None)
        else:
            tok = entry[tid].decoded_token
            lp.token_logprobs.append(max(entry[tid].logprob, LOGPROB_FLOOR))
            lp.top_logprobs.append({e.decoded_token: max(e.logprob, LOGPROB_FLOOR)
                                    for e in serving._top(entry, top_n)})
        lp.tokens.append(tok)
        lp.text_offset.append(offset)
        offset += len(tok)
    return lp


def _choice(serving, req, index: int, out: RequestOutput, c: CompletionOutput, with_prompt: bool,
            offset: int = 0, prompt_logprobs: bool = True) -> CompletionChoiceWithPrompt:
    text, ids, entries = _echoed(serving, req, out, c, with_prompt)
    logprobs = None
    if req.logprobs is not None and entries is not None:
        logprobs = _logprobs(serving, ids, entries, req.logprobs, offset)
    return CompletionChoiceWithPrompt(
        index=index, text=text, logprobs=logprobs, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
        prompt_logprobs=clamp(getattr(out, "prompt_logprobs", None)) if prompt_logprobs else None)


def completion_response(serving: OpenAIServing, req: CompletionRequest,
                        outputs: list[RequestOutput]) -> CompletionResponseWithPrompt:
    choices = [_choice(serving, req, i * req.n + c.index, o, c, True) for i, o in enumerate(outputs) for c in o.outputs]
    return CompletionResponseWithPrompt(model=serving.model_name, choices=choices, usage=serving.usage(outputs))


class CompletionStream:
    """A stream's per-choice state: echoed yet, and the characters sent (the next text_offset)."""

    def __init__(self, serving: OpenAIServing, req: CompletionRequest, request_id: str):
        self.serving, self.req, self.request_id = serving, req, request_id
        self.sent_chars: dict[int, int] = {}

    def chunks(self, prompt_index: int, delta: RequestOutput, whole: RequestOutput) -> list[CompletionStreamResponse]:
        """The chunks of one delta; `whole`: its request's output so far (the prompt's logprobs come with
        its first delta, which a later sample's first chunk may not be)."""
        out = []
        for c in delta.outputs:
            index = prompt_index * self.req.n + c.index
            first = index not in self.sent_chars
            if not (c.text or c.token_ids or c.finish_reason or (first and self.req.echo)):
                continue
            piece = c
            if self.req.echo_only and not first:  # the one generated token is never shown
                piece = dataclasses.replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None)
            choice = _choice(self.serving, self.req, index, whole, piece, first, self.sent_chars.get(index, 0),
                             prompt_logprobs=False)
            self.sent_chars[index] = self.sent_chars.get(index, 0) + len(choice.text)
            out.append(CompletionStreamResponse(id=self.request_id, model=self.serving.model_name,
                                                choices=[CompletionChoice(**choice.model_dump(
                                                    exclude={"prompt_logprobs"}))]))
        return out
