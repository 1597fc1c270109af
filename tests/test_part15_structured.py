"""Part 15: structured outputs (response_format / structured_outputs) end to end.

Oracles: every JSON output parses and validates against its schema (the `jsonschema` package),
regex outputs `re.fullmatch` their pattern; a choice constraint's greedy output equals HF's
greedy decoding restricted, token by token, to the tokens a brute-force string test allows; the
same constrained requests give the same tokens with async scheduling, with speculative decoding
(drafts cut to the grammar), with the course's own FSM backend and across tensor-parallel ranks."""
from __future__ import annotations

import json
import os
import re
import shutil

import jsonschema
import pytest
import torch

from conftest import build_app, build_llm, running_server, save_tiny
from part15_full import SamplingParams, StructuredOutputsParams as SO
from shared.errors import InvalidRequestError

PART = "part15_full"

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                 "minItems": 1, "maxItems": 3}},
     "required": ["colors"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}, "capital": {"type": "boolean"},
                                      "rank": {"enum": [1, 2, 3]}},
     "required": ["city", "capital"], "additionalProperties": False},
]
REGEXES = [r"\d{3}-\d{4}", r"[A-Z][a-z]{2,8}", r"(cat|dog|bird)s?", r"20\d\d-(0[1-9]|1[0-2])-[0-2]\d"]


@pytest.fixture(scope="module")
def llm(llm_for):
    return llm_for(PART)


def chat(llm, text: str) -> str:
    return llm.tokenizer.hf.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                add_generation_prompt=True)


def run(llm, prompts, constraints, **kw):
    params = [SamplingParams(**{"temperature": 0, "max_tokens": 120, **kw}, structured_outputs=c) for c in constraints]
    return llm.generate(prompts, params)


def test_json_outputs_validate_against_their_schemas(llm):
    prompts = [chat(llm, q) for q in ("Describe a person as JSON.", "Which colors do you like? Answer in JSON.",
                                      "Tell me about Paris in JSON.")]
    greedy = run(llm, prompts, [SO(json=s) for s in SCHEMAS])
    sampled = run(llm, prompts, [SO(json=s) for s in SCHEMAS], temperature=1.0, seed=7, n=2)
    for schema, out, more in zip(SCHEMAS, greedy, sampled):
        for c in [*out.outputs, *more.outputs]:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), schema)


def test_json_object_and_regex_and_choice(llm):
    prompts = [chat(llm, "Any JSON object, please.")] + [chat(llm, f"Give me a {w}.") for w in
                                                         ("phone number", "name", "pet", "date")]
    outs = run(llm, prompts, [SO(json_object=True)] + [SO(regex=r) for r in REGEXES], temperature=0.8, seed=3)
    assert isinstance(json.loads(outs[0].outputs[0].text), dict)
    for pattern, out in zip(REGEXES, outs[1:]):
        assert re.fullmatch(pattern, out.outputs[0].text), (pattern, out.outputs[0].text)
        assert out.outputs[0].finish_reason == "stop"
    choices = ["Paris", "London", "Berlin", "Madrid"]
    out = run(llm, [chat(llm, "What is the capital of Germany?")], [SO(choice=choices)], temperature=1.0, n=4, seed=1)
    assert all(c.text in choices for c in out[0].outputs)


def test_seeded_runs_repeat(llm):
    prompt, c = [chat(llm, "Describe a person as JSON.")], [SO(json=SCHEMAS[0])]
    a = run(llm, prompt, c, temperature=1.0, seed=11, n=3)[0]
    b = run(llm, prompt, c, temperature=1.0, seed=11, n=3)[0]
    assert [x.token_ids for x in a.outputs] == [x.token_ids for x in b.outputs]


def test_choice_greedy_equals_hf_restricted_by_brute_force(llm, hf_model, hf_tokenizer):
    """The oracle never uses a grammar: at each step it allows exactly the tokens whose text keeps
    the output a prefix of some choice (EOS once it equals one), and takes HF's best of those."""
    choices = ["Paris", "Lyon", "Marseille", "Toulouse", "Nice"]
    prompt = chat(llm, "Name the capital of France.")
    ids = llm.tokenizer.encode(prompt)
    pieces = [hf_tokenizer.decode([t]) for t in range(len(hf_tokenizer))]
    eos = hf_tokenizer.eos_token_id
    expected, text = [], ""
    for _ in range(12):
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids + expected])).logits[0, -1]
        allowed = [t for t, p in enumerate(pieces) if p and any(c.startswith(text + p) for c in choices)]
        if text in choices:
            allowed.append(eos)
        best = max(allowed, key=lambda t: logits[t].item())
        expected.append(best)
        if best == eos:
            break
        text += pieces[best]
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=12, structured_outputs=SO(choice=choices)))[0]
    assert out.outputs[0].token_ids == expected
    assert out.outputs[0].text in choices


@pytest.fixture(scope="module")
def spec_llm():
    llm = build_llm(PART, speculative_method="ngram", num_speculative_tokens=3, prompt_lookup_min=2,
                    prompt_lookup_max=4)
    yield llm
    llm.shutdown()


