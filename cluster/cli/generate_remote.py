"""`specserve generate --server HOST:PORT`: the same flags and output as in process, through gRPC."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from cluster.cli.client_flags import apply_client_flags
from cluster.cli.constraint_flags import constraint_from_args, logit_bias_from_args
from cluster.client import SpecServeClient, collect
from cluster.engine.request_span import summed_speculation

DEFAULT_MODEL = "qwen2.5-coder-1.5b"
SAMPLE_KEYS = ("token_ids", "text", "finish_reason", "proposed", "accepted", "forced")  # --json's, as in process


def generate_via_server(args: argparse.Namespace) -> int:
    """`specserve generate --server HOST:PORT`: the same flags and output as in process."""
    draft = args.draft
    if draft is not None and draft not in ("ngram", "suffix", "none"):
        draft = "model"  # the server's draft model; which one is the server's configuration
    fields = dict(
        model="" if args.model == DEFAULT_MODEL else args.model, draft=draft or None, k=args.k,
        contract=args.contract, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, n=args.n, stop=args.stop,
        max_tokens=args.max_tokens, chat=args.chat or None,
        constraint=constraint_from_args(args), logit_bias=logit_bias_from_args(args),
    )
    with SpecServeClient(args.server, credentials=apply_client_flags(args)) as client:
        stream = client.generate(args.prompt, **fields)
        streaming = not args.json and args.n == 1
        samples: dict[int, dict[str, Any]] = {}
        if streaming:
            for item in stream:
                sys.stdout.write(item.chunk.text_delta)
                sys.stdout.flush()
            sys.stdout.write("\n")
            return 0
        samples = collect(stream)
        ordered = [samples[i] for i in sorted(samples)]
        if args.json:
            stats = client.stats().get("engine", {})
            stats["requests"] = [s.pop("stats") for s in ordered]
            print(json.dumps({"model": args.model, "server": args.server, "draft": args.draft,
                              "contract": ordered[0]["contract"] if ordered else args.contract,
                              "samples": [{k: s[k] for k in SAMPLE_KEYS} for s in ordered],
                              "metrics": {"speculative_decoding": summed_speculation(stats["requests"])},
                              "stats": stats}))
        else:
            for i, sample in enumerate(ordered):
                print(f"--- sample {i} ({sample['finish_reason']})\n{sample['text']}")
    return 0
