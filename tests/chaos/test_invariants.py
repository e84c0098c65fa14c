"""The chaos invariants (chaos/invariants.py) tell a stream that re-sends or skips tokens, read from the offsets
each chunk carries, from text that legitimately repeats itself; and the offsets the engine sends follow on."""

from __future__ import annotations

from chaos.invariants import judge, offset_gap
from chaos.load import RequestRecord, RequestSpec

SPEC = RequestSpec("g0", "say ha", 6, "grpc")


def record(chunks: list[list[int]], offsets: list[int]) -> RequestRecord:
    r = RequestRecord("r0", "g0", "grpc", True, 0.0, 30.0, max_tokens=6, end=1.0, outcome="completed")
    r.chunk_tokens, r.chunk_offsets = chunks, offsets
    return r


def test_repetitive_text_is_not_a_repeat() -> None:
    """"ha ha ha": equal consecutive chunks, each at its own offset; the baseline is the same text."""
    ha = record([[7, 8], [7, 8], [7, 8], []], [0, 2, 4, 6])
    verdict = judge([ha], {"g0": SPEC}, {"g0": [7, 8, 7, 8, 7, 8]}, None)
    assert verdict.ok and verdict.duplicated == 0 and verdict.completed_exact == 1


def test_a_re_sent_chunk_is_a_repeat_even_when_the_text_would_allow_it() -> None:
    resent = record([[7, 8], [7, 8], [7, 8]], [0, 2, 2])  # the third chunk says it starts at 2 again
    assert offset_gap(resent) == (2, 4, 2)
    verdict = judge([resent], {"g0": SPEC}, {"g0": [7, 8, 7, 8, 7, 8]}, None)
    assert verdict.duplicated == 1 and not verdict.ok
    assert any("re-sends tokens 2..3" in v for v in verdict.violations)


def test_a_skipped_chunk_is_missing_tokens() -> None:
    skipped = record([[7, 8], [7, 8]], [0, 4])
    verdict = judge([skipped], {"g0": SPEC}, {"g0": [7, 8, 7, 8, 7, 8]}, None)
    assert verdict.missing >= 1 and any("skips tokens 2..3" in v for v in verdict.violations)


def test_a_diverged_stream_is_not_counted_as_duplicated() -> None:
    other = record([[7, 8], [7, 8], [9, 9]], [0, 2, 4])
    verdict = judge([other], {"g0": SPEC}, {"g0": [7, 8, 7, 8, 7, 8]}, None)
    assert (verdict.diverged, verdict.duplicated) == (1, 0)
