"""Incremental detokenization, stop strings and CompletionState's finish rules, with the real
tokenizer of the embedded model (byte-level BPE: one character can span several tokens)."""
from __future__ import annotations

import pytest

from shared.detokenizer import IncrementalDetokenizer, find_stop_string
from shared.output_processor import CompletionState
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer

TEXTS = [
    "héllo 世界 🙂 naïve",
    "日本語のテキストと中文字符",
    "Family: 👨‍👩‍👧‍👦, thumbs 👍🏽, flags 🇫🇷🇯🇵.",
    "Ünïcödé ß Ωμέγα привет مرحبا",
    "def f(x):\n    return x  # ünïcode\n\n\tdone",
    "a , b . c ? don't   spaces  ",
]


@pytest.fixture(scope="module")
def tok(model_path) -> Tokenizer:
    return Tokenizer(model_path)


@pytest.fixture(scope="module")
def eos(tok) -> int:
    assert tok.eos_token_id is not None
    return tok.eos_token_id


def stream(tok: Tokenizer, prompt_ids: list[int], ids: list[int], skip_special_tokens=True) -> list[str]:
    d = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens)
    return [d.step(t) for t in ids]


# --------------------------------------------------------------------------- detokenization

@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    # The test is only meaningful if some character really is split over several tokens.
    if any(ord(c) > 0x7FF for c in text):
        assert any("\ufffd" in tok.decode([i]) for i in ids)
    prompt = tok.encode("Say something:", add_special_tokens=False)
    deltas = stream(tok, prompt, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("text", TEXTS[:4])
def test_incremental_with_every_prompt_split(tok, text):
    """Whatever part of the text is the prompt, the generated deltas are the rest of it."""
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids)
    for k in range(len(ids)):
        head = tok.decode(ids[:k])
        if head.endswith("\ufffd"):
            continue  # a prompt ending inside a character has no clean boundary to continue from
        deltas = stream(tok, ids[:k], ids[k:])
        assert "".join(deltas) == full[len(head):], k
        assert all("\ufffd" not in d for d in deltas)


def test_empty_prompt(tok):
    ids = tok.encode(TEXTS[0], add_special_tokens=False)
    assert "".join(stream(tok, [], ids)) == TEXTS[0]


def test_special_tokens_skipped_or_kept(tok):
    a = tok.encode("Hello there", add_special_tokens=False)
    b = tok.encode(" friend 🙂", add_special_tokens=False)
    special = tok.hf.convert_tokens_to_ids("<|im_end|>")
    ids = a + [special] + b
    assert "".join(stream(tok, [], ids, skip_special_tokens=True)) == tok.decode(ids) \
        == "Hello there friend 🙂"
    kept = "".join(stream(tok, [], ids, skip_special_tokens=False))
    assert kept == tok.decode(ids, skip_special_tokens=False)
    assert "<|im_end|>" in kept


@pytest.fixture(scope="module")
def sp_tok(tmp_path_factory) -> Tokenizer:
    """A Llama-2 / Mistral style tokenizer (SentencePiece layout: '▁' marks a word start and a
    token decoded alone loses its leading space; unknown characters fall back to <0xNN> byte
    tokens), trained here on a tiny corpus and saved like any HF tokenizer."""
    import json

    from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, trainers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    trainer_tok = RawTokenizer(models.BPE(unk_token="<unk>"))
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, hello there",
              "naive cafe resume"] * 50
    trainer_tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    trained = json.loads(trainer_tok.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{i:02X}>": 3 + i for i in range(256)})
    for t in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(t, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    raw = RawTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                           normalizers.Replace(" ", "\u2581")])
    raw.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    raw.add_special_tokens([AddedToken("<unk>"), AddedToken("<s>"), AddedToken("</s>")])
    path = tmp_path_factory.mktemp("sp_tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(path)
    return Tokenizer(path)


@pytest.mark.parametrize("prompt, generated", [
    ("the quick", " brown fox jumps over the lazy dog"),
    ("hello", " world, hello there"),
    ("the", " quick héllo 世界 🙂 naïve"),
    ("", "hello world"),
])
def test_incremental_sentencepiece_style(sp_tok, prompt, generated):
    p = sp_tok.encode(prompt, add_special_tokens=False)
    full = sp_tok.encode(prompt + generated, add_special_tokens=False)
    assert full[: len(p)] == p
    gen = full[len(p):]
    # Precondition that makes the test bite: a word-initial token decoded alone loses its space.
    word_start = [t for t in gen if sp_tok.hf.convert_ids_to_tokens(t).startswith("\u2581")]
    assert word_start and not sp_tok.decode([word_start[-1]]).startswith(" ")
    deltas = stream(sp_tok, p, gen)
    expected = sp_tok.decode(full)[len(sp_tok.decode(p)):]
    assert "".join(deltas) == expected
    assert expected.strip() == generated.strip()
    assert all("\ufffd" not in d for d in deltas)


def test_incremental_sentencepiece_every_split(sp_tok):
    text = "hello world héllo 世界 🙂 the fox"
    ids = sp_tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in sp_tok.decode([i]) for i in ids)  # byte-fallback tokens present
    full = sp_tok.decode(ids)
    for k in range(1, len(ids)):
        head = sp_tok.decode(ids[:k])
        if "\ufffd" in head[-1:]:
            continue
        deltas = stream(sp_tok, ids[:k], ids[k:])
        assert "".join(deltas) == full[len(head):], k
        assert all("\ufffd" not in d for d in deltas)


