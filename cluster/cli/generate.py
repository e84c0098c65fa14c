"""`specserve generate "PROMPT"`: run one prompt in process (or through a cluster with --server).

Prints one JSON object with --json:
  {"model", "contract", "prompt_token_ids", "samples": [{"token_ids", "text", "finish_reason", "proposed",
   "accepted", "forced"[, "logprobs"][, "prompt_logprobs"]}], "stats"}
otherwise streams the text to the terminal (samples one after another for --n > 1), then with --logprobs / --echo a
table of each token's log-probability and alternatives (cluster/cli/logprob_flags.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import uuid
from typing import Any

from cluster.cli.client_flags import add_client_flags
from cluster.cli.constraint_flags import (
    add_constraint_flags,
    check_constraint_flags,
    constraint_from_args,
    logit_bias_from_args,
)
from cluster.cli.generate_remote import DEFAULT_MODEL, generate_via_server
from cluster.cli.logprob_flags import add_logprob_flags, logprob_fields, print_table, prompt_entries
from cluster.cli.tracing_flags import add_tracing_flags, tracing_fields
from cluster.engine.request_span import RequestSpan, summed_speculation
from cluster.engine.round_spans import RoundSpans
from cluster.serving.config import NGRAM_DRAFT, ClusterConfig, ConfigError, make_config
from cluster.serving.logprob_format import chat_logprobs, ids_of
from cluster.serving.token_pieces import TokenPieces
from specserve_types.api import (
    CONTRACTS,
    DRAFT_AUTO,
    DRAFT_DTYPES,
    TARGET_AUTO,
    TARGET_DTYPES,
    GenerationRequest,
    RowLogprobs,
    SamplingParams,
    SpecParams,
    SpecServeError,
)
from specserve_types.tracing import configure_tracing, shutdown_tracing

DEFAULT_DRAFT = "qwen2.5-coder-0.5b"


def parse_k(value: str) -> int | None:
    if value == "auto":
        return None
    try:
        return int(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--k must be an integer or 'auto', got {value!r}") from exc


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help="generate text for one prompt (in process, or --server HOST:PORT)")
    p.add_argument("prompt")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"target model name or HF dir (default {DEFAULT_MODEL})")
    p.add_argument("--draft", default=None,
                   help=f"draft model name/dir, 'ngram', 'suffix' (token trees from a suffix trie) or 'none' "
                        f"(default: {DEFAULT_DRAFT} for the default model, ngram otherwise)")
    p.add_argument("--dtype", choices=TARGET_DTYPES, default=None,
                   help=f"target model precision (auto: {TARGET_AUTO}); greedy output equals plain greedy decoding "
                        "of the same dtype")
    p.add_argument("--draft-dtype", choices=DRAFT_DTYPES, default=None,
                   help=f"draft model precision (auto: {DRAFT_AUTO}); changes acceptance, never the output")
    p.add_argument("--no-warm-up", action="store_true",
                   help="skip measuring verify/draft costs before generating (auto then learns them in the first "
                        "rounds)")
    p.add_argument("--k", type=parse_k, default=None, help="draft tokens per round: N or 'auto' (default auto)")
    p.add_argument("--contract", choices=CONTRACTS, default=None,
                   help="acceptance contract (default: greedy at temperature 0, exact otherwise)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n", type=int, default=1, help="independent samples of the prompt (seeds seed, seed+1, ...), "
                   "batched; the prompt is prefilled once and its KV shared")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="tokens to generate at most (default: until the model ends the answer, at most what the "
                        "context leaves beside the prompt); 0 only with --echo (the prompt scored)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    p.add_argument("--json", action="store_true", help="print one JSON object with statistics")
    p.add_argument("--server", default=None, help="HOST:PORT of a running cluster's gRPC endpoint")
    p.add_argument("--max-context", type=int, default=None,
                   help=f"prompt + max_tokens limit (default {ClusterConfig.model_fields['max_context'].default}, "
                        "capped by the model)")
    p.add_argument("-v", "--verbose", action="store_true")
    add_constraint_flags(p)
    add_logprob_flags(p)
    add_tracing_flags(p)
    add_client_flags(p)
    return p


def build_requests(args: argparse.Namespace, prompt_ids: list[int], draft_kind: str) -> list[GenerationRequest]:
    contract = args.contract or ("greedy" if args.temperature == 0 else "exact")
    if args.n < 1:
        raise SpecServeError("n: must be >= 1")
    constraint, logit_bias = constraint_from_args(args), logit_bias_from_args(args)
    base = uuid.uuid4().hex[:8]
    requests = []
    for i in range(args.n):
        seed = None if args.seed is None else args.seed + i
        sampling = SamplingParams(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
            repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty, seed=seed, max_tokens=args.max_tokens, stop=tuple(args.stop),
            logit_bias=logit_bias, **logprob_fields(args),
        )
        requests.append(GenerationRequest(f"{base}-{i}", tuple(prompt_ids), sampling,
                                          SpecParams(contract=contract, k=args.k, draft=draft_kind), constraint))
    return requests


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        check_constraint_flags(args)  # before a model loads or a server is called
        if args.server:
            return generate_via_server(args)
        return _run_in_process(args)
    except (SpecServeError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


GENERATE_MAX_BATCH = 256  # completions per round: the verify's logits rows (x k+1) stay a few hundred MB


def generate_kv_blocks(batch: int, max_tokens: int | None, max_context: int, k_max: int,
                       block_size: int) -> int:
    """Blocks per KV pool for `generate`: one full context for the prompt (shared by the completions of a
    prompt group, or one request's own) and, per completion running at once, its own tokens: max_tokens (unset:
    up to the context) + the round's k_max + 1 slots, plus its copy of the prompt's partial last block and a block
    boundary."""
    tokens = max_context if max_tokens is None else max_tokens
    own = -(-(tokens + k_max + 1) // block_size) + 2
    return -(-max_context // block_size) + batch * own + 16


def in_process_config(args: argparse.Namespace, draft: str) -> ClusterConfig:
    """The engine settings of `generate` in process: a batch of --n (at most GENERATE_MAX_BATCH), KV pools
    for the tokens it holds (generate_kv_blocks); ClusterConfig's defaults where a flag is not given."""
    given = {key: value for key, value in (("max_context", args.max_context), ("draft_dtype", args.draft_dtype),
                                           ("dtype", args.dtype)) if value is not None} | tracing_fields(args)
    batch = max(1, min(args.n, GENERATE_MAX_BATCH))
    config = make_config(
        model=args.model, draft=NGRAM_DRAFT if draft == "none" else draft,  # 'none' (no drafting): in process only
        max_batch=batch, queue_capacity=max(args.n, ClusterConfig.model_fields["queue_capacity"].default),
        kv_blocks=None, warm_up=args.k is None and not args.no_warm_up, **given,
    )
    slots = max(config.k_max, config.tree_nodes) if draft == "suffix" else config.k_max  # a tree: a slot per node
    blocks = generate_kv_blocks(batch, args.max_tokens, config.max_context, slots, config.block_size)
    return config.with_overrides(kv_blocks=min(blocks, config.kv_pool_blocks))


