"""What must hold after every chaos scenario (docs/chaos.md).

    every request ended: completed (greedy: token for token the baseline), cancelled by its client, or a
        typed error (UNAVAILABLE, ABORTED, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED; `explained` adds more for
        a scenario whose fault is documented to fail requests, e.g. an in-band error finish after a KV fault)
    no stream repeats or skips a token: each chunk's offset (the server's count of tokens sent before it, in
        the gRPC and SSE chunks) equals the tokens the client received before it (smaller: a repeat; larger: a
        skip); a greedy stream is a prefix of the baseline, a sampled stream is never longer than max_tokens and a
        completed one exactly max_tokens long. Text that repeats itself (equal consecutive chunks) is not a repeat.
    KV: audit clean, nothing reserved or committed once idle, the ledger checked against the engine
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
    duplicated: int = 0  # a stream with more tokens than asked, or a chunk re-sending tokens (by its offset)
    missing: int = 0  # a completed stream with fewer tokens than asked, or a chunk past a gap (by its offset)
    leaked_blocks: int = 0
    held_blocks: int = 0
    ledger_check: str | None = None
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
        gap = offset_gap(record)
        if gap is not None:
            at, expected, offset = gap
            if offset < expected:
                verdict.duplicated += 1
                verdict.violations.append(f"{record.request_id}: chunk {at} re-sends tokens {offset}..{expected - 1}")
            else:
                verdict.missing += 1
                verdict.violations.append(f"{record.request_id}: chunk {at} skips tokens {expected}..{offset - 1}")
        elif len(tokens) > max_tokens:
            verdict.duplicated += 1
            verdict.violations.append(f"{record.request_id}: {len(tokens)} tokens > max_tokens {max_tokens}")
        base = baseline.get(spec.key, [])
        known = min(len(tokens), len(base))  # a longer request (cancel_max_tokens) is checked as far as known
        if spec.greedy and tokens[:known] != base[:known]:
            first = next(i for i, (a, b) in enumerate(zip(tokens[:known], base[:known], strict=True)) if a != b)
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
        verdict.ledger_check = kv["ledger_check"]
        if kv["leaked_blocks"] or kv["audit_errors"]:
            verdict.violations.append(f"KV audit: {kv['leaked_blocks']} leaked blocks, errors {kv['audit_errors']}")
        if kv["held_blocks"]:
            verdict.violations.append(f"KV: {kv['held_blocks']} blocks still reserved/committed once idle: {kv['counts']}")
        if kv["ledger_check"] is not None:
            verdict.violations.append(f"KV ledger vs engine: {kv['ledger_check']}")
    return verdict


def offset_gap(record: RequestRecord) -> tuple[int, int, int] | None:
    """The first chunk whose offset is not the count of tokens received before it: (chunk, expected, offset);
    None when every chunk with tokens follows on (empty chunks, e.g. a final or aborted one, carry no position)."""
    received = 0
    for at, (chunk, offset) in enumerate(zip(record.chunk_tokens, record.chunk_offsets, strict=True)):
        if chunk and offset != received:
            return at, received, offset
        received += len(chunk)
    return None


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
