"""Part 11: mixture-of-experts models and expert parallelism.

- Tiny random Mixtral and Qwen2-MoE checkpoints (save_pretrained): the single-process MoE model's
  greedy output equals HF's own MoE model (fp32, CPU).
- EP=2 and EP=4 (gloo, real processes; attention tensor-parallel over the same ranks) and TP=2 of
  the experts: greedy and seeded output identical to the single process, including uneven expert
  maps (6 experts over 4 ranks).
- FusedMoE's dispatch and combine on 4 real ranks against the one-process reference: one token
  (three ranks send nothing), every pair routed to one rank's experts, tied router logits; the load
  counters add up to tokens x k.
- The Triton grouped kernel against the reference (TRITON_INTERPRET=1).
- The server serves a MoE checkpoint with EP=2 through the openai client; no process outlives it."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import openai
import pytest
import torch
import torch.multiprocessing as mp

from conftest import free_port, greedy, pool_is_full, running_server, save_tiny
from shared.sampling_params import SamplingParams

COMMON = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=127,
              tie_word_embeddings=False)
CONFIGS = {
    "mixtral": ("MixtralConfig", dict(COMMON, intermediate_size=96, num_hidden_layers=2, num_local_experts=8,
                                      num_experts_per_tok=2)),
    # 6 experts: over 4 ranks the expert map is uneven (1, 2, 1, 2); layer 1 is a dense MLP
    "qwen2_moe": ("Qwen2MoeConfig", dict(COMMON, intermediate_size=96, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=80, num_hidden_layers=3, num_experts=6,
                                         num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1])),
}
PROMPTS = [[1, 5, 9, 33, 2, 77], [1, 100, 3], list(range(1, 50)), [1, 7, 7, 7, 7, 7, 7, 7, 7]]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("moe")
    return {name: save_tiny(root / name, getattr(transformers, cls)(**kw), seed=3, scale=0.3)
            for name, (cls, kw) in CONFIGS.items()}


def llm(path, **kw):
    from part11_ep import LLM

    return LLM(model=str(path), device="cpu", dtype="float32", kv_cache_memory_mb=4, **kw)


@pytest.fixture(scope="module")
def single(moe):
    """The single-process outputs: greedy, and seeded sampling with n=2."""
    out = {}
    for name, path in moe.items():
        m = llm(path, max_num_batched_tokens=64)
        out[name] = ([o.outputs[0].token_ids for o in m.generate(PROMPTS, greedy(12))],
                     [[c.token_ids for c in o.outputs] for o in m.generate(PROMPTS, SEEDED)])
        assert pool_is_full(m)
    return out


SEEDED = SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=10)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_single_process_moe_matches_hf(moe, single, name):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(moe[name], dtype=torch.float32).eval()
    for ids, got in zip(PROMPTS, single[name][0]):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert got == ref[0, len(ids):].tolist()


@pytest.mark.parametrize("name,size,ep", [("mixtral", 2, True), ("mixtral", 4, True), ("qwen2_moe", 4, True),
                                          ("qwen2_moe", 2, False)])
def test_expert_and_tensor_parallel_equal_the_single_process(moe, single, name, size, ep):
    with llm(moe[name], tensor_parallel_size=size, enable_expert_parallel=ep, max_num_batched_tokens=64) as m:
        procs = list(m.engine.executor.procs.values())
        assert [o.outputs[0].token_ids for o in m.generate(PROMPTS, greedy(12))] == single[name][0]
        assert [[c.token_ids for c in o.outputs] for o in m.generate(PROMPTS, SEEDED)] == single[name][1]
        assert pool_is_full(m)
    assert not any(p.is_alive() for p in procs)


# ---- FusedMoE's dispatch and combine, on 4 real ranks -------------------------------------

CASES = {
    "one_token": dict(tokens=1, bias=None),  # ranks 1-3 hold no token: they send nothing
    "all_to_rank1": dict(tokens=9, bias=[-9, 9.0, 9.0, -9, -9, -9]),  # experts 1, 2: rank 1's
    "ties": dict(tokens=7, bias=None, tie=True),  # every router logit equal
    "spread": dict(tokens=13, bias=None),
}


def _case_inputs(case: dict):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(case["tokens"], 16, generator=g)
    logits = torch.zeros(case["tokens"], 6) if case.get("tie") else torch.randn(case["tokens"], 6, generator=g)
    if case["bias"] is not None:
        logits = logits + torch.tensor(case["bias"])
    w13, w2 = torch.randn(6, 24, 16, generator=g) * 0.3, torch.randn(6, 16, 12, generator=g) * 0.3
    return x, logits, w13, w2


def _ep_rank(rank: int, size: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from part11_ep.fused_moe import FusedMoE, expert_range

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        res = {}
        for name, case in CASES.items():
            x, logits, w13, w2 = _case_inputs(case)
            layer = FusedMoE(6, 2, 16, 12, renormalize=True, rank=rank, size=size, expert_parallel=True)
            first, count = expert_range(6, rank, size)
            layer.w13_weight.data.copy_(w13[first:first + count])
            layer.w2_weight.data.copy_(w2[first:first + count])
            y = layer(x, logits)
            res[name] = {"y": y, "load": layer.tokens_per_expert.clone(), "first": first,
                         "bytes": layer.all_to_all_bytes}
        torch.save(res, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_dispatch_and_combine_on_four_ranks(tmp_path):
    from part11_ep.fused_moe import experts_reference, select_experts

    mp.spawn(_ep_rank, args=(4, free_port(), str(tmp_path)), nprocs=4, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    assert [r["spread"]["load"].numel() for r in ranks] == [1, 2, 1, 2]  # the uneven expert map
    for name, case in CASES.items():
        x, logits, w13, w2 = _case_inputs(case)
        weights, ids = select_experts(logits, 2, renormalize=True)
        want = experts_reference(x, w13, w2, ids, weights)
        load = torch.cat([r[name]["load"] for r in ranks])
        assert torch.equal(load, torch.bincount(ids.flatten(), minlength=6)), name  # per expert, all ranks
        assert load.sum() == case["tokens"] * 2
        for r in ranks:  # every rank ends with every token's output
            torch.testing.assert_close(r[name]["y"], want, rtol=1e-5, atol=1e-5)
    assert [int(r["all_to_rank1"]["load"].sum()) for r in ranks] == [0, 18, 0, 0]  # three ranks compute nothing
    for name, case in CASES.items():  # every pair's activation goes out and its result comes back
        assert sum(r[name]["bytes"] for r in ranks) == 2 * case["tokens"] * 2 * 16 * 4, name
    _, tied = select_experts(torch.zeros(1, 6), 2, renormalize=True)
    assert tied.tolist() == torch.topk(torch.full((1, 6), 1 / 6), 2).indices.tolist()  # HF's tie rule


def test_select_experts_follows_the_checkpoint():
    from part11_ep.fused_moe import select_experts

    logits = torch.tensor([[2.0, 0.5, 1.0, -1.0]])
    probs = torch.softmax(logits, -1)[0]
    w, ids = select_experts(logits, 2, renormalize=False)
    assert ids.tolist() == [[0, 2]] and torch.allclose(w[0], probs[[0, 2]])
    w, _ = select_experts(logits, 2, renormalize=True)
    assert torch.allclose(w[0], probs[[0, 2]] / probs[[0, 2]].sum())


def test_triton_grouped_kernel_matches_reference():
    pytest.importorskip("triton")
    script = textwrap.dedent("""
        import json, torch
        from part11_ep.fused_moe import experts_reference, select_experts
        from part11_ep.moe_kernels import fused_experts
        g = torch.Generator().manual_seed(0)
        errs = {}
        for t, e, k, h, i in [(1, 4, 2, 32, 16), (21, 6, 2, 48, 40), (40, 8, 3, 32, 24)]:
            x = torch.randn(t, h, generator=g)
            w13, w2 = torch.randn(e, 2 * i, h, generator=g) * 0.2, torch.randn(e, h, i, generator=g) * 0.2
            weights, ids = select_experts(torch.randn(t, e, generator=g), k, True)
            want = experts_reference(x, w13, w2, ids, weights)
            got = fused_experts(x, w13, w2, ids, weights, block_m=16)
            errs[f"{t}x{e}x{k}"] = (got - want).abs().max().item()
        print(json.dumps(errs))
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    errs = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(errs) == 3 and all(v < 1e-4 for v in errs.values()), errs


