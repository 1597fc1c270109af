"""Part 15's step path makes the host wait for the device in one place only: the sampled ids' copy
(shared/sampler.py's SampledBatch.to_output). A read of a device tensor anywhere else (`.item()`,
`.tolist()`, `.cpu()`, `bool(...)`, an `if` on `.any()`/`.all()`) or a tensor made from a Python list
(`torch.tensor(...)`, a copy from pageable memory, which waits for the device before it starts)
would stall the GPU once a step; on a CPU nothing shows it, so this test reads the code (ast).

The exceptions are named with their reason: the speculative decoding's draft model (the host keeps
each pass's drafts), the torch references of attention and of the experts (the GPU runs Triton's
kernels) and expert parallelism (its all-to-alls are sized on the host; it runs eagerly)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Module -> functions (Class.method or function) allowed to reach the host, each with its reason.
STEP_PATH = {
    "part15_full/model_runner.py": {
        "ModelRunner._propose_on_device": "the draft model's drafts go to the host after each pass",
    },
    "part15_full/input_batch.py": {},
    "part15_full/sampler.py": {},
    "part15_full/sampling_metadata.py": {},
    "part15_full/graph_runner.py": {},
    "part15_full/cuda_graph.py": {},
    "part15_full/piecewise.py": {},
    "part15_full/triton_kernels.py": {},
    "part15_full/paged_attention.py": {
        "_reference_plan": "the torch reference plans each step on the host (it is not the GPU's backend)",
    },
    "part15_full/moe_kernels.py": {},
    "part15_full/compilation.py": {},
    "part15_full/fused_moe.py": {
        "experts_reference": "the torch reference of the experts (the CPU's; a GPU runs moe_kernels.py)",
        "FusedMoE._expert_parallel": "expert parallelism sizes its all-to-alls on the host (runs eagerly)",
        "FusedMoE.__init__": "", "FusedMoE.weight_loader": "",
    },
    "part15_full/attention_metadata.py": {
        "PagedAttentionMetadata.build": "metadata from lists: the draft model's passes and the earlier parts",
    },
    "shared/sampler.py": {
        "SampledBatch.to_output": "the one place a step's results reach the host",
        # the shared sampler of parts 01-14 and of the rejection sampler (speculative decoding)
        "_token_counts": "", "apply_penalties": "", "apply_logit_bias": "", "Sampler.sample": "",
        "Sampler.process_logits": "", "Sampler.probs": "", "Sampler.exponential_noise": "",
        "Sampler._gather_logprobs": "", "Sampler.__call__": "",
    },
}
HOST_READS = {"item", "tolist", "cpu"}


def host_syncs(source: str) -> list[tuple[str, int, str]]:
    """(function, line, what) for every host read or list-made tensor in `source`."""
    found = []

    def visit(node, scope):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = f"{scope}.{node.name}" if scope else node.name
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in HOST_READS:
                found.append((scope, node.lineno, f".{f.attr}()"))
            elif isinstance(f, ast.Name) and f.id == "bool" and node.args:
                found.append((scope, node.lineno, "bool(...)"))
            elif isinstance(f, ast.Attribute) and f.attr == "tensor" and isinstance(f.value, ast.Name) \
                    and f.value.id == "torch":
                found.append((scope, node.lineno, "torch.tensor(...)"))
        if isinstance(node, (ast.If, ast.While)):
            for sub in ast.walk(node.test):
                if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr in ("any", "all"):
                    found.append((scope, node.lineno, f"if ....{sub.func.attr}()"))
        for child in ast.iter_child_nodes(node):
            visit(child, scope)
    visit(ast.parse(source), "")
    return found


def offending(path: str, source: str | None = None) -> list[str]:
    allowed = STEP_PATH[path]
    source = (REPO / path).read_text() if source is None else source
    return [f"{path}:{line} {what} in {scope or 'the module'}" for scope, line, what in host_syncs(source)
            if not any(scope == a or scope.startswith(a + ".") for a in allowed)]


@pytest.mark.parametrize("path", sorted(STEP_PATH))
def test_the_step_path_reaches_the_host_only_where_named(path):
    assert offending(path) == []


def test_one_tolist_in_the_sampler_is_caught():
    path = "part15_full/sampler.py"
    source = (REPO / path).read_text()
    mutated = source.replace("        logits = logits.float()\n",
                             "        logits = logits.float()\n        print(meta.row('top_k').tolist())\n", 1)
    assert mutated != source
    assert offending(path, mutated) == [f"{path}:{_line_of(mutated, 'print(meta')} .tolist() in Sampler.sample"]


def test_a_list_made_tensor_and_a_tensor_truth_test_are_caught():
    found = host_syncs("import torch\ndef f(x, ids):\n    if (x > 0).any():\n        return x[torch.tensor(ids)]\n"
                       "    return bool(x.sum())\n")
    assert [what for _, _, what in found] == ["if ....any()", "torch.tensor(...)", "bool(...)"]


def _line_of(source: str, text: str) -> int:
    return next(i for i, line in enumerate(source.splitlines(), 1) if text in line)
