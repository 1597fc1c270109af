"""The model's HF tokenizer and chat template, or none (an ids-only model)."""
from __future__ import annotations

import json
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


# tokenizer_config.json classes that transformers builds from tokenizer.json as written. Others (a
# LlamaTokenizer, a Qwen2Tokenizer) may rebuild parts of the pipeline, so they load through transformers.
PLAIN_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _plain_tokenizer(path: Path) -> tuple[Any, dict[str, str], str | None] | None:
    """(tokenizers.Tokenizer, named special tokens, chat template) when transformers would encode and
    decode exactly as tokenizer.json says; else None. Loading it takes a tenth of a second, where
    transformers' AutoTokenizer takes seconds in every process that starts an engine."""
    files = path / "tokenizer.json", path / "tokenizer_config.json"
    if not all(f.exists() for f in files):
        return None
    config = json.loads(files[1].read_text())
    # No class named: transformers picks one from the model type (a LlamaTokenizer...), so not plain.
    if config.get("tokenizer_class") not in PLAIN_TOKENIZER_CLASSES \
            or {"add_bos_token", "add_eos_token"} & config.keys() or config.get("clean_up_tokenization_spaces"):
        return None  # transformers rewrites the post-processor, or cleans decoded text
    import tokenizers

    fast = tokenizers.Tokenizer.from_file(str(files[0]))
    special = {name: _token_text(config[name]) for name in NAMED_SPECIAL_TOKENS if config.get(name) is not None}
    marked = {t.content for t in fast.get_added_tokens_decoder().values() if t.special}
    if fast.post_processor is None or not set(special.values()) <= marked:
        return None  # transformers would add a post-processor, or mark more tokens special
    template = config.get("chat_template")
    if template is None and (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    if template is not None and not isinstance(template, str):
        return None  # several named templates
    return fast, special, template


class Tokenizer:
    """Encode, decode and the chat template. From tokenizer.json with the `tokenizers` library where that
    is what transformers would do (tests/test_tokenizer.py checks it against AutoTokenizer), otherwise
    with AutoTokenizer. `hf`, the transformers tokenizer (xgrammar's tables, /tokenize), loads on first use."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        # Without one, outputs carry token ids and empty text.
        self.available = has_tokenizer(path)
        plain = _plain_tokenizer(self.path) if self.available else None
        self._hf: Any = None
        self.backend = "tokenizers" if plain is not None else "transformers"  # which library encodes
        if plain is not None:
            self._fast, special, self._template = plain
            self._special = special
            self.vocab_size: int | None = self._fast.get_vocab_size(with_added_tokens=True)
            eos = special.get("eos_token")
            self.eos_token_id = self._fast.token_to_id(eos) if eos is not None else None
        else:
            self._fast = None
            self.vocab_size = len(self.hf) if self.available else None
            self.eos_token_id = self.hf.eos_token_id if self.available else None

    @property
    def hf(self) -> Any:
        if self._hf is None and self.available:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(str(self.path))
        return self._hf

    @property
    def chat_template(self) -> str | None:
        if self._fast is not None:
            return self._template
        return self.hf.chat_template if self.available else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not self.available:
            raise InvalidRequestError(NO_TOKENIZER, "prompt")
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=add_special_tokens).ids
        return self.hf(text, add_special_tokens=add_special_tokens).input_ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if not self.available:
            return ""
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        if self._fast is not None:
            return [self._fast.id_to_token(i) for i in ids]
        return self.hf.convert_ids_to_tokens(ids)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The chat template's text; transformers' own renderer (its sandbox, filters and globals)."""
        if not self.available:
            raise InvalidRequestError(NO_TOKENIZER, "messages")
        if not self.chat_template:
            raise ValueError("this model has no chat template; use /v1/completions")
        plain = [{"role": m["role"], "content": message_text(m.get("content"))} for m in messages]
        if self._fast is None:
            return self.hf.apply_chat_template(plain, add_generation_prompt=add_generation_prompt, tokenize=False)
        from transformers.utils.chat_template_utils import render_jinja_template

        (text,), _ = render_jinja_template(conversations=[plain], chat_template=self._template,
                                           add_generation_prompt=add_generation_prompt, **self._special)
        return text

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True) -> list[int]:
        text = self.render_chat(messages, add_generation_prompt)
        # The template already wrote BOS and friends: do not add them twice.
        return self.encode(text, add_special_tokens=False)
