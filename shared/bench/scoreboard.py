"""`python -m shared.bench scoreboard RESULTS.json [--plot PNG]`: the README's scoreboard.

RESULTS.json is one `throughput --json` run that measured several parts (`--part` and `--compare`)
and, as the peer, vLLM's own CPU build (`--vllm-python`): one workload, one machine, one run, so the
ratios mean something. This prints the markdown table the README shows and draws its bar chart:
each engine's output tokens per second beside vLLM's and the workload's floor (the least time any
engine needs at this machine's measured peaks)."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any


def _label(system: dict[str, Any]) -> str:
    """'part04', 'part15', 'vllm' (the main engine is called 'ours' in the results)."""
    if system["name"] == "ours":
        return re.match(r"part\d\d", system["notes"]["engine"]).group(0)
    return system["name"]


def rows(results: dict[str, Any]) -> list[tuple[str, float]]:
    """(label, output tokens/s) of every system that ran without error: parts in order, vLLM last."""
    measured = [(_label(s), s["output_tokens_per_s"]) for s in results["systems"] if not s.get("error")]
    return sorted(measured, key=lambda r: (r[0] == "vllm", r[0]))


def table(results: dict[str, Any]) -> str:
    """The markdown table: tokens/s, and each as a ratio of the first part, of vLLM and of the roofline
    bound (the least time any engine could take: a ceiling on tokens/s)."""
    measured = rows(results)
    base_name, base = measured[0]
    peer = dict(measured).get("vllm")
    floor = results["floor"]["output_tokens_per_s"]
    head = f"| engine | output tok/s | vs {base_name} | vs vLLM | of the bound |\n|---|---:|---:|---:|---:|"
    lines = [f"| {name} | {tps:.1f} | {tps / base:.2f}x | {f'{tps / peer:.2f}x' if peer else '-'} | "
             f"{100 * tps / floor:.0f}% |" for name, tps in measured]
    return "\n".join([head, *lines])


def plot(results: dict[str, Any], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = rows(results)
    w = results["workload"]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    colors = ["tab:orange" if name == "vllm" else "tab:blue" for name, _ in measured]
    ax.bar([name for name, _ in measured], [tps for _, tps in measured], color=colors)
    floor = results["floor"]["output_tokens_per_s"]
    ax.axhline(floor, color="gray", linestyle="--", label=f"floor at this machine's peaks ({floor:.0f})")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{w['num_requests']} requests, prompts {w['input_len'][0]}-{w['input_len'][1]}, outputs "
                 f"{w['output_len'][0]}-{w['output_len'][1]} tokens; {results['machine']['device']} "
                 f"{results['machine']['dtype']}, {results['machine']['cpu_threads']} threads", fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_scoreboard(results_path: str, plot_path: str | None) -> str:
    results = json.loads(Path(results_path).read_text())
    if plot_path:
        plot(results, plot_path)
    return table(results)
