"""The model's HF tokenizer and chat template, or none (an ids-only model)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import InvalidRequestError


def message_text(content: Any) -> str:
    """OpenAI message content is a string or a list of parts; only text parts are supported."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
        if kind != "text":
            raise ValueError(f"message content of type {kind!r} is not supported (text only)")
        texts.append(part["text"] if isinstance(part, dict) else part.text)
    return "".join(texts)


# Any of these makes a folder's tokenizer loadable; a folder with none (a config.json for random
# weights, --load-format dummy) gets an ids-only Tokenizer, like vLLM's --skip-tokenizer-init.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
NO_TOKENIZER = "this model has no tokenizer: send prompts as token ids (/v1/completions)"


def has_tokenizer(path: str | Path) -> bool:
    return any((Path(path) / name).exists() for name in TOKENIZER_FILES)


class Tokenizer:
    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer

        # Without one, outputs carry token ids and empty text.
        self.hf = AutoTokenizer.from_pretrained(str(path)) if has_tokenizer(path) else None
        self.vocab_size = len(self.hf) if self.hf is not None else None

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id if self.hf is not None else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.hf is None:
            raise InvalidRequestError(NO_TOKENIZER, "prompt")
        return self.hf(text, add_special_tokens=add_special_tokens).input_ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.hf is None:
            return ""
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True) -> list[int]:
        if self.hf is None:
            raise InvalidRequestError(NO_TOKENIZER, "messages")
        if not self.hf.chat_template:
            raise ValueError("this model has no chat template; use /v1/completions")
        plain = [{"role": m["role"], "content": message_text(m.get("content"))} for m in messages]
        text = self.hf.apply_chat_template(plain, add_generation_prompt=add_generation_prompt,
                                           tokenize=False)
        # The template already wrote BOS and friends: do not add them twice.
        return self.encode(text, add_special_tokens=False)
