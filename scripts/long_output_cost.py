"""What a long output costs the engine's Python a token: its text and its n-gram lookups, now and as they were.

    .venv/bin/python scripts/long_output_cost.py tracker [--tokens 64,512,2048,8192]
    .venv/bin/python scripts/long_output_cost.py ngram [--tokens 100,500,2000,8000]
    scripts/in-netns.sh .venv/bin/python scripts/long_output_cost.py engine [--batch 8] [--tokens 1536] [--repeats 2]

`tracker` feeds one output of n tokens (the README's text, tokenized by SmolLM2's tokenizer) token by token, as
RequestState.append_tokens does, with a stop string that never matches (the stop checks run on every token), and
prints the time a request and a token. `ngram` times one lookup (k = 4) after n tokens, a random history over
SmolLM2's vocabulary with and without a match, through the request's array and through torch as before. Both on
one thread, no model. `engine` runs SmolLM2 in process (n-gram drafts, k auto, greedy, EOS ignored) on `--batch`
requests of `--tokens` tokens, the code before and now alternating in one process, and prints each run's
throughput and a hash of the first request's text (the same for both).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer

from cluster.engine import planner
from cluster.engine.request_state import TextTracker
from drafter_service.ngram import TokenHistory, propose_ngram
from model_runtime.prepare import prepare_model

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Tell me a long story about a dragon.", "Explain how CPUs work, in detail.",
           "Write Python code for a web server.", "Summarise the history of Rome.", "List every prime you know.",
           "Describe the ocean.", "Write a poem about rain.", "Explain speculative decoding."]
INCREMENTAL = TextTracker._decoded


def whole_decode(self: TextTracker, token_ids: list[int]) -> str:
    """The tracker as it was until 2026-12-06: the whole output decoded every token."""
    return self.tokenizer.decode(token_ids[self.prompt_len:], skip_special_tokens=True)


def torch_ngram(history: Any, k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """The n-gram lookup as it was until 2026-12-06: the history converted to a tensor and every window compared."""
    tokens = torch.as_tensor(np.asarray(history).tolist(), dtype=torch.long)
    length = tokens.numel()
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        starts = (tokens[:-1].unfold(0, n, 1) == tokens[-n:]).all(-1).nonzero()
        if starts.numel() > 0:
            follow = int(starts[-1]) + n
            return tokens[follow:follow + k].tolist()
    return []


def ngram(sizes: list[int]) -> None:
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    print(f"{'tokens':>7} {'history':>9} {'torch, us':>10} {'array, us':>10}")
    for n in sizes:
        ids = rng.integers(0, 49152, n).tolist()
        for case, history in (("no match", ids), ("match", ids + ids[n // 2:n // 2 + 3])):
            assert torch_ngram(history, 4) == propose_ngram(history, 4)
            took = []
            for lookup in (torch_ngram, propose_ngram):
                mirror, start = TokenHistory(), time.perf_counter()
                for _ in range(300):
                    lookup(mirror.view(history), 4)
                took.append((time.perf_counter() - start) / 300 * 1e6)
            print(f"{n:7d} {case:>9} {took[0]:10.1f} {took[1]:10.1f}", flush=True)


def tracker(sizes: list[int]) -> None:
    tok = AutoTokenizer.from_pretrained(prepare_model("smollm2-135m", progress=False))
    ids = tok.encode((ROOT / "README.md").read_text() * (1 + max(sizes) // 2000), add_special_tokens=False)
    print(f"{'tokens':>7} {'tracker':>12} {'ms a request':>13} {'us a token':>11}")
    for n in sizes:
        for name, decoded in (("whole", whole_decode), ("incremental", INCREMENTAL)):
            TextTracker._decoded = decoded  # type: ignore[method-assign]
            text, seen = TextTracker(tok, 0, ("<|never appears|>",)), []
            start = time.perf_counter()
            for token in ids[:n]:
                seen.append(token)
                text.update(seen)
            took = time.perf_counter() - start
            print(f"{n:7d} {name:>12} {took * 1e3:13.1f} {took / n * 1e6:11.1f}", flush=True)


def engine(batch: int, tokens: int, repeats: int) -> None:
    from cluster.cli.generate import generate_kv_blocks
    from cluster.engine.factory import build_local_engine, tokenize_prompt
    from cluster.serving.config import make_config
    from specserve_types.api import GenerationRequest, SamplingParams, SpecParams

    cfg = make_config(model="smollm2-135m", draft="ngram", max_batch=batch, queue_capacity=64, kv_blocks=None)
    cfg = cfg.with_overrides(kv_blocks=generate_kv_blocks(batch, tokens, cfg.max_context, cfg.k_max, cfg.block_size))
    eng: Any = build_local_engine(cfg.model, cfg.draft, cfg.engine_config(), cfg.local_runtime())
    print(f"SmolLM2, {batch} requests of {tokens} tokens, dtype {eng.stats().get('dtype')}", flush=True)
    for i in range(repeats):
        order = [("before", whole_decode, torch_ngram), ("now", INCREMENTAL, propose_ngram)]
        for name, decoded, lookup in order if i % 2 == 0 else order[::-1]:
            TextTracker._decoded = decoded  # type: ignore[method-assign]
            planner.propose_ngram = lookup  # type: ignore[assignment]
            requests = [GenerationRequest(f"{name}-{i}-{j}",
                                          tuple(tokenize_prompt(eng.tokenizer, PROMPTS[j % len(PROMPTS)], True)),
                                          SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True),
                                          SpecParams(k=None, draft="ngram")) for j in range(batch)]
            start = time.perf_counter()
            for request in requests:
                eng.submit(request)
            out = eng.run_to_completion()
            took = time.perf_counter() - start
            made = sum(len(c.token_ids) for chunks in out.values() for c in chunks)
            first = "".join(c.text_delta for c in out[requests[0].request_id])
            print(f"{name:>7} {took:7.2f} s {made} tokens {made / took:7.1f} tok/s, text hash {hash(first)}",
                  flush=True)
    TextTracker._decoded = INCREMENTAL  # type: ignore[method-assign]
    planner.propose_ngram = propose_ngram  # type: ignore[assignment]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    one = sub.add_parser("tracker")
    one.add_argument("--tokens", default="64,512,2048,8192")
    lookups = sub.add_parser("ngram")
    lookups.add_argument("--tokens", default="100,500,2000,8000")
    many = sub.add_parser("engine")
    many.add_argument("--batch", type=int, default=8)
    many.add_argument("--tokens", type=int, default=1536)
    many.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.what == "tracker":
        tracker([int(n) for n in args.tokens.split(",")])
    elif args.what == "ngram":
        ngram([int(n) for n in args.tokens.split(",")])
    else:
        engine(args.batch, args.tokens, args.repeats)


if __name__ == "__main__":
    main()