# ------------------------------------------------------------------------------- stop strings

def test_find_stop_string():
    assert find_stop_string("hello world", 5, ["world"]) == ("world", 6)
    # Spans old and new text: only its last character is new.
    assert find_stop_string("hello world", 1, ["world"]) == ("world", 6)
    # Entirely in older text: it would have been found before, not reported again.
    assert find_stop_string("hello world!!", 2, ["world"]) is None
    assert find_stop_string("hello", 5, ["xyz"]) is None
    # Several candidates: the earliest start wins.
    assert find_stop_string("abc STOP def END", 16, ["END", "STOP"]) == ("STOP", 4)
    # A stop that occurs twice: the first occurrence that ends in the new text.
    assert find_stop_string("ab ab ab", 4, ["ab"]) == ("ab", 3)
    assert find_stop_string("x", 1, ["x"]) == ("x", 0)


# ----------------------------------------------------------------------------- CompletionState

def make_state(tok, eos, prompt="Answer:", max_model_len=10_000, **kwargs) -> CompletionState:
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    return CompletionState(0, SamplingParams(**kwargs), tok, prompt_ids, (eos,), max_model_len)


def feed(state: CompletionState, ids: list[int], deltas: list[str] | None = None) -> int:
    """Append ids until the state finishes; returns how many were appended."""
    for n, t in enumerate(ids, start=1):
        done = state.append(t)
        if deltas is not None:
            deltas.append(state.delta().text)
        if done:
            return n
    return len(ids)


def first_token_completing(tok, ids: list[int], needle: str) -> int:
    """Index of the token after which `needle` first appears in the decoded text."""
    for j in range(len(ids)):
        if needle in tok.decode(ids[: j + 1]):
            return j
    raise AssertionError(f"{needle!r} never appears")


@pytest.mark.parametrize("include", [False, True])
def test_multi_token_stop_string(tok, eos, include):
    text = " The capital of France is Paris, and the capital of Japan is Tokyo."
    stop = "capital of Japan"
    ids = tok.encode(text, add_special_tokens=False)
    # Precondition: no single token holds the whole stop string.
    assert all(stop not in tok.decode([i]) for i in ids)
    state = make_state(tok, eos, stop=[stop], include_stop_str_in_output=include, max_tokens=100)
    n = feed(state, ids)
    j = first_token_completing(tok, ids, stop)
    assert n == j + 1
    out = state.output()
    assert out.finish_reason == "stop" and out.stop_reason == stop
    idx = text.index(stop)
    assert out.text == (text[: idx + len(stop)] if include else text[:idx])
    assert out.token_ids == ids[: j + 1]


@pytest.mark.parametrize("text, stops", [
    (" I like cats and catalogs. Done.", ["catalogs"]),
    (" one two three four five six", ["four f", "x"]),
    (" 世界 🙂 and 🙂🙂 end", ["🙂🙂"]),
    (" aaaa aaab", ["aab", "aaaaa"]),
    (" no stop string appears here at all", ["zzz", "qq"]),
])
@pytest.mark.parametrize("include", [False, True])
def test_streaming_deltas_never_reveal_stop_string(tok, eos, text, stops, include):
    ids = tok.encode(text, add_special_tokens=False)
    state = make_state(tok, eos, stop=stops, include_stop_str_in_output=include, max_tokens=len(ids))
    deltas: list[str] = []
    feed(state, ids, deltas)
    final = state.output().text
    shown = ""
    for d in deltas:
        shown += d
        # Everything shown so far must survive into the final text: nothing of a stop string
        # that is cut later is ever revealed.
        assert final.startswith(shown), (shown, final)
    assert shown == final
    hits = [(text.find(s), s) for s in stops if s in text]
    if hits:
        idx, s = min(hits)
        assert state.finish_reason == "stop" and state.stop_reason == s
        assert final == (text[: idx + len(s)] if include else text[:idx])
    else:
        assert state.finish_reason == "length" and final == text


