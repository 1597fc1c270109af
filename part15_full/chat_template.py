"""The chat template as part 15 renders it: vLLM's request knobs and `--chat-template`.

shared/tokenizer.py renders the tokenizer's own template with a generation prompt, nothing else. A
chat request in vLLM also says `add_generation_prompt` (default true), `continue_final_message` (the
last message, usually the assistant's, is left open for the model to continue: no end-of-turn
after it, no generation prompt), `chat_template_kwargs` (extra variables the template reads, e.g.
Qwen3's `enable_thinking`), and `documents` (RAG documents, for templates that use them); the
server's `--chat-template` replaces the tokenizer's template. transformers' renderer (its sandbox,
filters and globals) does the rendering, so a template renders as `apply_chat_template` would.

In vLLM: vllm/renderers/chat_utils/chat_template.py and vllm/renderers/hf.py (the template's
loading and rendering) and ChatCompletionRequest.build_chat_params."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from shared.errors import InvalidRequestError
from shared.tokenizer import NO_TOKENIZER, Tokenizer, message_text

# What the template's own arguments are; chat_template_kwargs cannot replace them.
RESERVED = ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template")


def load_chat_template(value: str) -> str:
    """`--chat-template`: a file's text, or the template itself when it is written inline (vLLM
    takes both). Raises ValueError for a path that does not exist."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if any(mark in value for mark in ("{{", "{%")):
        return value
    raise ValueError(f"{value!r} is neither a file nor a Jinja template")


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], template: str | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                tools: list[dict[str, Any]] | None = None, documents: list[dict[str, str]] | None = None,
                **kwargs: Any) -> str:
    """The prompt text: `template` (else the tokenizer's) over the messages, their content as text.
    Other message keys (tool_calls, tool_call_id, name) reach the template as given."""
    if not tokenizer.available:
        raise InvalidRequestError(NO_TOKENIZER, "messages")
    template = template or tokenizer.chat_template
    if not template:
        raise InvalidRequestError("this model has no chat template; use /v1/completions or --chat-template",
                                  "messages")
    reserved = sorted(set(kwargs) & set(RESERVED))
    if reserved:
        raise InvalidRequestError(f"chat_template_kwargs cannot set {', '.join(reserved)}", "chat_template_kwargs")
    plain = [{k: v for k, v in m.items() if v is not None} | {"content": message_text(m.get("content"))}
             for m in messages]
    from transformers.utils.chat_template_utils import render_jinja_template

    special = tokenizer._special if tokenizer._fast is not None else dict(tokenizer.hf.special_tokens_map)
    try:
        (text,), _ = render_jinja_template(conversations=[plain], tools=tools, documents=documents,
                                           chat_template=template, add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message, **{**special, **kwargs})
    except InvalidRequestError:
        raise
    except Exception as e:  # a template's own raise_exception, a bad variable: the request's fault
        raise InvalidRequestError(f"could not apply the chat template: {e}", "messages") from e
    return text


def chat_prompt(tokenizer: Tokenizer, req: Any, template: str | None = None) -> list[int]:
    """A chat request's prompt ids: its messages (with their tool fields), its tools (`tool_dicts`,
    when the request has them), its template knobs (request_fields.py's ChatFields), `template`
    (--chat-template) else the tokenizer's. The template wrote BOS and friends: none are added again."""
    knobs = req.template_kwargs() if hasattr(req, "template_kwargs") else {}
    tools = req.tool_dicts() if hasattr(req, "tool_dicts") else None
    messages = [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m) for m in req.messages]
    text = render_chat(tokenizer, messages, template, tools=tools, **knobs)
    return tokenizer.encode(text, add_special_tokens=False)
