"""`specserve check exact`: an end-to-end statistical self-test of the exactness promise (cluster/check/).

Exit status: 0 every position passes; 1 a distribution differs; 3 not enough samples to reach the stated
power (no evidence against exactness, but the test could have missed a deviation); 2 usage/runtime error.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from cluster.check.settings import DEFAULT_PROMPTS, CheckSettings
from cluster.cli.client_flags import add_client_flags, apply_client_flags
from cluster.cli.constraint_flags import add_constraint_flags, constraint_from_args, logit_bias_from_args
from cluster.cli.generate import parse_k
from cluster.serving.config import ConfigError
from specserve_types.api import DRAFT_DTYPES, EXACT_RULES, TARGET_DTYPES, SpecServeError

CHECK_MODEL = "smollm2-135m"


def parse_positions(value: str) -> tuple[int, ...]:
    try:
        positions = tuple(sorted({int(part) for part in value.split(",") if part.strip()}))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--positions must be comma-separated integers, got {value!r}") from exc
    if not positions or positions[0] < 1:
        raise argparse.ArgumentTypeError(f"--positions must be integers >= 1, got {value!r}")
    return positions


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("check", help="self-tests of a deployment: exact (the sampled distribution)")
    checks = p.add_subparsers(dest="check", required=True)
    defaults = CheckSettings()
    ex = checks.add_parser(
        "exact", help="statistical test that speculative sampling emits the target model's distribution",
        description="Draw --n samples of the first output tokens per prompt through the real path (in process, or "
                    "--server), speculation on, and test each position against the target model's own distribution "
                    "(Pearson's chi-square, cells expecting < 5 pooled). Exit 0: every position passes (p-value >= "
                    "alpha and power >= --min-power against total variation --tv); 1: a distribution differs; 3: not "
                    "enough samples; 2: error.")
    ex.add_argument("--model", default=CHECK_MODEL, help=f"target model name or HF dir (default {CHECK_MODEL}); with "
                    "--server, the served target (its reference distribution is computed here)")
    ex.add_argument("--draft", default="ngram", help="draft model name/dir, 'ngram' or 'suffix' (token trees; "
                    "default ngram); with --server "
                    "a model name means the server's draft model")
    ex.add_argument("--server", default=None, help="HOST:PORT of a running cluster's gRPC endpoint (default: in process)")
    ex.add_argument("--prompt", action="append", default=None,
                    help=f"prompt (repeatable; default: {len(DEFAULT_PROMPTS)} built-in short prompts whose suffix "
                         "repeats, so n-gram drafting proposes from the first token)")
    ex.add_argument("--chat", action="store_true", help="apply the model's chat template to each prompt")
    ex.add_argument("--temperature", type=float, default=defaults.temperature,
                    help=f"(default {defaults.temperature:g}; 0: greedy, each position must equal the argmax)")
    ex.add_argument("--top-k", type=int, default=defaults.top_k, help="(default 0: off)")
    ex.add_argument("--top-p", type=float, default=defaults.top_p, help="(default 1: off)")
    ex.add_argument("--k", type=parse_k, default=defaults.k, help=f"draft tokens per round: N or 'auto' "
                    f"(default {defaults.k})")
    ex.add_argument("--n", type=int, default=defaults.n, help=f"samples per prompt (default {defaults.n})")
    ex.add_argument("--positions", type=parse_positions, default=defaults.positions,
                    help="output positions to test, 1-based, comma-separated (default 1,2,3); position t is "
                         "conditioned on the most common (t-1)-token prefix")
    ex.add_argument("--alpha", type=float, default=defaults.alpha, help=f"significance level of each test "
                    f"(default {defaults.alpha:g})")
    ex.add_argument("--tv", type=float, default=defaults.tv, help="total variation the test must be able to detect "
                    f"(default {defaults.tv:g})")
    ex.add_argument("--min-power", type=float, default=defaults.min_power, help="... with at least this power "
                    f"(default {defaults.min_power:g}); below it the outcome is 'not enough samples'")
    ex.add_argument("--seed", type=int, default=defaults.seed, help="sample i of prompt j gets seed + j*n + i "
                    f"(default {defaults.seed})")
    ex.add_argument("--batch", type=int, default=16, help="requests in flight (in process: the engine's batch; "
                    "--server: completions per call x concurrent calls) (default 16)")
    ex.add_argument("--per-call", type=int, default=16, help="completions that share one prompt prefill: in process a "
                    "prompt group, with --server one gRPC call (n of the request) (default 16)")
    ex.add_argument("--dtype", choices=TARGET_DTYPES, default=None, help="the target's precision: in process the "
                    "engine's; with --server the reference's (it must match the server's; default auto)")
    ex.add_argument("--draft-dtype", choices=DRAFT_DTYPES, default=None, help="in process: the draft model's "
                    "precision (default auto)")
    ex.add_argument("--tree-nodes", type=int, default=None, help="in process, --draft suffix: most nodes of a token "
                    "tree (0: chains; default the engine's, 16)")
    ex.add_argument("--model-tree-nodes", type=int, default=None, help="in process, a draft model: most nodes of its "
                    "token trees (default the engine's, 0: chains)")
    ex.add_argument("--exact-rule", choices=EXACT_RULES, default=None, help="in process: the exact contract's "
                    "rule for chains (block verification or token by token; default the engine's, block)")
    ex.add_argument("--device", default=None, help="in process: torch device of the workers (default cpu)")
    ex.add_argument("--threads", type=int, default=0, help="in process: torch threads (default 0: torch's default; "
                    "1 is often fastest on a busy machine, since the check's forwards are small)")
    ex.add_argument("--inject-bias", action="store_true",
                    help="FOR TESTING THE CHECK ITSELF (negative control, in process only): after a rejection the "
                         "verifier resamples from p instead of the residual, a deliberate bug; the check must fail")
    ex.add_argument("--json-out", type=Path, default=None, help="write the full report as JSON here")
    ex.add_argument("--timeout", type=float, default=None, help="--server: seconds per call")
    add_constraint_flags(ex)
    add_client_flags(ex)
    ex.add_argument("-v", "--verbose", action="store_true")
    return p


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return _run_exact(args)
    except (SpecServeError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _run_exact(args: argparse.Namespace) -> int:
    from cluster.check.exact import check_in_process, check_via_server, stderr_progress

    if args.batch < 1 or args.per_call < 1 or args.threads < 0:
        raise SpecServeError("batch, per-call: must be >= 1; threads: >= 0")
    if args.draft in ("none", ""):
        raise SpecServeError("draft: the check needs speculation on: 'ngram', 'suffix' or a draft model")
    settings = CheckSettings(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, k=args.k,
                             draft=args.draft if args.draft in ("ngram", "suffix") else "model", n=args.n,
                             positions=args.positions,
                             alpha=args.alpha, tv=args.tv, min_power=args.min_power, seed=args.seed,
                             constraint=constraint_from_args(args), logit_bias=logit_bias_from_args(args))
    prompts = args.prompt or list(DEFAULT_PROMPTS)
    progress = stderr_progress("check exact")
    rule = "" if args.server else f", exact rule {args.exact_rule or 'the default'}"
    print(f"check exact: {args.model} (draft {args.draft}{rule}) "
          f"{'via ' + args.server if args.server else 'in process'}, "
          f"{len(prompts)} prompt(s) x {args.n} samples ...", file=sys.stderr)
    if args.server:
        apply_client_flags(args)
        if args.exact_rule:
            raise SpecServeError("--exact-rule is the engine's setting: a server runs its config's exact_rule "
                                 "(drop --server to check a rule in process)")
        if args.inject_bias:
            raise SpecServeError("--inject-bias works in process only (it is a test of the check itself, not a "
                                 "server option); drop --server")
        per_call = min(args.per_call, args.batch)
        report, tokenizer = check_via_server(args.server, args.model, args.draft, prompts, settings, chat=args.chat,
                                             per_call=per_call, concurrency=max(1, args.batch // per_call),
                                             timeout_s=args.timeout, progress=progress, dtype=args.dtype or "auto")
    else:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        report, tokenizer = check_in_process(args.model, args.draft, prompts, settings, chat=args.chat,
                                             window=args.batch, per_group=args.per_call,
                                             draft_dtype=args.draft_dtype, device=args.device,
                                             tree_nodes=args.tree_nodes, model_tree_nodes=args.model_tree_nodes,
                                             dtype=args.dtype, exact_rule=args.exact_rule,
                                             biased=args.inject_bias, progress=progress)

    def decode(ids: list[int] | tuple[int, ...]) -> str:
        return tokenizer.decode(list(ids)) if ids else ""

    print(report.render(decode))
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(report.to_json(decode), indent=1))
        print(f"report: {args.json_out}", file=sys.stderr)
    return report.exit_code
