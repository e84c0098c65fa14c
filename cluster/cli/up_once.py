"""`specserve up --once "PROMPT"`: one generation through the cluster just started, then its statistics.

    up --once:  deploy -> address lines -> SpecServeClient.generate (text to stdout as it arrives)
                -> statistics JSON (one line) -> shut down Serve and Ray -> exit 0
    up --once --json:  the same run, stdout is one JSON object {addresses, text, token_ids, stats}

Statistics (glossary in cluster/engine/acceptance_stats.py):
  acceptance                 rounds that drafted, drafts proposed / accepted, s_k per draft position
  expected_tokens_per_round  E[Y] = 1 + sum_k s_k over the positions drafted (docs/contracts.md)
  mean_tokens_per_round      output tokens / rounds actually run (plain rounds count 1)
  time_split_seconds         the request's engine time drafting / verifying / reconciling; `other`
                             is the rest of the client-side wall time (queueing, transport, planning)
  fallback_events            the engine's record of drafter failures, retries, preemptions
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import Any, TextIO

from cluster.client import Credentials, SpecServeClient
from cluster.engine.acceptance_stats import AcceptanceStats
from cluster.serving.config import ClusterConfig

WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]")


@contextlib.contextmanager
def reserved_stdout() -> Iterator[TextIO]:
    """The process's stdout, for our output only: while held, file descriptor 1 points at stderr, so
    lines Ray prints on the driver's stdout (worker logs, shutdown notices) go to stderr instead."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    out = os.fdopen(os.dup(saved), "w", buffering=1)
    try:
        yield out
    finally:
        out.close()
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def client_address(config: ClusterConfig) -> str:
    host = "127.0.0.1" if config.host in WILDCARD_HOSTS else config.host
    return f"{host}:{config.grpc_port}"


def own_credentials(config: ClusterConfig) -> Credentials:
    """The credentials of a client of the cluster just started: its first API key, TLS trusting its own
    certificate (a self-signed one; SPECSERVE_TLS_CA_FILE names another root), or what the environment says."""
    from_env = Credentials.from_env()
    keys, _ = config.key_sources().load()
    return Credentials(api_key=from_env.api_key or (keys[0] if keys else None), tls=config.uses_tls or from_env.tls,
                       ca_file=from_env.ca_file or config.tls_cert_file)


def generate_once(config: ClusterConfig, prompt: str, fields: dict[str, Any], out: TextIO | None) -> dict[str, Any]:
    """Stream one generation (text to `out` as it arrives, if given); returns text, ids and statistics."""
    token_ids: list[int] = []
    text, final = "", None
    with SpecServeClient(client_address(config), timeout_s=config.request_timeout_s,
                         credentials=own_credentials(config)) as client:
        started = time.perf_counter()
        first_token_at = None
        for item in client.generate(prompt, **fields):
            chunk = item.chunk
            if chunk.token_ids and first_token_at is None:
                first_token_at = time.perf_counter()
            token_ids.extend(chunk.token_ids)
            text += chunk.text_delta
            if out is not None and chunk.text_delta:
                out.write(chunk.text_delta)
                out.flush()
            if chunk.finished:
                final = item
        wall = time.perf_counter() - started
        engine = client.stats()["engine"]
    assert final is not None, "the stream ended without a final chunk"
    ttft = None if first_token_at is None else first_token_at - started
    return {"text": text, "token_ids": token_ids,
            "stats": summarize(final.chunk.stats or {}, final.contract, final.chunk.finish_reason, wall, ttft, engine)}


def summarize(request_stats: dict[str, Any], contract: str, finish_reason: str | None, wall_s: float,
              ttft_s: float | None, engine_stats: dict[str, Any]) -> dict[str, Any]:
    acceptance = AcceptanceStats.from_dict(request_stats["acceptance"])
    survival = acceptance.survival()
    output_tokens = request_stats.get("output_tokens", 0)
    rounds = request_stats.get("rounds", 0)
    split = {part: request_stats.get(f"{part}_seconds", 0.0) for part in ("draft", "verify", "reconcile")}
    split["other"] = max(0.0, wall_s - sum(split.values()))
    return {
        "model": engine_stats.get("model"),
        "draft": engine_stats.get("draft"),
        "contract": contract,
        "finish_reason": finish_reason,
        "prompt_tokens": request_stats.get("prompt_tokens"),
        "output_tokens": output_tokens,
        "rounds": rounds,
        "acceptance": {"rounds": acceptance.rounds, "proposed": acceptance.proposed, "accepted": acceptance.accepted,
                       "acceptance_rate": acceptance.acceptance_rate, "survival": survival},
        "expected_tokens_per_round": acceptance.expected_tokens_per_round(len(survival)),
        "mean_tokens_per_round": output_tokens / rounds if rounds else 0.0,
        "ttft_seconds": ttft_s,
        "wall_seconds": wall_s,
        "tokens_per_second": output_tokens / wall_s if wall_s > 0 else 0.0,
        "time_split_seconds": split,
        "policy_events": request_stats.get("policy_events", []),
        "fallback_events": engine_stats.get("fallback_events", []),
    }
