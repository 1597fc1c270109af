"""Part 08: speculative decoding changes how many tokens a step yields, never which. Greedy output
equals HF with the n-gram and the draft-model proposers at several k (with chunked prefill and the
prefix cache on); a separate draft checkpoint with the same vocabulary works and one with another
vocabulary is refused; seeded sampling is reproducible; a stop string, a stop id, EOS or max_tokens
inside an accepted run ends the output exactly where plain decoding ends it; max_model_len is never
passed; counters add up; nothing leaks. And the statistical test: on a tiny-vocabulary model the
first tokens sampled with a draft model follow the target's exact distribution (chi-square over
10,000 draws), and the same test rejects a rejection sampler with a wrong residual."""
from __future__ import annotations

import itertools
import json

import httpx
import pytest
import torch

import part08_specdec.rejection_sampler as rs_module
from conftest import chi2_pvalue, greedy, pool_is_full, running_server, save_tiny
from shared.sampling_params import SamplingParams

PART = "part08_specdec"


SPEC_KWARGS = {None: {}, "ngram": dict(speculative_method="ngram"), "draft_model": dict(speculative_method="draft_model"),
               # every layer: the target drafting for itself, so every draft is accepted (long runs)
               "draft_model_all_layers": dict(speculative_method="draft_model", speculative_draft_layers=30)}


class _SpecEngines(dict):
    """spec_llms[method]: built on first use. The engine without speculation stays; of the others
    only the last one asked for is kept (all four at once held ~5.5 GB)."""

    def __missing__(self, method):
        from conftest import build_llm, release_memory

        if method is not None:
            for other in [m for m in self if m is not None]:
                del self[other]
            release_memory()
        self[method] = build_llm(PART, kv_cache_memory_mb=32, **SPEC_KWARGS[method])
        return self[method]


@pytest.fixture(scope="module")
def spec_llms():
    """One engine per proposer (k is changed between runs; each test sets it) and one without
    speculation."""
    return _SpecEngines()


@pytest.fixture(scope="module")
def prompts(prompt_token_ids):
    repetitive = (prompt_token_ids[0] + prompt_token_ids[1]) * 3  # the n-gram proposer's case
    return [repetitive, *prompt_token_ids[2:6]]


def set_k(llm, k: int) -> None:
    llm.engine.proposer.k = k


def at_rest(llm) -> bool:
    return pool_is_full(llm) and all(b.ref_cnt == 0 for b in llm.engine.kv_cache_manager.block_pool.blocks)


@pytest.mark.parametrize("method,k", [("ngram", 1), ("ngram", 4), ("draft_model", 2), ("draft_model", 5)])
def test_greedy_equals_hf_with_speculation(spec_llms, prompts, hf_greedy, method, k):
    llm = spec_llms[method]
    set_k(llm, k)
    stats = llm.engine.spec_decoding_stats
    drafts0 = stats.num_draft_tokens
    outs = llm.generate(prompts, greedy(24))
    for o, p in zip(outs, prompts):
        assert o.outputs[0].token_ids == hf_greedy(p, 24)
    assert stats.num_draft_tokens > drafts0 and at_rest(llm)


def test_small_budget_trims_drafts_and_keeps_greedy_output(spec_llms, prompts, hf_greedy):
    llm = spec_llms["draft_model"]
    set_k(llm, 4)
    cfg = llm.engine.scheduler.config
    budget = cfg.max_num_batched_tokens
    cfg.max_num_batched_tokens = llm.engine.config.max_num_seqs  # 64: prompts chunk, drafts get cut
    try:
        outs = llm.generate(prompts * 3, greedy(12))
    finally:
        cfg.max_num_batched_tokens = budget
    for o, p in zip(outs, prompts * 3):
        assert o.outputs[0].token_ids == hf_greedy(p, 12)
    assert llm.engine.prefix_cache_stats.hits > 0 and at_rest(llm)  # the copies hit the cache


