"""shared.tokenizer reads tokenizer.json with the `tokenizers` library where transformers would use
it as written (engines then start without importing transformers), else it uses AutoTokenizer.
Either way the ids, texts and chat prompts must be AutoTokenizer's own: the oracle here."""
from __future__ import annotations

import json
import random
import shutil

import pytest

from shared.tokenizer import Tokenizer

TEXTS = ["", "Hello, world!", "  leading and trailing  ", "a , b . c ? don't", "tabs\tand\nnewlines\n\n",
         "héllo 世界 🙂 naïve", "Family: 👨‍👩‍👧‍👦", "<|im_start|>user\nspecial tokens in text<|im_end|>",
         "<|endoftext|>x<|im_end|>", "def f(x):\n    return x ** 2"]
CHATS = [[{"role": "user", "content": "Hi"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
          {"role": "assistant", "content": "4"}, {"role": "user", "content": "Why \"4\"?\n"}],
         [{"role": "user", "content": [{"type": "text", "text": "parts "}, {"type": "text", "text": "joined"}]}]]
# Named special tokens, a filter and a global of transformers' template environment.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}"
            "{% endif %}{{ m.role }}: {{ m.content | tojson }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


def variant(model_path, tmp_path, **config):
    """A copy of the embedded model's tokenizer with tokenizer_config.json fields changed."""
    folder = tmp_path / "tok"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(model_path / name, folder / name)
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return folder


def assert_same_as_transformers(tok: Tokenizer, path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(path))
    assert (tok.vocab_size, tok.eos_token_id) == (len(hf), hf.eos_token_id)
    for text in TEXTS:
        for special in (True, False):
            assert tok.encode(text, add_special_tokens=special) == \
                hf(text, add_special_tokens=special).input_ids, (text, special)
    ids = [i for text in TEXTS for i in hf(text).input_ids]
    rng = random.Random(0)
    for sample in [ids, *(rng.sample(range(len(hf)), 40) for _ in range(5))]:
        for skip in (True, False):
            assert tok.decode(sample, skip_special_tokens=skip) == hf.decode(sample, skip_special_tokens=skip)
        assert tok.convert_ids_to_tokens(sample) == hf.convert_ids_to_tokens(sample)
    for chat in CHATS:
        for prompt in (True, False):
            plain = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
                      "".join(p["text"] for p in m["content"])} for m in chat]
            assert tok.apply_chat_template(chat, add_generation_prompt=prompt) == \
                hf.apply_chat_template(plain, add_generation_prompt=prompt, tokenize=True, return_dict=False)


def test_the_embedded_tokenizer_needs_no_transformers_and_equals_it(model_path):
    tok = Tokenizer(model_path)
    assert tok.backend == "tokenizers"
    assert_same_as_transformers(tok, model_path)


def test_a_pretrained_tokenizer_fast_class_is_plain_too(model_path, tmp_path):
    folder = variant(model_path, tmp_path, tokenizer_class="PreTrainedTokenizerFast")
    tok = Tokenizer(folder)
    assert tok.backend == "tokenizers"
    assert_same_as_transformers(tok, folder)


def test_a_template_with_special_tokens_filters_and_exceptions(model_path, tmp_path):
    folder = variant(model_path, tmp_path, chat_template=TEMPLATE)
    (folder / "chat_template.jinja").unlink()
    tok = Tokenizer(folder)
    assert tok.backend == "tokenizers"
    assert_same_as_transformers(tok, folder)
    with pytest.raises(Exception, match="no tools"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


@pytest.mark.parametrize("config", [{"add_bos_token": True}, {"clean_up_tokenization_spaces": True},
                                    {"tokenizer_class": "GPT2Tokenizer"}, {"tokenizer_class": None}])
def test_what_transformers_would_rewrite_goes_through_transformers(model_path, tmp_path, config):
    """transformers rebuilds the post-processor (add_bos_token), cleans decoded text, or builds a
    class of its own: the plain tokenizer.json would differ, so these load with AutoTokenizer."""
    folder = variant(model_path, tmp_path, **config)
    tok = Tokenizer(folder)
    assert tok.backend == "transformers"
    assert_same_as_transformers(tok, folder)


def test_a_folder_without_tokenizer_files_is_ids_only(tmp_path):
    tok = Tokenizer(tmp_path)
    assert not tok.available and tok.vocab_size is None and tok.decode([1, 2]) == ""