def test_eos_finishes_with_stop(tok, eos):
    ids = tok.encode(" Paris is nice.", add_special_tokens=False)
    state = make_state(tok, eos, max_tokens=100)
    n = feed(state, ids + [eos] + ids)
    assert n == len(ids) + 1
    assert state.finish_reason == "stop" and state.stop_reason is None
    assert state.output().text == " Paris is nice."
    assert state.output().token_ids == ids + [eos]


def test_ignore_eos(tok, eos):
    ids = tok.encode(" Paris", add_special_tokens=False)
    state = make_state(tok, eos, max_tokens=len(ids) * 2 + 1, ignore_eos=True)
    n = feed(state, ids + [eos] + ids)
    assert n == len(ids) * 2 + 1
    assert state.finish_reason == "length"
    assert state.output().text == " Paris Paris"


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_ids(tok, eos, include):
    ids = tok.encode(" one two three four", add_special_tokens=False)
    stop_id = ids[2]
    state = make_state(tok, eos, stop_token_ids=[stop_id], include_stop_str_in_output=include)
    n = feed(state, ids)
    assert n == 3
    assert state.finish_reason == "stop" and state.stop_reason == stop_id
    assert state.output().text == tok.decode(ids[:3] if include else ids[:2])
    assert state.output().token_ids == ids[:3]


def test_max_tokens_is_length(tok, eos):
    ids = tok.encode(" a b c d e f g h i j", add_special_tokens=False)
    state = make_state(tok, eos, max_tokens=4)
    assert feed(state, ids) == 4
    assert state.finish_reason == "length" and state.stop_reason is None
    assert state.output().token_ids == ids[:4]
    assert state.output().text == tok.decode(ids[:4])


def test_model_length_is_length(tok, eos):
    prompt_ids = tok.encode("Answer:", add_special_tokens=False)
    ids = tok.encode(" a b c d e f g h i j", add_special_tokens=False)
    state = CompletionState(0, SamplingParams(max_tokens=None), tok, prompt_ids, (eos,),
                            max_model_len=len(prompt_ids) + 3)
    assert feed(state, ids) == 3
    assert state.finish_reason == "length"


def test_min_tokens_suppresses_stop(tok, eos):
    stop_id = tok.encode(" and", add_special_tokens=False)
    assert len(stop_id) == 1
    stop_id = stop_id[0]
    # EOS, the stop token and the stop string all arrive within the first min_tokens tokens.
    early = [eos, stop_id] + tok.encode(" stop", add_special_tokens=False)
    state = make_state(tok, eos, stop=["stop"], stop_token_ids=[stop_id], min_tokens=len(early),
                       max_tokens=100)
    assert eos in state.banned_token_ids and stop_id in state.banned_token_ids
    for n, t in enumerate(early, start=1):
        assert not state.append(t), n
    assert state.banned_token_ids == ()  # min_tokens reached: nothing banned any more
    assert state.output().text == " and stop"
    # After min_tokens the next stop condition ends the sequence.
    assert state.append(stop_id)
    assert state.finish_reason == "stop" and state.stop_reason == stop_id
    assert state.output().token_ids == early + [stop_id]


def test_min_tokens_then_stop_string(tok, eos):
    text = " stop here and stop again"
    ids = tok.encode(text, add_special_tokens=False)
    state = make_state(tok, eos, stop=["stop"], min_tokens=2, max_tokens=100)
    feed(state, ids)
    assert state.finish_reason == "stop" and state.stop_reason == "stop"
    # The first "stop" came within min_tokens; the sequence ends at the second one.
    assert state.output().text == text[: text.index("stop", 2)]


def test_delta_hands_out_new_tokens_once(tok, eos):
    ids = tok.encode(" héllo 🙂 world", add_special_tokens=False)
    state = make_state(tok, eos, max_tokens=100)
    got_ids, got_text = [], ""
    for t in ids:
        state.append(t)
        d = state.delta()
        got_ids += d.token_ids
        got_text += d.text
    state.append(eos)
    d = state.delta()
    assert d.finish_reason == "stop"
    got_ids += d.token_ids
    got_text += d.text
    assert got_ids == ids + [eos]
    assert got_text == " héllo 🙂 world" == state.output().text