def test_speculative_decoding_and_async_scheduling_keep_the_constrained_tokens(llm, spec_llm):
    """The default engine fills the bitmask while the forward runs (async scheduling: the model on
    another thread); with ngram drafts the engine keeps one step in flight and fills it before,
    with k + 1 rows per sequence. Greedy tokens must agree, and drafts must have been verified."""
    record = '{"name": "Ann Lee", "age": 31}'
    prompts = [chat(llm, f"Copy this record exactly: {record} {record}"), chat(llm, "Give me a date: 2024-05-17.")]
    constraints = [SO(json=SCHEMAS[0]), SO(regex=REGEXES[3])]
    base = run(llm, prompts, constraints)
    stats = spec_llm.engine.spec_decoding_stats
    before = stats.num_accepted_tokens
    spec = run(spec_llm, prompts, constraints)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in base]
    assert stats.num_accepted_tokens > before  # the drafts were used, not all cut away
    jsonschema.validate(json.loads(spec[0].outputs[0].text), SCHEMAS[0])


def test_course_backend_agrees_with_xgrammar(llm):
    course = build_llm(PART, structured_outputs_backend="course", kv_cache_memory_mb=32)
    try:
        prompts = [chat(llm, f"Give me a {w}.") for w in ("phone number", "pet", "date")]
        constraints = [SO(regex=REGEXES[0]), SO(regex=REGEXES[2]), SO(choice=["yes", "no", "maybe"])]
        ours, theirs = run(course, prompts, constraints), run(llm, prompts, constraints)
        assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]
        with pytest.raises(InvalidRequestError, match="regex and choice"):
            run(course, prompts[:1], [SO(json=SCHEMAS[0])])
    finally:
        course.shutdown()


@pytest.mark.parametrize("bad", [dict(json="{not json"), dict(regex="(unclosed"), dict(choice=[]),
                                 dict(json={"type": "object", "properties": {"a": {"type": "no-such-type"}}}),
                                 dict(grammar="root ::= missing_rule")])
def test_bad_constraints_are_refused_before_queueing(llm, bad):
    with pytest.raises(InvalidRequestError):
        run(llm, ["hi"], [SO(**bad)])
    assert not llm.engine.has_unfinished_requests()


def test_refusals_of_combinations(llm):
    with pytest.raises(InvalidRequestError, match="exactly one"):
        SO(regex="a", choice=["a"])
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=SO(regex="a+"))


def test_a_grammar_that_cannot_finish_ends_with_length(llm):
    out = run(llm, ["Say a"], [SO(regex="a{40}")], max_tokens=5)[0].outputs[0]
    assert out.finish_reason == "length"
    assert re.fullmatch("a+", out.text) and len(out.text) < 40


def test_server_takes_vllm_and_openai_fields(llm):
    """Through the official openai client: response_format json_schema (chat, also streamed),
    structured_outputs regex/choice (completions, as extra_body), and a 400 for a bad regex."""
    openai = pytest.importorskip("openai")
    with running_server(build_app(PART, llm, "smol")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x")
        r = client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=100,
            temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS[0]}})
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[0])
        stream = client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "Your favourite colors, in JSON."}], max_tokens=100,
            temperature=0, stream=True,
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMAS[1]}})
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        jsonschema.validate(json.loads(text), SCHEMAS[1])
        r = client.completions.create(model="smol", prompt="My phone number is", max_tokens=12, temperature=0,
                                      extra_body={"structured_outputs": {"regex": REGEXES[0]}})
        assert re.fullmatch(REGEXES[0], r.choices[0].text)
        r = client.completions.create(model="smol", prompt="The best pet is a", max_tokens=5, n=3, temperature=1,
                                      extra_body={"structured_outputs": {"choice": ["cat", "dog"]}})
        assert {c.text for c in r.choices} <= {"cat", "dog"}
        for body in ({"structured_outputs": {"regex": "(x"}}, {"structured_outputs": {"regexp": "x"}},
                     {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}}):
            with pytest.raises(openai.BadRequestError):
                client.completions.create(model="smol", prompt="x", max_tokens=3, extra_body=body)
    assert not llm.engine.has_unfinished_requests()


def test_tensor_parallel_ranks_get_the_bitmask(tmp_path):
    """With worker processes the bitmask travels with the step (filled before it is sent)."""
    from transformers import LlamaConfig

    from shared.tokenizer import TOKENIZER_FILES
    from shared.weights import embedded_model_path

    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=2,
                      tie_word_embeddings=False)
    path = save_tiny(tmp_path / "tiny", cfg, seed=5, scale=0.3)
    for name in os.listdir(embedded_model_path()):
        if name in TOKENIZER_FILES or name.startswith(("special_tokens", "chat_template")):
            shutil.copy(embedded_model_path() / name, path / name)
    constraints = [SO(choice=["red", "green", "blue"]), SO(regex=REGEXES[0])]  # bounded: must end
    outs = {}
    for tp in (1, 2):
        llm = build_llm(PART, model=str(path), kv_cache_memory_mb=8, tensor_parallel_size=tp)
        try:
            result = run(llm, ["colors:", "phone:"], constraints, max_tokens=40)
            outs[tp] = [o.outputs[0].token_ids for o in result]
            texts = [o.outputs[0].text for o in result]
        finally:
            llm.shutdown()
    assert outs[1] == outs[2]
    assert texts[0] in ("red", "green", "blue")
    assert re.fullmatch(REGEXES[0], texts[1])
