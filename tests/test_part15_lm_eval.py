"""lm-evaluation-harness against part 15's server, through its request format: a small multiple-choice
task scored as its `local-completions` model scores it, and as its `hf` model scores it on the same
weights (HF transformers, cpu, fp32): the same per-item log-likelihoods (1e-4), greedy flags and accuracy.

The last test runs the harness itself (`lm_eval[api]`, a test dependency): `simple_evaluate` with
its `local-completions` model against the server and its `hf` model on the checkpoint, on a local
task yaml over a jsonl file. The others spell out what it sends and reads, so that a failure names
the step:
- per (context, continuation): the pair encoded as one string, the context's tokens those of the
  context alone, the continuation's the rest (its `_encode_pair`); the request
  {"prompt": [context + continuation ids, ...], "max_tokens": 1, "temperature": 0, "logprobs": 1,
  "echo": true, "seed": 1234}, several pairs batched in one request as a list of token-id prompts;
- from each choice (sorted by index): sum(token_logprobs[ctxlen:-1]) and whether every continuation
  token was the greedy one (its logprob the largest of top_logprobs); the last entry is the generated
  token, which it drops;
- multiple_choice: the item's prediction is the choice with the largest log-likelihood; acc is the
  share of items predicted right.
The `hf` side: the log-softmax of the model's logits over the same ids, read at the continuation."""
from __future__ import annotations

from operator import itemgetter

import httpx
import pytest
import torch

from conftest import running_server
from test_part15_prompt_logprobs import engine_config, hf, checkpoint  # noqa: F401 (fixtures)

# A local task: (context, choices, index of the gold choice), as a task yaml's doc_to_text /
# doc_to_choice / doc_to_target give them. Random weights: the accuracy is what it is, on both sides.
DOCS = [
    ("Question: What colour is the sky on a clear day?\nAnswer:", [" blue", " green", " red"], 0),
    ("Question: How many legs does a spider have?\nAnswer:", [" six", " eight", " ten", " four"], 1),
    ("Question: Which is the largest planet?\nAnswer:", [" Mars", " Venus", " Jupiter"], 2),
    ("Question: What do bees make?\nAnswer:", [" honey", " milk", " silk"], 0),
    ("The capital of France is", [" Paris", " Rome", " Berlin", " Madrid"], 0),
]


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The harness's split: trailing spaces of the context move to the continuation; the whole is
    encoded once, and the context's tokens are those of the context alone."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
    ctx = tok(context, add_special_tokens=False)["input_ids"]
    return ctx, whole[len(ctx):]


def requests(tok) -> list[tuple[int, list[int], int]]:
    """(doc index, context + continuation ids, context length) per choice, in the task's order."""
    out = []
    for d, (context, choices, _) in enumerate(DOCS):
        for choice in choices:
            ctx, cont = encode_pair(tok, context, choice)
            out.append((d, ctx + cont, len(ctx)))
    return out


def parse(response: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    res = []
    for choice, ctxlen in zip(sorted(response["choices"], key=itemgetter("index")), ctxlens):
        lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        res.append((sum(lps), all(lp == max(top.values()) for lp, top in zip(lps, tops))))
    return res


def hf_scores(hf, reqs) -> list[tuple[float, bool]]:
    out = []
    for _, ids, ctxlen in reqs:
        with torch.no_grad():
            logprobs = hf[0](torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)
        rows, cont = logprobs[ctxlen - 1:len(ids) - 1], torch.tensor(ids[ctxlen:])
        out.append((rows.gather(1, cont[:, None]).sum().item(), bool((rows.argmax(dim=-1) == cont).all())))
    return out


def accuracy(scores: list[tuple[float, bool]], reqs) -> float:
    right = 0
    for d, (_, _, gold) in enumerate(DOCS):
        lls = [s[0] for s, r in zip(scores, reqs) if r[0] == d]
        right += max(range(len(lls)), key=lls.__getitem__) == gold
    return right / len(DOCS)


@pytest.fixture(scope="module")
def url(checkpoint):  # noqa: F811
    from part15_full.async_llm import AsyncLLM
    from part15_full.engine import LLMEngine
    from part15_full.server import build_app

    with running_server(build_app(AsyncLLM(LLMEngine(engine_config(checkpoint))), "tiny")) as u:
        yield u


@pytest.mark.parametrize("batch_size", [1, 4])
def test_local_completions_scores_a_multiple_choice_task_as_hf_does(url, hf, batch_size):  # noqa: F811
    reqs = requests(hf[1])
    served = []
    for start in range(0, len(reqs), batch_size):
        batch = reqs[start:start + batch_size]
        payload = {"model": "tiny", "prompt": [ids for _, ids, _ in batch], "temperature": 0, "max_tokens": 1,
                   "logprobs": 1, "seed": 1234, "echo": True}
        r = httpx.post(f"{url}/v1/completions", json=payload, timeout=60)
        assert r.status_code == 200, r.text
        served += parse(r.json(), [ctxlen for _, _, ctxlen in batch])
    reference = hf_scores(hf, reqs)
    assert [s[0] for s in served] == pytest.approx([s[0] for s in reference], abs=1e-4)
    assert [s[1] for s in served] == [s[1] for s in reference]
    assert accuracy(served, reqs) == accuracy(reference, reqs)


def test_the_harness_scores_the_served_model_as_its_hf_model_does(url, checkpoint, tmp_path):  # noqa: F811
    """lm-evaluation-harness end to end: the same local multiple-choice task through
    `local-completions` (part 15's server) and through `hf` (transformers, fp32): equal per-choice
    log-likelihoods (1e-4), greedy flags and accuracy."""
    import json

    import lm_eval
    from lm_eval.tasks import TaskManager

    rows = [{"question": c, "choices": choices, "gold": gold} for c, choices, gold in DOCS]
    (tmp_path / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "course_mc.yaml").write_text(
        "task: course_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tmp_path / 'items.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{question}}\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{gold}}\"\ntarget_delimiter: \"\"\n"
        "metric_list:\n  - metric: acc\n")
    tasks = TaskManager(include_path=str(tmp_path))
    served = lm_eval.simple_evaluate(
        model="local-completions", tasks=["course_mc"], task_manager=tasks, log_samples=True,
        model_args=f"model=tiny,base_url={url}/v1/completions,tokenizer_backend=huggingface,"
                   f"tokenizer={checkpoint},num_concurrent=1,max_retries=1")
    reference = lm_eval.simple_evaluate(
        model="hf", tasks=["course_mc"], task_manager=tasks, log_samples=True,
        model_args=f"pretrained={checkpoint},dtype=float32,device=cpu")

    def per_choice(result):  # [(log-likelihood, greedy)] per doc, in the task's order
        samples = sorted(result["samples"]["course_mc"], key=lambda s: s["doc_id"])
        return [[tuple(r[0]) for r in s["resps"]] for s in samples]
    ours, theirs = per_choice(served), per_choice(reference)
    assert len(ours) == len(DOCS) and [len(d) for d in ours] == [len(c) for _, c, _ in DOCS]
    assert [ll for d in ours for ll, _ in d] == pytest.approx([ll for d in theirs for ll, _ in d], abs=1e-4)
    assert [g for d in ours for _, g in d] == [g for d in theirs for _, g in d]
    assert served["results"]["course_mc"]["acc,none"] == reference["results"]["course_mc"]["acc,none"]
