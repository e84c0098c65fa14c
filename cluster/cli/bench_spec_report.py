"""`bench spec`'s report: its tables (ours, transformers, llama.cpp, per category, per position) and its plot."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from cluster.cli.bench_tables import pct, table


def format_spec(result: dict[str, Any]) -> str:
    s = result["settings"]
    dtypes = ", ".join(f"{role} {dtype}" for role, dtype in result.get("dtypes", {}).items())
    out = [f"bench spec: {s['model']} (draft {s['draft']}{'; ' + dtypes if dtypes else ''}), "
           f"{len(result['prompts'])} prompts, max {s['max_tokens']} tokens; tok/s = output tokens / wall seconds "
           "(prefill included)"]
    if not result["results"]:  # --llamacpp-only
        return "\n".join(out + _llamacpp_lines(result))
    headers = ["T", "batch", "config", "tok/s", "vs plain", "vs hf peer", "peer", "vs hf plain", "accept",
               "tok/round", "mean k", "draft%", "verify%", "other%", "=plain"]
    rows = []
    for r in result["results"]:
        acc = r.get("acceptance") or {}
        frac = r.get("time_split_fraction", {})
        rows.append([r["temperature"], r["batch"], r["label"], r["tokens_per_second"], r["speedup_vs_plain"],
                     r["speedup_vs_hf_peer"], r["hf_peer"], r["speedup_vs_hf_plain"], acc.get("acceptance_rate"),
                     acc.get("mean_tokens_per_round"), acc["proposed"] / acc["rounds"] if acc else None,
                     pct(frac.get("draft")), pct(frac.get("verify")),
                     pct(sum(frac.get(k, 0.0) for k in ("reconcile", "plan_other", "outside"))),
                     r.get("same_output_as_plain")])
    out.append(table(headers, rows))
    traced = [r for r in result["results"] if r.get("traced")]
    if traced:
        out.append("\ntracing on (every span sampled, exported to a JSON-lines file) vs off, same config, same run:")
        out.append(table(["T", "batch", "config", "tok/s traced", "traced / untraced"],
                         [[r["temperature"], r["batch"], r["label"], r["tokens_per_second"], r["speedup_vs_untraced"]]
                          for r in traced]))
    with_logprobs = [r for r in result["results"] if r.get("logprobs") is not None]
    if with_logprobs:
        out.append("\nlog-probabilities asked for (each token's, with its top alternatives) vs not, same config, "
                   "same run:")
        out.append(table(["T", "batch", "config", "tok/s", "with / without"],
                         [[r["temperature"], r["batch"], r["label"], r["tokens_per_second"],
                           r["speedup_vs_no_logprobs"]] for r in with_logprobs]))
    if result["hf"]:
        out.append("\ntransformers (batch 1, one prompt at a time):")
        out.append(table(["T", "mode", "tok/s", "vs hf plain", "=ours plain"],
                         [[h["temperature"], h["mode"], h["tokens_per_second"], h["speedup_vs_hf_plain"],
                           h.get("same_output_as_our_plain")] for h in result["hf"]]))
    cats = [c for c in ("prose", "code", "qa", "summarisation", "copy-edit") if c in s["categories"]]
    per_cat = [r for r in result["results"] if r["batch"] == 1 and r["draft"] != "none"]
    if per_cat:
        out.append("\nbatch 1 speedup over plain decoding per category (acceptance rate in brackets):")
        out.append(table(["T", "config", *cats], [
            [r["temperature"], r["label"], *[_cat_cell(r, c) for c in cats]] for r in per_cat]))
    out.append("\nsurvival s_k per draft position (batch 1):")
    out.append(table(["T", "config", "s_1..s_k"], [
        [r["temperature"], r["label"], " ".join(f"{v:.2f}" for v in r["acceptance"]["survival"])]
        for r in per_cat if r.get("acceptance")]))
    return "\n".join(out + _llamacpp_lines(result))


def _llamacpp_lines(result: dict[str, Any]) -> list[str]:
    from cluster.bench.llamacpp import tables

    section = result.get("llamacpp")
    if not section:
        return []
    out = [f"{title}\n{table(headers, rows)}" for title, headers, rows in tables(section)]
    modes = {m["mode"]: m for m in section["modes"]}
    ours = [r for r in result["results"] if r["batch"] == 1 and r["temperature"] == 0.0]
    if ours and "plain" in modes:
        cpu = section["settings"].get("cpu") or "this CPU"
        peer = "native llama.cpp" if section.get("native") else section["version"]
        rows = [[r["label"], r["tokens_per_second"], *[r["tokens_per_second"] / modes[m]["tokens_per_second"]
                                                       if modes[m]["tokens_per_second"] else None for m in modes]]
                for r in ours]
        out.append(f"\nours (greedy, batch 1) against {peer} on {cpu}, same prompts, same threads, one run:\n"
                   + table(["config", "tok/s", *[f"x llama.cpp {m}" for m in modes]], rows))
    return out


def _cat_cell(row: dict[str, Any], category: str) -> str:
    speedup = row["by_category_speedup_vs_plain"].get(category)
    acc = row["by_category"].get(category, {}).get("acceptance")
    if speedup is None:
        return "-"
    return f"{speedup:.2f}" + (f" ({acc['acceptance_rate']:.2f})" if acc else "")


def plot_spec(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = result["results"]
    groups = sorted({(r["temperature"], r["batch"]) for r in results})
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    ax = axes[0]
    labels, values, colors = [], [], []
    for temperature, batch in groups:
        for r in [r for r in results if (r["temperature"], r["batch"]) == (temperature, batch)]:
            labels.append(f"T={temperature:g} b={batch}\n{r['label']}")
            values.append(r["tokens_per_second"])
            colors.append({"none": "grey", "model": "tab:blue", "ngram": "tab:orange", "suffix": "tab:red"}[r["draft"]])
        if batch == 1:
            for h in [h for h in result["hf"] if h["temperature"] == temperature]:
                labels.append(f"T={temperature:g} b=1\nhf {h['mode']}")
                values.append(h["tokens_per_second"])
                colors.append("tab:green")
    ax.bar(range(len(values)), values, color=colors)
    ax.set_xticks(range(len(values)), labels, rotation=90, fontsize=7)
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{result['settings']['model']}: throughput (green: transformers)")
    ax = axes[1]
    per_cat = [r for r in results if r["batch"] == 1 and r["draft"] != "none"]
    cats = [c for c in result["settings"]["categories"]]
    width = 0.8 / max(1, len(per_cat))
    for i, r in enumerate(per_cat):
        ax.bar([j + i * width for j in range(len(cats))],
               [r["by_category_speedup_vs_plain"].get(c, 0.0) for c in cats], width,
               label=f"T={r['temperature']:g} {r['label']}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cats))], cats)
    ax.set_ylabel("speedup over plain decoding (batch 1)")
    ax.set_title("per category")
    ax.legend(fontsize=6, ncol=2)
    ax = axes[2]
    for r in per_cat:
        if r.get("acceptance"):
            surv = r["acceptance"]["survival"]
            ax.plot(range(1, len(surv) + 1), surv, marker="o", label=f"T={r['temperature']:g} {r['label']}")
    ax.set_xlabel("draft position k")
    ax.set_ylabel("s_k = P(first k drafts accepted)")
    ax.set_ylim(0, 1.02)
    ax.set_title("acceptance per position (batch 1)")
    ax.legend(fontsize=6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot written to {path}", file=sys.stderr)
