"""The model's HF tokenizer and chat template."""
from __future__ import annotations

from pathlib import Path
from typing import Any


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


class Tokenizer:
    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(path))
        self.vocab_size = len(self.hf)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf(text, add_special_tokens=add_special_tokens).input_ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True) -> list[int]:
        if not self.hf.chat_template:
            raise ValueError("this model has no chat template; use /v1/completions")
        plain = [{"role": m["role"], "content": message_text(m.get("content"))} for m in messages]
        text = self.hf.apply_chat_template(plain, add_generation_prompt=add_generation_prompt,
                                           tokenize=False)
        # The template already wrote BOS and friends: do not add them twice.
        return self.encode(text, add_special_tokens=False)
