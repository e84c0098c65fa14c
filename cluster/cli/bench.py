"""`specserve bench runtime | spec | serve | structured | perplexity | kv`: benchmark figures, printed as tables
and written as JSON.

    bench runtime   forward-pass step times and multi-token scoring ratios, ours vs transformers
                    (cluster/bench/runtime.py)
    bench spec      speculative decoding end to end vs plain decoding and transformers' assisted
                    generation, per prompt category (cluster/bench/spec.py); optional PNG plot
    bench serve     the Ray Serve cluster through gRPC at several concurrencies, speculation on and off:
                    TTFT, TPOT, per-token ITL, tokens/s, goodput, overhead vs in process
                    (cluster/bench/serve.py; starts Ray: run it under scripts/in-netns.sh)
    bench structured  constrained decoding (JSON schemas) with and without speculation, beside native
                    llama-server's json_schema (cluster/bench/structured.py)
    bench kv        the KV-block manager: ledger rounds in process, and the actor's round trip through
                    RemoteKV (cluster/bench/kv.py; starts Ray: run it under scripts/in-netns.sh)
    bench perplexity  a shipped text's perplexity in process and through a running server (--server), per dtype,
                    beside native llama.cpp's llama-perplexity on the same GGUF (cluster/bench/perplexity.py)

Figures only, never timed assertions. Progress lines go to stderr, tables to stdout (bench_tables.py; the spec
and serve reports: bench_spec_report.py, bench_serve_report.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from cluster.cli.bench_serve_report import format_serve
from cluster.cli.bench_spec_report import format_spec, plot_spec
from cluster.cli.bench_tables import table, write_json
from cluster.cli.client_flags import add_client_flags, apply_client_flags
from cluster.cli.generate import parse_k
from specserve_types.api import DRAFT_AUTO, DRAFT_DTYPES, EXACT_RULES, TARGET_AUTO, TARGET_DTYPES


def _at_least_one(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="benchmarks: runtime | spec | serve | structured | perplexity | kv "
                                             "(figures and JSON)")
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
    sp.add_argument("--draft-stop-below", nargs="+", type=float, default=None,
                    help="model drafts at k auto: the chain stop thresholds to measure side by side (the engine's "
                         "draft_stop_below; default: the engine's default alone)")
    sp.add_argument("--draft-lookup", nargs="+", choices=["on", "off"], default=None,
                    help="model drafts at k auto: with and/or without the n-gram lookup rounds, side by side (the "
                         "engine's draft_lookup; default: the engine's default alone)")
    sp.add_argument("--exact-rule", nargs="+", choices=EXACT_RULES, default=None,
                    help="temperature > 0: the exact contract's rule for chains, side by side (block verification, "
                         "token by token; the engine's exact_rule; default: the engine's default alone)")
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
                    help=f"target model precision (default auto: {TARGET_AUTO})")
    sp.add_argument("--draft-dtype", choices=DRAFT_DTYPES, default=None,
                    help=f"draft model precision (default auto: {DRAFT_AUTO})")
    sp.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    sp.add_argument("--hf-dtype", choices=("bfloat16", "float32", "auto"), default="bfloat16",
                    help="transformers' weights (its own copy, loaded as a CPU user loads these models: bfloat16, "
                         "their published dtype; auto: the checkpoint config's)")
    sp.add_argument("--logprobs-overhead", type=int, default=None, metavar="N",
                    help="also run every config with logprobs N (each token's log-probability and N alternatives) "
                         "and print tokens/s with vs without")
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
                         "(default: the rest on CPUs of its own where 2 are left, else the compute threads pinned alone), on (the "
                         "rest off the compute CPUs wherever one is left), off (nothing pinned)")
    sv.add_argument("--grpc-port", type=int, default=None, help="default 9100")
    sv.add_argument("--http-port", type=int, default=None, help="default 8100")
    add_client_flags(sv)
    _common(sv)
    sv.set_defaults(_bench_run=_run_serve)

    st = benches.add_parser("structured", help="constrained decoding (JSON schemas): speculation vs plain, and "
                                               "native llama-server's json_schema (cluster/bench/structured.py)")
    st.add_argument("--model", default="qwen2.5-coder-1.5b", help="target (default qwen2.5-coder-1.5b)")
    st.add_argument("--draft", default="qwen2.5-coder-0.5b",
                    help="draft model, or 'none' for n-gram and suffix only (default qwen2.5-coder-0.5b)")
    st.add_argument("--drafts", nargs="+", choices=["model", "model-free", "ngram", "suffix"], default=None,
                    help="speculative configs beside plain (default: model, or ngram without a draft model); "
                         "model-free: the draft model drafting without the constraint")
    st.add_argument("--cases", nargs="+", default=None, help="schema cases (default: all five)")
    st.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 0.7], help="default 0 0.7")
    st.add_argument("--max-tokens", type=int, default=160, help="output tokens per case at most (default 160)")
    st.add_argument("--repeats", type=_at_least_one, default=1, help="runs of each case (default 1)")
    st.add_argument("--dtype", choices=TARGET_DTYPES, default="auto")
    st.add_argument("--draft-dtype", choices=DRAFT_DTYPES, default="auto")
    st.add_argument("--llamacpp", action="store_true",
                    help="native llama-server beside ours, plain and with the draft model (scripts/build-llamacpp.sh)")
    st.add_argument("--llamacpp-bin", default=None, help="llama.cpp's bin folder (default: the build script's)")
    st.add_argument("--llamacpp-draft-tokens", type=int, default=8, help="llama-server's --spec-draft-n-max (8)")
    st.add_argument("--seeded", action="store_true", help="sampled requests carry seeds (their k then reads nominal "
                                                          "costs only); default unseeded, as most clients send them")
    _common(st)
    st.set_defaults(_bench_run=_run_structured)

    pp = benches.add_parser("perplexity", help="a shipped text's perplexity, windowed as llama-perplexity: in "
                                               "process and through a server, beside llama.cpp's on the same GGUF")
    pp.add_argument("--model", default=None, help="model name or HF dir (default qwen2.5-coder-1.5b)")
    pp.add_argument("--dtype", nargs="+", choices=("bf16", "q4", "bfloat16", "float32"), default=None,
                    help="in-process precisions (default bf16 q4; q4: the GGUF's own codes)")
    pp.add_argument("--n-ctx", type=int, default=None, help="tokens per window, llama-perplexity's -c (default 512)")
    pp.add_argument("--text", type=Path, default=None,
                    help="the text (default cluster/bench/prompts/perplexity_text.txt)")
    pp.add_argument("--server", default=None, metavar="HOST:PORT",
                    help="also score through a running server's HTTP /v1/completions (echo, logprobs 0, max_tokens "
                         "0), e.g. `specserve up`'s 127.0.0.1:8000; its dtype is read from its /v1/stats")
    pp.add_argument("--llamacpp", action="store_true",
                    help="also native llama-perplexity on the model's GGUF (build it with scripts/build-llamacpp.sh)")
    pp.add_argument("--llamacpp-bin", type=Path, default=None, help="llama.cpp's bin folder (default: the build "
                                                                    "script's)")
    add_client_flags(pp)
    _common(pp)
    pp.set_defaults(_bench_run=_run_perplexity)

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
    headers = ["model", "context", "prefill ms", "decode ms", "hf ms", "ours/hf"] + [f"x{n}" for n in range(2, max_k + 1)]
    rows = []
    for m in result["models"]:
        for c in m["contexts"]:
            rows.append([m["model"], c["context"], c.get("prefill_ms"), c["decode_ms"], c.get("hf_decode_ms"),
                         c.get("ours_vs_hf")]
                        + [s["ratio"] for s in c["score"][1:]])
    env = result["environment"]
    return (f"bench runtime: the context's prefill, a one-token decode step and the cost of scoring n tokens "
            f"(xN = t(N)/t(1)), "
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
    from cluster.bench.spec import run_spec_bench
    from cluster.bench.spec_settings import QUICK, SpecSettings

    base: dict[str, Any] = dict(QUICK) if args.quick else {}
    flags = {"model": args.model, "draft": args.draft, "drafts": args.drafts, "categories": args.categories,
             "per_category": args.per_category, "ks": args.ks, "temperatures": args.temperatures,
             "batches": args.batches, "max_tokens": args.max_tokens, "seed": args.seed,
             "draft_dtype": args.draft_dtype, "dtype": args.dtype, "llamacpp_draft_tokens": args.llamacpp_draft_tokens,
             "llamacpp_bin": args.llamacpp_bin,
             "repeats": args.repeats, "tree_nodes": args.tree_nodes, "draft_stop_below": args.draft_stop_below,
             "draft_lookup": None if args.draft_lookup is None else [v == "on" for v in args.draft_lookup],
             "exact_rule": args.exact_rule}
    base.update({key: value for key, value in flags.items() if value is not None})
    if args.model and args.model != "qwen2.5-coder-1.5b" and args.draft is None and not args.quick:
        base.setdefault("draft", "none")
        base.setdefault("drafts", ["ngram"])
    settings = SpecSettings(**base, threads=args.threads, hf=not args.no_hf, hf_dtype=args.hf_dtype,
                            tracing_overhead=args.tracing_overhead,
                            logprobs_overhead=args.logprobs_overhead,
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


# ---------------------------------------------------------------------- structured
def _run_structured(args: argparse.Namespace) -> int:
    from cluster.bench.structured import StructuredSettings, run_structured_bench

    drafts = args.drafts or (["ngram"] if args.draft == "none" else ["model"])
    settings = StructuredSettings(
        model=args.model, draft=args.draft, drafts=tuple(drafts), temperatures=tuple(args.temperatures),
        cases=tuple(args.cases or ()), max_tokens=args.max_tokens, repeats=args.repeats, threads=args.threads,
        dtype=args.dtype, draft_dtype=args.draft_dtype, llamacpp=args.llamacpp, llamacpp_bin=args.llamacpp_bin,
        llamacpp_draft_tokens=args.llamacpp_draft_tokens, seeded=args.seeded)
    result = run_structured_bench(settings)
    write_json(result, args.json_out)
    print(format_structured(result))
    return 0


def format_structured(result: dict[str, Any]) -> str:
    headers = ["T", "config", "tok/s", "vs plain", "valid", "same", "accept", "forced share", "cut",
               "constraint/step"]
    rows = [[r["temperature"], r["config"], r["tokens_per_s"], r["vs_plain"], f"{r['valid']}/{r['runs']}",
             r.get("same_as_plain", ""), r.get("acceptance_rate", ""), r.get("forced_share_of_tokens", ""),
             r.get("cut", ""), r.get("constraint_cost_vs_plain_step", "")] for r in result["rows"]]
    env = result["environment"]
    return (f"bench structured: {result['settings']['model']} + {result['settings']['draft']} "
            f"({', '.join(f'{k} {v}' for k, v in result['dtypes'].items())}), cpu {env['cpu']}, kernel "
            f"{env['cpu_kernel']}, load {env['loadavg_at_start'][0]:.1f} -> {env['loadavg_at_end'][0]:.1f}\n"
            + table(headers, rows))


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


# ---------------------------------------------------------------------- perplexity
def _run_perplexity(args: argparse.Namespace) -> int:
    from cluster.bench.llamacpp import LlamaCppMissingError
    from cluster.bench.perplexity import (
        DTYPE_NAMES,
        PerplexitySettings,
        format_perplexity,
        run_perplexity_bench,
    )

    apply_client_flags(args)  # --server's credentials
    flags = {"model": args.model, "n_ctx": args.n_ctx, "text": args.text, "llamacpp_bin": args.llamacpp_bin,
             "dtypes": None if args.dtype is None else tuple(dict.fromkeys(DTYPE_NAMES[d] for d in args.dtype))}
    settings = PerplexitySettings(**{key: value for key, value in flags.items() if value is not None},
                                  server=args.server, llamacpp=args.llamacpp, threads=args.threads)
    try:
        result = run_perplexity_bench(settings)
    except LlamaCppMissingError as exc:
        print(f"specserve bench perplexity: {exc}", file=sys.stderr)
        return 2
    write_json(result, args.json_out)
    print(format_perplexity(result))
    return 0


# ---------------------------------------------------------------------- kv
def _run_kv(args: argparse.Namespace) -> int:
    from cluster.bench.kv import run_bench

    result = run_bench(with_actor=not args.no_actor)  # prints its own table
    write_json(result, args.json_out)
    return 0
