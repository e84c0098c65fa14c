"""`specserve bench runtime | spec | serve | kv`: benchmark figures, printed as tables and written as JSON.

    bench runtime   forward-pass step times and multi-token scoring ratios, ours vs transformers
                    (cluster/bench/runtime.py)
    bench spec      speculative decoding end to end vs plain decoding and transformers' assisted
                    generation, per prompt category (cluster/bench/spec.py); optional PNG plot
    bench serve     the Ray Serve cluster through gRPC at several concurrencies, speculation on and off:
                    TTFT, TPOT, per-token ITL, tokens/s, goodput, overhead vs in process
                    (cluster/bench/serve.py; starts Ray: run it under scripts/in-netns.sh)
    bench kv        the KV-block manager: ledger rounds in process, and the actor's round trip through
                    RemoteKV (cluster/bench/kv.py; starts Ray: run it under scripts/in-netns.sh)

Figures only, never timed assertions. Progress lines go to stderr, tables to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from cluster.cli.client_flags import add_client_flags, apply_client_flags
from cluster.cli.generate import parse_k
from specserve_types.api import DRAFT_AUTO, DRAFT_DTYPES, TARGET_DTYPES


def _at_least_one(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="benchmarks: runtime | spec | serve | kv (figures and JSON)")
    benches = p.add_subparsers(dest="bench", required=True)

    rt = benches.add_parser("runtime", help="decode step time, k-token scoring ratio, ours vs transformers")
    rt.add_argument("--models", nargs="+", default=None, help="model names or HF dirs (default: every bundled model)")
    rt.add_argument("--contexts", nargs="+", type=int, default=[128, 1024], help="past lengths (default 128 1024)")
    rt.add_argument("--max-k", type=int, default=8, help="score n = 1..MAX_K new tokens (default 8)")
    rt.add_argument("--repeats", type=int, default=5, help="timed rounds; medians are reported (default 5)")
    rt.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    rt.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    rt.add_argument("--dtype", choices=TARGET_DTYPES, default="float32", help="the models' precision (default float32)")
    _common(rt)
    rt.set_defaults(_bench_run=_run_runtime)

    pr = benches.add_parser("precision", help="bfloat16 against float32: perplexity and top-1 agreement on a "
                            "shipped text, decode step time")
    pr.add_argument("--model", default="qwen2.5-coder-1.5b", help="model name or HF dir (default qwen2.5-coder-1.5b)")
    pr.add_argument("--dtypes", nargs="+", choices=TARGET_DTYPES[1:], default=["float32", "bfloat16"])
    pr.add_argument("--decode-steps", type=int, default=16, help="timed one-token decode steps (median; default 16)")
    _common(pr)
    pr.set_defaults(_bench_run=_run_precision)

    sp = benches.add_parser("spec", help="speculative decoding vs plain decoding and transformers, per category")
    sp.add_argument("--model", default=None, help="target (default qwen2.5-coder-1.5b)")
    sp.add_argument("--draft", default=None, help="draft model, or 'none' for n-gram only (default qwen2.5-coder-0.5b)")
    sp.add_argument("--drafts", nargs="+", choices=["model", "ngram", "suffix"], default=None,
                    help="draft kinds to measure (default: model ngram; suffix: the suffix-tree drafter)")
    sp.add_argument("--tree-nodes", nargs="+", type=int, default=None,
                    help="suffix and model drafts: tree limits to measure, 0 = chains only (default 16, the "
                         "engine's default)")
    sp.add_argument("--categories", nargs="+", default=None, help="prompt categories (default: all five)")
    sp.add_argument("--per-category", type=int, default=None, help="prompts per category (default 2)")
    sp.add_argument("--ks", nargs="+", type=parse_k, default=None, help="k values, ints or 'auto' (default 1 2 3 4 auto)")
    sp.add_argument("--temperatures", nargs="+", type=float, default=None, help="default 0 0.7")
    sp.add_argument("--batches", nargs="+", type=int, default=None, help="concurrent requests (default 1 8)")
    sp.add_argument("--max-tokens", type=int, default=None, help="output tokens per prompt (default 64)")
    sp.add_argument("--repeats", type=_at_least_one, default=None,
                    help="batches above 1: runs of every config, in rotating order; its figures sum them (default 1)")
    sp.add_argument("--seed", type=int, default=None)
    sp.add_argument("--dtype", choices=TARGET_DTYPES, default=None,
                    help="target model precision (default auto: bfloat16 on CUDA and on CPUs with avx512_bf16 or "
                         "AMX, float32 elsewhere)")
    sp.add_argument("--draft-dtype", choices=DRAFT_DTYPES, default=None,
                    help=f"draft model precision (default auto: {DRAFT_AUTO})")
    sp.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    sp.add_argument("--tracing-overhead", action="store_true",
                    help="also run every config traced (every span sampled and exported to a file) and print "
                         "tokens/s traced vs untraced")
    sp.add_argument("--llamacpp", action="store_true",
                    help="also native llama.cpp on the same GGUF files, greedy, batch 1: plain and with the draft "
                         "model (llama-server; build it once with scripts/build-llamacpp.sh)")
    sp.add_argument("--llamacpp-bin", default=None,
                    help="folder of the native llama.cpp binaries (default: scripts/build-llamacpp.sh's)")
    sp.add_argument("--llamacpp-python", action="store_true",
                    help="drive llama-cpp-python's Python loop instead (pip install -e '.[llamacpp]'; not how "
                         "llama.cpp's users run it, labeled so)")
    sp.add_argument("--llamacpp-only", action="store_true", help="llama.cpp alone: neither our engine nor transformers")
    sp.add_argument("--llamacpp-draft-tokens", type=int, default=None,
                    help="tokens llama.cpp's draft model proposes per round (default 4)")
    sp.add_argument("--plot", type=Path, default=None, help="write a PNG plot here")
    sp.add_argument("--quick", action="store_true",
                    help="tiny run on smollm2-135m with n-gram drafts (~1 minute); explicit flags still apply")
    _common(sp)
    sp.set_defaults(_bench_run=_run_spec)

    sv = benches.add_parser("serve", help="the Serve cluster through gRPC under load: TTFT, TPOT, ITL, goodput, "
                                          "overhead vs in process; starts Ray: run it under scripts/in-netns.sh")
    sv.add_argument("--model", default=None, help="target (default smollm2-135m; the product pair is "
                                                  "qwen2.5-coder-1.5b + qwen2.5-coder-0.5b, slow on CPU)")
    sv.add_argument("--draft", default=None, help="draft model name/dir, or 'ngram' (default ngram)")
    sv.add_argument("--concurrency", nargs="+", type=int, default=None, help="closed-loop clients (default 1 4 16)")
    sv.add_argument("--requests", type=int, default=None,
                    help="requests per concurrency level and mode (default max(8, 2 x concurrency))")
    sv.add_argument("--max-tokens", type=int, default=None, help="output tokens per request (default 64)")
    sv.add_argument("--k", type=parse_k, default=None, help="draft tokens per round with speculation on (default auto)")
    sv.add_argument("--categories", nargs="+", default=None, help="prompt categories (default: all five)")
    sv.add_argument("--per-category", type=int, default=None, help="prompts per category (default 2)")
    sv.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput SLO on TTFT (default 2000)")
    sv.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput SLO on TPOT (default 200)")
    sv.add_argument("--no-inprocess", action="store_true", help="skip the overhead comparison with the engine in process")
    sv.add_argument("--server", default=None, metavar="HOST:PORT",
                    help="measure a running cluster's gRPC endpoint (e.g. `specserve up`) instead of deploying one; "
                         "--model names its model (for the prompts' tokenizer)")
    sv.add_argument("--round-transport", choices=["channel", "ray"], default=None,
                    help="how the deployed cluster's rounds reach the workers (ClusterConfig.round_transport; "
                         "default channel)")
    sv.add_argument("--no-windows", action="store_true",
                    help="reservation_windows off (the ledger call before each verify, as before; for comparison)")
    sv.add_argument("--cpu-binding", choices=("auto", "on", "off"), default="auto",
                    help="ClusterConfig.cpu_binding of the local cluster (and the in-process engine's CPU): auto "
                         "(default) binds where 2 CPUs are left for the rest, on wherever one is, off never")
    sv.add_argument("--grpc-port", type=int, default=None, help="default 9100")
    sv.add_argument("--http-port", type=int, default=None, help="default 8100")
    add_client_flags(sv)
    _common(sv)
    sv.set_defaults(_bench_run=_run_serve)

    kv = benches.add_parser("kv", help="the KV-block manager's benchmark (cluster/bench/kv.py); its actor part "
                                       "starts Ray: run it under scripts/in-netns.sh")
    kv.add_argument("--no-actor", action="store_true", help="ledger only, no Ray actor")
    kv.add_argument("--json-out", type=Path, default=None)
    kv.set_defaults(_bench_run=_run_kv)
    return p


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--json-out", type=Path, default=None, help="write the full results as JSON here")


def run(args: argparse.Namespace) -> int:
    return int(args._bench_run(args) or 0)


def write_json(result: dict[str, Any], path: Path | None) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"JSON written to {path}", file=sys.stderr)


def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


# ---------------------------------------------------------------------- runtime
def _run_runtime(args: argparse.Namespace) -> int:
    from cluster.bench.runtime import RuntimeSettings, default_models, run_runtime_bench

    settings = RuntimeSettings(models=args.models or default_models(), contexts=args.contexts, max_k=args.max_k,
                               repeats=args.repeats, warmup=args.warmup, threads=args.threads,
                               compare_hf=not args.no_hf, dtype=args.dtype)
    result = run_runtime_bench(settings)
    write_json(result, args.json_out)
    print(format_runtime(result))
    return 0


def format_runtime(result: dict[str, Any]) -> str:
    max_k = result["settings"]["max_k"]
    headers = ["model", "context", "decode ms", "hf ms", "ours/hf"] + [f"x{n}" for n in range(2, max_k + 1)]
    rows = []
    for m in result["models"]:
        for c in m["contexts"]:
            rows.append([m["model"], c["context"], c["decode_ms"], c.get("hf_decode_ms"), c.get("ours_vs_hf")]
                        + [s["ratio"] for s in c["score"][1:]])
    env = result["environment"]
    return (f"bench runtime: one-token decode step and the cost of scoring n tokens (xN = t(N)/t(1)), "
            f"median of {result['settings']['repeats']}; torch threads {env['torch_threads']}, "
            f"load average {env['loadavg_at_start'][0]:.1f} -> {env['loadavg_at_end'][0]:.1f}\n"
            + table(headers, rows))


def _run_precision(args: argparse.Namespace) -> int:
    from cluster.bench.precision import format_precision, run_precision_bench

    result = run_precision_bench(args.model, args.dtypes, args.decode_steps, args.threads)
    write_json(result, args.json_out)
    print(format_precision(result))
    return 0


# ---------------------------------------------------------------------- spec
def _run_spec(args: argparse.Namespace) -> int:
    from cluster.bench.llamacpp import LlamaCppMissingError
    from cluster.bench.spec import QUICK, SpecSettings, run_spec_bench

    base: dict[str, Any] = dict(QUICK) if args.quick else {}
    flags = {"model": args.model, "draft": args.draft, "drafts": args.drafts, "categories": args.categories,
             "per_category": args.per_category, "ks": args.ks, "temperatures": args.temperatures,
             "batches": args.batches, "max_tokens": args.max_tokens, "seed": args.seed,
             "draft_dtype": args.draft_dtype, "dtype": args.dtype, "llamacpp_draft_tokens": args.llamacpp_draft_tokens,
             "llamacpp_bin": args.llamacpp_bin,
             "repeats": args.repeats, "tree_nodes": args.tree_nodes}
    base.update({key: value for key, value in flags.items() if value is not None})
    if args.model and args.model != "qwen2.5-coder-1.5b" and args.draft is None and not args.quick:
        base.setdefault("draft", "none")
        base.setdefault("drafts", ["ngram"])
    settings = SpecSettings(**base, threads=args.threads, hf=not args.no_hf, tracing_overhead=args.tracing_overhead,
                            llamacpp=args.llamacpp or args.llamacpp_only, llamacpp_only=args.llamacpp_only,
                            llamacpp_python=args.llamacpp_python)
    try:
        result = run_spec_bench(settings)
    except LlamaCppMissingError as exc:
        print(f"specserve bench spec: {exc}", file=sys.stderr)
        return 2
    write_json(result, args.json_out)
    if args.plot is not None:
        plot_spec(result, args.plot)
    print(format_spec(result))
    return 0


def format_spec(result: dict[str, Any]) -> str:
    s = result["settings"]
    out = [f"bench spec: {s['model']} (draft {s['draft']}), {len(result['prompts'])} prompts, "
           f"max {s['max_tokens']} tokens; tok/s = output tokens / wall seconds (prefill included)"]
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
                     _pct(frac.get("draft")), _pct(frac.get("verify")),
                     _pct(sum(frac.get(k, 0.0) for k in ("reconcile", "plan_other", "outside"))),
                     r.get("same_output_as_plain")])
    out.append(table(headers, rows))
    traced = [r for r in result["results"] if r.get("traced")]
    if traced:
        out.append("\ntracing on (every span sampled, exported to a JSON-lines file) vs off, same config, same run:")
        out.append(table(["T", "batch", "config", "tok/s traced", "traced / untraced"],
                         [[r["temperature"], r["batch"], r["label"], r["tokens_per_second"], r["speedup_vs_untraced"]]
                          for r in traced]))
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


def _pct(value: float | None) -> str | None:
    return None if value is None else f"{100 * value:.0f}"


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


# ---------------------------------------------------------------------- serve
def _run_serve(args: argparse.Namespace) -> int:
    from cluster.bench.serve import ServeBenchSettings, run_serve_bench

    apply_client_flags(args)  # --server's credentials, for every client the bench opens
    flags = {"model": args.model, "draft": args.draft, "concurrency": args.concurrency, "requests": args.requests,
             "max_tokens": args.max_tokens, "categories": args.categories, "per_category": args.per_category,
             "slo_ttft_s": None if args.slo_ttft_ms is None else args.slo_ttft_ms / 1000,
             "slo_tpot_s": None if args.slo_tpot_ms is None else args.slo_tpot_ms / 1000,
             "grpc_port": args.grpc_port, "http_port": args.http_port, "server": args.server,
             "round_transport": args.round_transport}
    settings = ServeBenchSettings(**{key: value for key, value in flags.items() if value is not None}, k=args.k,
                                  threads=args.threads, inprocess=not args.no_inprocess,
                                  reservation_windows=not args.no_windows, cpu_binding=args.cpu_binding)
    result = run_serve_bench(settings)
    write_json(result, args.json_out)
    print(format_serve(result))
    return 0


def format_serve(result: dict[str, Any]) -> str:
    s = result["settings"]
    ms = 1000.0

    def dist(row: dict[str, Any], key: str, stat: str) -> float | None:
        values = row[key]
        return None if values is None else values[stat] * ms

    out = [f"bench serve: {s['model']} (draft {s['draft']}) through gRPC, greedy, max {s['max_tokens']} tokens; "
           f"latencies in ms, ITL per token (chunk = m tokens at once); SLO TTFT <= {s['slo_ttft_s'] * ms:.0f} ms "
           f"and TPOT <= {s['slo_tpot_s'] * ms:.0f} ms"]
    headers = ["conc", "mode", "reqs", "tok/s", "TTFT p50", "TTFT p99", "TPOT mean", "TPOT p99", "ITL p50",
               "ITL p90", "ITL p99", "goodput/s", "SLO %", "accept", "tok/round", "=plain"]
    rows = []
    for r in result["levels"]:
        acc = r.get("acceptance") or {}
        rows.append([r["concurrency"], r["mode"], r["requests"], r["output_tokens_per_second"],
                     dist(r, "ttft_seconds", "p50"), dist(r, "ttft_seconds", "p99"), dist(r, "tpot_seconds", "mean"),
                     dist(r, "tpot_seconds", "p99"), dist(r, "itl_seconds", "p50"), dist(r, "itl_seconds", "p90"),
                     dist(r, "itl_seconds", "p99"), r["goodput_requests_per_second"], _pct(r["slo_attainment"]),
                     acc.get("acceptance_rate"), acc.get("mean_tokens_per_round"), r.get("same_output_as_plain")])
    out.append(table(headers, rows))
    if result["inprocess_overhead"]:
        out.append("\ncluster overhead vs the in-process engine, concurrency 1, same requests (goal <= 10%):")
        out.append(table(
            ["mode", "reqs", "e2e ms", "in-proc ms", "e2e +%", "TTFT +%", "TPOT +%", "<=10%", "=in-proc"],
            [[o["mode"], o["requests"], o["cluster"]["latency_seconds"] * ms, o["inprocess"]["latency_seconds"] * ms,
              _pct(o["latency_overhead"]), _pct(o["ttft_overhead"]), _pct(o["tpot_overhead"]), o["meets_goal_10pct"],
              o["same_output"]] for o in result["inprocess_overhead"]]))
    split = result.get("round_split_concurrency_1") or {}
    if all(split.get(side) for side in ("cluster", "inprocess")):
        out.append("\nper engine round at concurrency 1 (ms; verify as timed in the verifier, verify_hop = the rest of "
                   "its call, draft = the propose call, kv = reserve + commit calls, other = planning, acceptance):")
        parts = ["round", "verify", "verify_hop", "draft", "kv", "other"]
        out.append(table(["side", "rounds", *parts], [[side, split[side]["rounds"], *[split[side][f"{p}_ms"] for p in parts]]
                                                      for side in ("cluster", "inprocess")]))
        hops = [p for p in ("verifier_transport", "drafter_transport", "kv_transport", "kv_ahead_wait",
                            "kv_ahead_transport", "hops") if f"{p}_ms" in split["cluster"]]
        if hops:  # round channels: each one's own time (round trip - the worker's handler), and every hop together
            out.append(f"cluster round transport: {split['cluster']['transport']}; ms per round: "
                       + ", ".join(f"{p} {split['cluster'][f'{p}_ms']:.3f}" for p in hops))
    env = result["environment"]
    out.append(f"\nCPU: {env['cpu']} ({env['cpu_kernel']} kernels); CPU binding: {env.get('cpu_plan') or 'none'}")
    out.append(f"load average {env['loadavg_at_start'][0]:.1f} -> {env['loadavg_at_end'][0]:.1f}; "
               f"KV blocks leaked: {result['cluster']['kv_leaked_blocks']}; "
               f"fallback events: {len(result['cluster']['fallback_events'])}")
    return "\n".join(out)


# ---------------------------------------------------------------------- kv
def _run_kv(args: argparse.Namespace) -> int:
    from cluster.bench.kv import run_bench

    result = run_bench(with_actor=not args.no_actor)  # prints its own table
    write_json(result, args.json_out)
    return 0