def test_counters_add_up(spec_llms, prompts):
    llm = spec_llms["ngram"]
    set_k(llm, 3)
    stats = llm.engine.spec_decoding_stats
    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    out = llm.generate([prompts[0]], greedy(40))[0]
    drafts, tokens, accepted = (a - b for a, b in zip(
        (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens), before))
    assert 0 < accepted <= tokens <= 3 * drafts
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
    assert stats.num_accepted_tokens_per_pos == sorted(stats.num_accepted_tokens_per_pos, reverse=True)
    # Every output token but the first (the prompt's step) came from a verifying or plain step;
    # steps that verified drafts yielded 1 + accepted tokens each.
    assert len(out.outputs[0].token_ids) == 40 and accepted + drafts <= 39
    assert stats.mean_acceptance_length == 1 + stats.num_accepted_tokens / stats.num_drafts


def stop_cases(llm, prompt, reference):
    """Stop conditions that fall inside the reference output: a stop id, a stop string, max_tokens."""
    tok = reference.outputs[0].token_ids
    text = reference.outputs[0].text
    return [SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[tok[9]]),
            SamplingParams(temperature=0, max_tokens=40, stop=[text[len(text) // 2:len(text) // 2 + 3]]),
            SamplingParams(temperature=0, max_tokens=40, stop=[text[len(text) // 2:len(text) // 2 + 3]],
                           include_stop_str_in_output=True),
            SamplingParams(temperature=0, max_tokens=7),
            SamplingParams(temperature=0, max_tokens=40, min_tokens=5, stop_token_ids=[tok[2]])]


@pytest.mark.parametrize("method", ["ngram", "draft_model_all_layers"])
def test_stops_inside_an_accepted_run_end_where_plain_decoding_ends(spec_llms, prompts, method):
    plain, llm = spec_llms[None], spec_llms[method]
    set_k(llm, 5)
    ref = plain.generate([prompts[0]], greedy(40))[0]
    runner = llm.engine.runner
    verify = runner.rejection_sampler
    emitted = []  # tokens the rejection sampler returned, step by step

    def recording(*args, **kwargs):
        out = verify(*args, **kwargs)
        emitted.append(sum(len(t) for t in out.token_ids))
        return out

    runner.rejection_sampler = recording
    cut_inside_a_run = 0
    try:
        for params in stop_cases(plain, prompts[0], ref):
            want = plain.generate([prompts[0]], params)[0].outputs[0]
            request = llm.engine.make_request(prompts[0], params)
            emitted.clear()
            got = llm.engine.generate([request])[0].outputs[0]
            assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
            seq = request.sequences[0]
            assert seq.token_ids == prompts[0] + list(got.token_ids)  # nothing past the stop is kept
            assert len(seq.block_hashes) * 16 <= len(seq.token_ids)
            cut_inside_a_run += sum(emitted) > len(got.token_ids)
    finally:
        runner.rejection_sampler = verify
    # The greedy run accepts most drafts on this prompt, so some stops fall inside an accepted
    # run: tokens were verified past the stop and thrown away.
    assert cut_inside_a_run >= 2
    assert at_rest(llm)


def test_eos_inside_an_accepted_run(spec_llms, prompt_token_ids):
    plain, llm = spec_llms[None], spec_llms["ngram"]
    chat = prompt_token_ids[4:8]  # chat prompts: the model ends its answers with EOS
    params = SamplingParams(temperature=0, max_tokens=200)
    want = plain.generate(chat, params)
    assert any(o.outputs[0].finish_reason == "stop" for o in want)
    got = llm.generate(chat, params)
    for a, b in zip(want, got):
        assert (a.outputs[0].token_ids, a.outputs[0].finish_reason) == (b.outputs[0].token_ids, b.outputs[0].finish_reason)
    assert at_rest(llm)


def test_max_model_len_is_never_passed(spec_llms, prompts):
    from conftest import build_llm, release_memory

    spec_llms.clear()  # engines of their own here: the shared ones go (rebuilt when next asked for)
    release_memory()
    plain = build_llm(PART, kv_cache_memory_mb=8, max_model_len=96)
    llm = build_llm(PART, kv_cache_memory_mb=8, max_model_len=96, speculative_method="ngram",
                    num_speculative_tokens=6)
    prompt = prompts[0][:60]
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    want, got = plain.generate([prompt], params)[0], llm.generate([prompt], params)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert len(prompt) + len(got.outputs[0].token_ids) == 96
    assert got.outputs[0].finish_reason == "length" and llm.engine.spec_decoding_stats.num_accepted_tokens > 0
    assert at_rest(llm)


def test_seeded_sampling_is_reproducible_and_logprobs_are_the_targets(spec_llms, prompts):
    llm, plain = spec_llms["draft_model"], spec_llms[None]
    set_k(llm, 3)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=11 + i, max_tokens=16, n=2, presence_penalty=0.3 * i,
                             logit_bias={5: 2.0}) for i in range(3)]
    a = llm.generate(prompts[:3], params)
    b = llm.generate(prompts[:3], params)
    assert [[c.token_ids for c in o.outputs] for o in a] == [[c.token_ids for c in o.outputs] for o in b]
    lp = SamplingParams(temperature=0, max_tokens=12, logprobs=3)
    want, got = plain.generate(prompts[:2], lp), llm.generate(prompts[:2], lp)
    for x, y in zip(want, got):
        cx, cy = x.outputs[0], y.outputs[0]
        assert cx.token_ids == cy.token_ids
        for dx, dy in zip(cx.logprobs, cy.logprobs):  # per token: {id: Logprob} of it and the top 3
            assert dx.keys() == dy.keys()
            for t in dx:
                assert abs(dx[t].logprob - dy[t].logprob) < 1e-4 and dx[t].rank == dy[t].rank
    assert at_rest(llm)


# --------------------------------------------------------------- a separate draft checkpoint

TINY = dict(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=0,
            eos_token_id=7, pad_token_id=0, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("specdec")
    from transformers import LlamaConfig

    # std 0.5: peaked next-token distributions, so target and draft differ a lot (many rejections)
    return {"target": save_tiny(root / "target", LlamaConfig(**TINY), seed=0, scale=0.5),
            "draft": save_tiny(root / "draft", LlamaConfig(**TINY), seed=1, scale=0.5),
            "other_vocab": save_tiny(root / "other", LlamaConfig(**{**TINY, "vocab_size": 16}), seed=2, scale=0.5)}


def tiny_llm(tiny, **kw):
    from part08_specdec import LLM

    return LLM(model=str(tiny["target"]), device="cpu", dtype="float32", kv_cache_memory_mb=8,
               max_num_seqs=512, max_num_batched_tokens=4096, **kw)


def test_bad_speculative_configs_are_refused(tiny):
    with pytest.raises(ValueError, match="vocabulary"):
        tiny_llm(tiny, speculative_method="draft_model", speculative_model=str(tiny["other_vocab"]))
    with pytest.raises(ValueError, match="speculative_method"):
        tiny_llm(tiny, speculative_method="medusa")
    with pytest.raises(ValueError, match="draft_model"):
        tiny_llm(tiny, speculative_model=str(tiny["draft"]))
    with pytest.raises(ValueError, match="at least 1"):
        tiny_llm(tiny, speculative_method="ngram", num_speculative_tokens=0)


def test_greedy_with_a_separate_draft_checkpoint_equals_hf(tiny, draft_spec_llm):
    """The tiny target against HF, drafting with a second checkpoint of the same vocabulary."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny["target"], dtype=torch.float32).eval()
    prompts = [[1, 2, 3, 4, 5], [3, 3, 3], [6, 5, 4, 3, 2, 1, 0, 1, 2]]
    with torch.no_grad():
        # An explicit mask: without it HF would mask the prompt's token 0 as padding.
        want = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=20, do_sample=False, eos_token_id=[],
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    stats = draft_spec_llm.engine.spec_decoding_stats
    accepted = stats.num_accepted_tokens
    got = draft_spec_llm.generate(prompts, greedy(20))
    assert [o.outputs[0].token_ids for o in got] == want
    assert stats.num_accepted_tokens > accepted and at_rest(draft_spec_llm)


PROMPT = [1, 2, 3, 4, 5]
N_DRAWS = 10_000
LENGTH = 3  # the joint distribution of the first three tokens: 8^3 = 512 outcomes


def exact_joint(path) -> torch.Tensor:
    """P(t1, t2, t3 | PROMPT) from HF transformers on the target: the distribution that sampling at
    temperature 1 must follow, with or without speculation."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    V = TINY["vocab_size"]
    joint = torch.zeros([V] * LENGTH, dtype=torch.float64)
    with torch.no_grad():
        for prefix in itertools.product(range(V), repeat=LENGTH - 1):
            ids = torch.tensor([PROMPT + list(prefix)])
            probs = model(ids).logits[0].double().softmax(-1)  # every position's next-token distribution
            p = 1.0
            for i, t in enumerate(prefix):
                p = p * probs[len(PROMPT) - 1 + i, t]
            joint[prefix] = p * probs[-1]
    return joint.flatten()


def sampled_joint(llm) -> torch.Tensor:
    params = [SamplingParams(temperature=1.0, max_tokens=LENGTH + 1, ignore_eos=True, seed=i) for i in range(N_DRAWS)]
    outs = llm.generate([PROMPT] * N_DRAWS, params)
    V = TINY["vocab_size"]
    index = [sum(t * V ** (LENGTH - 1 - i) for i, t in enumerate(o.outputs[0].token_ids[:LENGTH])) for o in outs]
    return torch.bincount(torch.tensor(index), minlength=V ** LENGTH)


def fit_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square with the outcomes expected fewer than 5 times pooled into one bin."""
    small = probs * counts.sum() < 5
    counts = torch.cat([counts[~small], counts[small].sum()[None]])
    probs = torch.cat([probs[~small], probs[small].sum()[None]])
    return chi2_pvalue(counts, probs)


@pytest.fixture(scope="module")
def draft_spec_llm(tiny):
    llm = tiny_llm(tiny, speculative_method="draft_model", speculative_model=str(tiny["draft"]),
                   num_speculative_tokens=2)
    return llm


def test_sampled_tokens_follow_the_target_distribution(tiny, draft_spec_llm):
    exact = exact_joint(tiny["target"])
    stats = draft_spec_llm.engine.spec_decoding_stats
    counts = sampled_joint(draft_spec_llm)
    # The drafts really were tested: many rejected (a poor draft), many accepted.
    assert 0.1 < stats.acceptance_rate < 0.9 and stats.num_drafts >= N_DRAWS
    pvalue = fit_pvalue(counts, exact)
    print(f"p-value {pvalue:.3g}, acceptance {stats.acceptance_rate:.2f}")
    assert pvalue > 1e-3
    assert at_rest(draft_spec_llm)


def test_the_same_test_rejects_a_wrong_residual(tiny, draft_spec_llm, monkeypatch):
    monkeypatch.setattr(rs_module, "residual_probs", lambda p, q: p)  # resample from p on rejection
    exact = exact_joint(tiny["target"])
    pvalue = fit_pvalue(sampled_joint(draft_spec_llm), exact)
    print(f"p-value {pvalue:.3g}")
    assert pvalue < 1e-6


def test_server_with_speculation_streams_what_plain_decoding_returns(spec_llms, prompts, hf_greedy):
    """The part's server over an engine that speculates: non-streamed and streamed completions
    (several tokens per step reach the stream as one delta) equal HF's greedy tokens."""
    from part08_specdec.server import build_app

    llm = spec_llms["ngram"]
    set_k(llm, 4)
    want = hf_greedy(prompts[0], 24)
    with running_server(build_app(llm, "m")) as url:
        body = {"prompt": prompts[0], "max_tokens": 24, "temperature": 0, "ignore_eos": True, "logprobs": 1}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200
        num_logprobs = len(r.json()["choices"][0]["logprobs"]["tokens"])
        text = r.json()["choices"][0]["text"]
        assert text == llm.tokenizer.decode(want)
        chunks = []
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as s:
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:])["choices"][0]["text"])
        assert "".join(chunks) == text and len(chunks) < 24  # accepted runs arrive together
    assert num_logprobs == 24 and at_rest(llm)
