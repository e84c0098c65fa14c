"""What must hold after every chaos scenario (README "Chaos runs").

    every request ended: completed (greedy: token for token the baseline), cancelled by its client, or a
        typed error (UNAVAILABLE, ABORTED, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED; `explained` adds more for
        a scenario whose fault is documented to fail requests, e.g. an in-band error finish after a KV fault)
    no stream repeats or skips a token: a greedy stream is a prefix of the baseline, a sampled stream is
        never longer than max_tokens and a completed one exactly max_tokens long
    KV: audit clean, nothing reserved or committed once idle, the ledger reconciled with the engine
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from chaos.load import RequestRecord, RequestSpec

TYPED_ERRORS = frozenset({"UNAVAILABLE", "ABORTED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"})


@dataclass
class Verdict:
    sent: int = 0
    completed_exact: int = 0  # greedy: equal to the baseline; sampled: max_tokens tokens
    cancelled: int = 0  # by the client, on purpose
    typed_errors: dict[str, int] = field(default_factory=dict)
    lost: int = 0  # ended without a final answer or an accepted error (hang, truncation, untyped error)
    diverged: int = 0  # a greedy stream that left the baseline
    duplicated: int = 0  # a stream with more tokens than asked, or a repeated chunk
    missing: int = 0  # a completed stream with fewer tokens than asked
    leaked_blocks: int = 0
    held_blocks: int = 0
    reconcile: str | None = None
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


def judge(records: list[RequestRecord], specs: dict[str, RequestSpec], baseline: dict[str, list[int]],
          kv: dict[str, Any] | None, explained: frozenset[str] = frozenset()) -> Verdict:
    verdict = Verdict(sent=len(records))
    accepted_errors = TYPED_ERRORS | explained
    errors: Counter[str] = Counter()
    for record in records:
        spec = specs[record.spec]
        tokens = record.tokens
        max_tokens = record.max_tokens or spec.max_tokens
        if len(tokens) > max_tokens:
            verdict.duplicated += 1
            verdict.violations.append(f"{record.request_id}: {len(tokens)} tokens > max_tokens {max_tokens}")
        base = baseline.get(spec.key, [])
        known = min(len(tokens), len(base))  # a longer request (cancel_max_tokens) is checked as far as known
        if spec.greedy and tokens[:known] != base[:known]:
            first = next(i for i, (a, b) in enumerate(zip(tokens[:known], base[:known], strict=True)) if a != b)
            # a repeated chunk shows as the stream re-emitting tokens it already sent
            repeated = any(record.chunk_tokens[i] and record.chunk_tokens[i] == record.chunk_tokens[i - 1]
                           for i in range(1, len(record.chunk_tokens)))
            if repeated:
                verdict.duplicated += 1
            verdict.diverged += 1
            verdict.violations.append(f"{record.request_id}: greedy stream leaves the baseline at token {first}")
        if record.outcome == "completed":
            if len(tokens) < max_tokens:
                verdict.missing += 1
                verdict.violations.append(f"{record.request_id}: completed with {len(tokens)}/{max_tokens} tokens")
            elif not spec.greedy or tokens[:len(base)] == base:
                verdict.completed_exact += 1
        elif record.outcome == "cancelled" and record.planned_cancel:
            verdict.cancelled += 1
        elif record.outcome in accepted_errors or (record.outcome == "error_finish" and "error_finish" in explained):
            errors[record.outcome] += 1
            if record.end - record.start > record.deadline_s + 15.0:
                verdict.lost += 1
                verdict.violations.append(f"{record.request_id}: {record.outcome} after "
                                          f"{record.end - record.start:.1f}s, past its {record.deadline_s}s deadline")
        else:
            errors[record.outcome] += 1
            verdict.lost += 1
            verdict.violations.append(f"{record.request_id}: ended {record.outcome} ({record.detail[:120]})")
    verdict.typed_errors = dict(sorted(errors.items()))
    if kv is not None:
        verdict.leaked_blocks = kv["leaked_blocks"]
        verdict.held_blocks = kv["held_blocks"]
        verdict.reconcile = kv["reconcile"]
        if kv["leaked_blocks"] or kv["audit_errors"]:
            verdict.violations.append(f"KV audit: {kv['leaked_blocks']} leaked blocks, errors {kv['audit_errors']}")
        if kv["held_blocks"]:
            verdict.violations.append(f"KV: {kv['held_blocks']} blocks still reserved/committed once idle: {kv['counts']}")
        if kv["reconcile"] is not None:
            verdict.violations.append(f"KV ledger vs engine: {kv['reconcile']}")
    return verdict


def baseline_outputs(records: list[RequestRecord], specs: dict[str, RequestSpec]) -> dict[str, list[int]]:
    """The greedy outputs of a no-fault run (every spec once); refuses a baseline that is itself incomplete."""
    out: dict[str, list[int]] = {}
    for record in records:
        spec = specs[record.spec]
        if spec.greedy:
            assert record.outcome == "completed" and len(record.tokens) == spec.max_tokens, \
                f"baseline request {record.request_id} ended {record.outcome}: {record.detail}"
            out[spec.key] = record.tokens
    return out
