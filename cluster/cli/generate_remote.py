"""`specserve generate --server HOST:PORT`: the same flags and output as in process, through gRPC."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from cluster.cli.client_flags import apply_client_flags
from cluster.cli.constraint_flags import constraint_from_args, logit_bias_from_args
from cluster.cli.logprob_flags import print_table, prompt_entries
from cluster.client import SpecServeClient, collect
from cluster.engine.request_span import summed_speculation
from cluster.serving.logprob_format import chat_logprobs
from specserve_types.api import SpecServeError
from specserve_types.protocol import IndexedChunk

DEFAULT_MODEL = "qwen2.5-coder-1.5b"
SAMPLE_KEYS = ("token_ids", "text", "finish_reason", "proposed", "accepted", "forced", "logprobs",
               "prompt_logprobs")  # --json's, as in process (the last two only where asked)


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
        logprobs=args.logprobs, echo=args.echo or None,
        logprobs_mode=None if args.logprobs_mode == "raw" else args.logprobs_mode,
    )
    if args.max_tokens == 0 and not args.echo:
        raise SpecServeError("max_tokens: 0 only with --echo (the prompt scored, nothing generated)")
    with SpecServeClient(args.server, credentials=apply_client_flags(args)) as client:
        stream = client.generate(args.prompt, **fields)
        streaming = not args.json and args.n == 1
        samples: dict[int, dict[str, Any]] = {}
        if streaming:
            seen: list[IndexedChunk] = []
            for item in stream:
                seen.append(item)
                sys.stdout.write(item.chunk.text_delta)
                sys.stdout.flush()
            sys.stdout.write("\n")
            _print_logprobs(collect(iter(seen)))
            return 0
        samples = collect(stream)
        ordered = [samples[i] for i in sorted(samples)]
        for sample in ordered:
            _readable_logprobs(sample)
        if args.json:
            stats = client.stats().get("engine", {})
            stats["requests"] = [s.pop("stats") for s in ordered]
            print(json.dumps({"model": args.model, "server": args.server, "draft": args.draft,
                              "contract": ordered[0]["contract"] if ordered else args.contract,
                              "samples": [{k: s[k] for k in SAMPLE_KEYS if k in s} for s in ordered],
                              "metrics": {"speculative_decoding": summed_speculation(stats["requests"])},
                              "stats": stats}))
        else:
            for i, sample in enumerate(ordered):
                print(f"--- sample {i} ({sample['finish_reason']})\n{sample['text']}")
            _print_logprobs(samples)
    return 0


def _readable_logprobs(sample: dict[str, Any]) -> None:
    """The sample's log-probabilities in --json's shape (as in process: OpenAI's chat entries), in place."""
    pieces = sample.pop("pieces")
    rows, prompt_rows = sample.pop("logprobs"), sample.pop("prompt_logprobs")
    prompt_ids = sample.pop("prompt_token_ids")
    sample.pop("prompt_text")
    if rows is not None:
        sample["logprobs"] = chat_logprobs(sample["token_ids"], rows, pieces)
    if prompt_rows is not None:
        sample["prompt_logprobs"] = prompt_entries(prompt_ids, prompt_rows, pieces)


def _print_logprobs(samples: dict[int, dict[str, Any]]) -> None:
    for i in sorted(samples):
        sample = samples[i]
        if "pieces" in sample:
            _readable_logprobs(sample)
        if "prompt_logprobs" in sample:
            print_table(f"sample {i}: the prompt's log-probabilities", sample["prompt_logprobs"], sys.stdout)
        if sample.get("logprobs"):
            print_table(f"sample {i}: log-probabilities", sample["logprobs"], sys.stdout)
