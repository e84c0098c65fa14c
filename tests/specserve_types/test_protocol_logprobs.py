"""Log-probabilities over gRPC (specserve_types/protocol.py): the request fields become the sampling fields (echo
allows max_tokens 0), and a chunk's rows, ranks and token texts come back from the wire bit for bit (-inf too)."""

from __future__ import annotations

import numpy as np
import pytest

from specserve_types.api import InvalidRequestError, RowLogprobs, TokenChunk
from specserve_types.proto import specserve_pb2 as pb
from specserve_types.protocol import (
    IndexedChunk,
    ServerDefaults,
    chunk_from_proto,
    chunk_to_proto,
    request_from_proto,
)

DEFAULTS = ServerDefaults("tiny", "ngram")


def test_fields_become_sampling_params() -> None:
    args, _ = request_from_proto(pb.GenerateRequest(text="x", logprobs=3, echo=True, max_tokens=0,
                                                    logprobs_mode="processed"), DEFAULTS)
    s = args.sampling
    assert (s.logprobs, s.prompt_logprobs, s.max_tokens, s.logprobs_mode, args.echo) == (3, 3, 0, "processed", True)
    args, _ = request_from_proto(pb.GenerateRequest(text="x"), DEFAULTS)
    assert (args.sampling.logprobs, args.sampling.prompt_logprobs, args.echo) == (None, None, False)


@pytest.mark.parametrize(("request_", "field"), [
    (pb.GenerateRequest(text="x", max_tokens=0), "max_tokens"),
    (pb.GenerateRequest(text="x", logprobs=21), "logprobs"),
    (pb.GenerateRequest(text="x", logprobs=-1), "logprobs"),
    (pb.GenerateRequest(text="x", logprobs_mode="logits"), "logprobs_mode"),
])
def test_bad_fields_are_named(request_: pb.GenerateRequest, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        request_from_proto(request_, DEFAULTS)
    assert info.value.field == field


def test_a_chunk_round_trips_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    values = rng.standard_normal(3).astype(np.float32) - 3
    top = rng.standard_normal((3, 2)).astype(np.float32)
    top[2, 1] = -np.inf
    rows = RowLogprobs(values, np.array([[4, 5], [6, 4], [5, 6]], np.int32), top, np.array([1, 7, 2], np.int32))
    prompt = RowLogprobs(np.array([-1.5], np.float32), np.zeros((1, 0), np.int32), np.zeros((1, 0), np.float32),
                         np.array([3], np.int32))
    pieces = {4: ("a", (97,)), 5: ("\ufffd", (0xE4,)), 6: (" b", (32, 98)), 1: ("<s>", tuple(b"<s>")), 2: ("c", (99,))}
    item = IndexedChunk(0, TokenChunk("r", [4, 5, 6], "a b", logprobs=rows, prompt_logprobs=prompt), "greedy",
                        pieces=pieces, prompt_token_ids=(1, 2), prompt_text="<s>c")
    back = chunk_from_proto(pb.GenerateChunk.FromString(chunk_to_proto(item).SerializeToString()))
    assert back.chunk.logprobs is not None and back.chunk.prompt_logprobs is not None
    for a, b in ((back.chunk.logprobs, rows), (back.chunk.prompt_logprobs, prompt)):
        np.testing.assert_array_equal(a.token_logprobs.view(np.int32), b.token_logprobs.view(np.int32))
        np.testing.assert_array_equal(a.top_logprobs.view(np.int32), b.top_logprobs.view(np.int32))
        np.testing.assert_array_equal(a.top_ids, b.top_ids)
        np.testing.assert_array_equal(a.ranks, b.ranks)
    assert back.prompt_token_ids == (1, 2) and back.prompt_text == "<s>c"
    assert {k: back.pieces[k] for k in (2, 4, 5, 6)} == {k: pieces[k] for k in (2, 4, 5, 6)}
    plain = chunk_from_proto(chunk_to_proto(IndexedChunk(0, TokenChunk("r", [4], "a"), "greedy")))
    assert plain.chunk.logprobs is None and plain.chunk.prompt_logprobs is None and plain.prompt_text is None
