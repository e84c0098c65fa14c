"""`--logprobs N`, `--echo` and `--logprobs-mode` of `specserve generate` (docs/api.md, "Log-probabilities"): the
request's SamplingParams fields, and the log-probabilities printed (a table after the text, or `logprobs` /
`prompt_logprobs` in each --json sample, in OpenAI's chat shape)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, TextIO

from cluster.serving.logprob_format import Pieces, chat_logprobs
from specserve_types.api import LOGPROBS_MODES, MAX_LOGPROBS, RowLogprobs, SpecServeError


def add_logprob_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help=f"each output token's log-probability with its N likeliest alternatives (0..{MAX_LOGPROBS})")
    p.add_argument("--echo", action="store_true",
                   help="the prompt's tokens' log-probabilities too (with --logprobs' N alternatives); --max-tokens 0 "
                        "then scores the prompt only")
    p.add_argument("--logprobs-mode", choices=LOGPROBS_MODES, default="raw",
                   help="raw: the target's log-softmax of its logits (the default); processed: of the distribution "
                        "each token was sampled from")


def logprob_fields(args: argparse.Namespace) -> dict[str, Any]:
    """SamplingParams' log-probability fields from the flags (their bounds are checked there)."""
    if args.max_tokens == 0 and not args.echo:
        raise SpecServeError("max_tokens: 0 only with --echo (the prompt scored, nothing generated)")
    return {"logprobs": args.logprobs, "prompt_logprobs": (args.logprobs or 0) if args.echo else None,
            "logprobs_mode": args.logprobs_mode}


def prompt_entries(prompt_ids: Sequence[int], rows: RowLogprobs, pieces: Pieces) -> list[dict[str, Any] | None]:
    """The prompt's entries in the chat shape, null for its first token."""
    return [None, *chat_logprobs(prompt_ids[1:], rows, pieces)]


def print_table(title: str, entries: Sequence[dict[str, Any] | None], out: TextIO) -> None:
    out.write(f"--- {title}\n")
    for entry in entries:
        if entry is None:
            out.write(f"{'':>10}  (first token: no log-probability)\n")
            continue
        alternatives = ", ".join(f"{alt['token']!r} {alt['logprob']:.4f}" for alt in entry["top_logprobs"])
        out.write(f"{entry['logprob']:>10.4f}  {entry['token']!r}{'  | ' + alternatives if alternatives else ''}\n")