def _run_in_process(args: argparse.Namespace) -> int:
    from cluster.engine.factory import NON_MODEL_DRAFTS, build_local_engine, tokenize_prompt

    draft = args.draft or (DEFAULT_DRAFT if args.model == DEFAULT_MODEL else "ngram")
    draft_kind = draft if draft in NON_MODEL_DRAFTS else "model"
    settings = in_process_config(args, draft)
    print(f"loading {args.model} (draft: {draft}) ...", file=sys.stderr)
    traced = configure_tracing(settings.tracing_settings(), "specserve-generate") is not None
    engine = build_local_engine(args.model, draft, settings.engine_config(), settings.local_runtime(),
                                observer=RoundSpans() if traced else None)
    prompt_ids = tokenize_prompt(engine.tokenizer, args.prompt, args.chat)
    requests = build_requests(args, prompt_ids, draft_kind)
    span = RequestSpan.start("chat" if args.chat else "text_completion", args.model, requests[0].sampling,
                             requests[0].request_id.rsplit("-", 1)[0], parent=os.environ, n=args.n)
    engine.submit_group([dataclasses.replace(request, trace_context=span.carrier()) for request in requests])
    samples: dict[str, dict[str, Any]] = {r.request_id: {"token_ids": [], "text": "", "finish_reason": None,
                                                         "proposed": 0, "accepted": 0, "forced": 0}
                                         for r in requests}
    per_request_stats: dict[str, Any] = {}
    streaming = not args.json and args.n == 1
    pieces = TokenPieces(engine.tokenizer)
    logprobs: dict[str, list[RowLogprobs]] = {r.request_id: [] for r in requests}
    while engine.has_unfinished():
        for chunk in engine.step():
            sample = samples[chunk.request_id]
            if chunk.prompt_logprobs is not None:
                rows = chunk.prompt_logprobs
                sample["prompt_logprobs"] = prompt_entries(prompt_ids, rows, pieces.pieces([*prompt_ids,
                                                                                            *ids_of(rows)]))
            if chunk.logprobs is not None:
                logprobs[chunk.request_id].append(chunk.logprobs)
            sample["token_ids"].extend(chunk.token_ids)
            sample["text"] += chunk.text_delta
            sample["proposed"] += chunk.proposed
            sample["accepted"] += chunk.accepted
            sample["forced"] += chunk.forced
            if streaming and chunk.text_delta:
                sys.stdout.write(chunk.text_delta)
                sys.stdout.flush()
            if chunk.finished:
                sample["finish_reason"] = chunk.finish_reason
                per_request_stats[chunk.request_id] = chunk.stats
    for r in requests:
        if logprobs[r.request_id]:
            sample, rows = samples[r.request_id], RowLogprobs.concat(logprobs[r.request_id])
            sample["logprobs"] = chat_logprobs(sample["token_ids"], rows, pieces.pieces([*sample["token_ids"],
                                                                                         *ids_of(rows)]))
        elif r.sampling.logprobs is not None:
            samples[r.request_id]["logprobs"] = []
    span.finish(args.model, [per_request_stats.get(r.request_id) for r in requests],
                [samples[r.request_id]["finish_reason"] for r in requests])
    shutdown_tracing()
    if args.json:
        stats = engine.stats()
        stats["requests"] = [per_request_stats.get(r.request_id) for r in requests]
        print(json.dumps({
            "model": args.model,
            "draft": draft,
            "contract": requests[0].spec.contract,
            "prompt_token_ids": prompt_ids,
            "samples": [samples[r.request_id] for r in requests],
            "metrics": {"speculative_decoding": summed_speculation(stats["requests"])},
            "stats": stats,
        }))
    elif streaming:
        sys.stdout.write("\n")
    else:
        for i, r in enumerate(requests):
            print(f"--- sample {i} ({samples[r.request_id]['finish_reason']})\n{samples[r.request_id]['text']}")
    if not args.json:
        for i, r in enumerate(requests):
            sample = samples[r.request_id]
            if "prompt_logprobs" in sample:
                print_table(f"sample {i}: the prompt's log-probabilities", sample["prompt_logprobs"], sys.stdout)
            if sample.get("logprobs"):
                print_table(f"sample {i}: log-probabilities", sample["logprobs"], sys.stdout)
    return 0