def test_group_sizes_the_experts_cannot_take_are_refused_before_any_process_starts(tmp_path):
    import transformers

    wide = dict(COMMON, num_attention_heads=16, num_key_value_heads=16, intermediate_size=96)
    transformers.Qwen2MoeConfig(**wide, moe_intermediate_size=90, shared_expert_intermediate_size=80, num_experts=8,
                                num_experts_per_tok=2).save_pretrained(tmp_path / "qwen")
    transformers.MixtralConfig(**wide, num_local_experts=8, num_experts_per_tok=2).save_pretrained(tmp_path / "mixtral")
    with pytest.raises(ValueError, match=r"experts' intermediate size \(90\) must divide by the tensor-parallel size \(4\)"):
        llm(tmp_path / "qwen", tensor_parallel_size=4)
    with pytest.raises(ValueError, match=r"over 16 ranks needs at least as many experts \(8\)"):
        llm(tmp_path / "mixtral", tensor_parallel_size=16, enable_expert_parallel=True)


def test_unsupported_architecture_is_refused(tmp_path):
    from part11_ep.model_loader import architecture

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*not supported.*MixtralForCausalLM"):
        architecture(tmp_path)


def test_server_serves_moe_with_ep2(tmp_path):
    """A Mixtral with the embedded tokenizer, served at EP=2: the openai client's text equals the
    single process's, and no worker outlives the server."""
    import transformers

    from part11_ep.async_llm import AsyncLLM
    from part11_ep.server import build_app
    from shared.tokenizer import TOKENIZER_FILES
    from shared.weights import embedded_model_path

    cls, kw = CONFIGS["mixtral"]
    path = save_tiny(tmp_path / "served", getattr(transformers, cls)(**{**kw, "vocab_size": 49152, "eos_token_id": 2}),
                     seed=4, scale=0.3)
    for name in os.listdir(embedded_model_path()):
        if name in TOKENIZER_FILES or name.startswith("chat_template"):
            shutil.copy(embedded_model_path() / name, path / name)
    want = llm(path).generate(["The capital of France is"], greedy(10))[0].outputs[0].text
    m = llm(path, tensor_parallel_size=2, enable_expert_parallel=True)
    procs = list(m.engine.executor.procs.values())
    try:
        with running_server(build_app(AsyncLLM(m.engine), "tiny-moe")) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            r = client.completions.create(model="tiny-moe", prompt="The capital of France is", max_tokens=10,
                                          temperature=0, extra_body={"ignore_eos": True})
            assert r.choices[0].text == want and r.usage.completion_tokens == 10
            chat = client.chat.completions.create(model="tiny-moe", messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=5, temperature=0)
            assert chat.choices[0].message.content is not None
    finally:
        m.shutdown()
    assert not any(p.is_alive() for p in procs)
