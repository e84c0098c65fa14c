"""Validation of the public request types: values that would break the math or the logs are refused,
naming the field."""

from __future__ import annotations

import pytest

from specserve_types.api import (
    MIN_TEMPERATURE,
    GenerationRequest,
    InvalidRequestError,
    SamplingParams,
    check_identifier,
    check_text,
)


@pytest.mark.parametrize(("fields", "field"), [
    ({"temperature": 5e-324}, "temperature"),  # logits / temperature overflows float32: NaN probabilities
    ({"temperature": MIN_TEMPERATURE / 2}, "temperature"),
    ({"repetition_penalty": 5e-324}, "repetition_penalty"),
    ({"repetition_penalty": 1e300}, "repetition_penalty"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ({"stop": ("ok", "x\ud800")}, "stop"),
])
def test_values_that_break_the_math_or_the_text_are_refused(fields: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**fields)
    assert info.value.field == field


def test_greedy_and_the_smallest_temperature_are_taken() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=MIN_TEMPERATURE).is_greedy


def test_text_and_identifiers() -> None:
    check_text("prompt", "tabs\tnewlines\nand é漢字🙂 are text")
    with pytest.raises(InvalidRequestError, match="unpaired surrogate"):
        check_text("prompt", "abc\ud800def")
    for bad in ("two\nlines", "x" * 129, "bell\x07"):
        with pytest.raises(InvalidRequestError) as info:
            check_identifier("request_id", bad)
        assert info.value.field == "request_id"
    with pytest.raises(InvalidRequestError):
        GenerationRequest("bad\rid", (1, 2))


def test_top_k_is_bounded_as_the_round_messages_carry_it() -> None:
    from specserve_types.api import MAX_TOP_K, InvalidRequestError, SamplingParams

    assert SamplingParams(temperature=1.0, top_k=MAX_TOP_K).top_k == MAX_TOP_K
    with pytest.raises(InvalidRequestError, match="top_k"):
        SamplingParams(temperature=1.0, top_k=MAX_TOP_K + 1)  # a 10**30 from a fuzzer failed a round's encoding
