"""POST /tokenize and /detokenize: the server's tokenizer, for clients that count or build prompts
in token ids (a context-length check before sending, a prompt cache keyed by ids, a proxy).

    POST /tokenize    {"prompt": "Hello", "add_special_tokens": true}                  completion form
                      {"messages": [...], "add_generation_prompt": true,                chat form: the
                       "add_special_tokens": false}                                     chat template's ids
                      -> {"count": 2, "max_model_len": 8192, "tokens": [19556, 28],
                          "token_strs": ["Hello", ...]}     (token_strs with "return_token_strs": true)
    POST /detokenize  {"tokens": [19556, 28]} -> {"prompt": "Hello"}

The chat form gives exactly the ids /v1/chat/completions would run: the template writes the
special tokens itself, which is why add_special_tokens defaults to false there (true would add a
BOS in front of the template's own). Ids outside the model's vocabulary are refused (400) rather
than decoded to nothing. Both routes live outside /v1, like vLLM's, so an API key does not guard them.

In vLLM: vllm/entrypoints/serve/tokenize/ (protocol.py: TokenizeCompletionRequest,
TokenizeChatRequest, TokenizeResponse, DetokenizeRequest, DetokenizeResponse; serving.py:
OpenAIServingTokenization; api_router.py: the routes)."""
from __future__ import annotations

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from typing import Annotated, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from shared.errors import InvalidRequestError
from shared.protocol import ChatMessage
from shared.tokenizer import NO_TOKENIZER, Tokenizer

router = APIRouter()


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool | None = False


# The form is told by its fields, as vLLM's union of the two: a body with "messages" is the chat form.
TokenizeRequest = Annotated[Union[Annotated[TokenizeCompletionRequest, Tag("completion")],
                                  Annotated[TokenizeChatRequest, Tag("chat")]],
                            Discriminator(lambda body: "chat" if "messages" in (body if isinstance(body, dict)
                                                                                 else vars(body)) else "completion")]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def _tokenizer(raw: HTTPRequest, param: str) -> Tokenizer:
    tokenizer = raw.app.state.engine_client.tokenizer
    if not tokenizer.available:  # a config-only model (--load-format dummy without tokenizer files)
        raise InvalidRequestError(NO_TOKENIZER.split(":")[0], param)
    return tokenizer


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, raw: HTTPRequest) -> TokenizeResponse:
    serving = raw.app.state.serving
    serving.check_model(req.model)
    if isinstance(req, TokenizeChatRequest):
        tokenizer = _tokenizer(raw, "messages")
        if not tokenizer.chat_template:
            raise InvalidRequestError("this model has no chat template; tokenize a prompt instead", "messages")
        try:
            text = tokenizer.render_chat([{"role": m.role, "content": m.content} for m in req.messages],
                                         add_generation_prompt=req.add_generation_prompt)
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidRequestError(f"could not apply the chat template: {e}", "messages") from e
    else:
        tokenizer, text = _tokenizer(raw, "prompt"), req.prompt
    ids = tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
    strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=serving.max_model_len, tokens=ids, token_strs=strs)


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, raw: HTTPRequest) -> DetokenizeResponse:
    raw.app.state.serving.check_model(req.model)
    tokenizer = _tokenizer(raw, "tokens")
    limit = min(raw.app.state.engine_client.processor.model_config.vocab_size, tokenizer.vocab_size)
    bad = [t for t in req.tokens if not 0 <= t < limit]
    if bad:
        raise InvalidRequestError(f"token ids must be in [0, {limit}); got {bad[:5]}", "tokens")
    # Special tokens are kept: /tokenize's ids (a chat template's markers included) come back whole.
    return DetokenizeResponse(prompt=tokenizer.decode(req.tokens, skip_special_tokens=False))
