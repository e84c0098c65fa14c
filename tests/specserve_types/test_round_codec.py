"""The round channel's frames (specserve_types/round_codec.py): the hot methods as typed MessagePack, the rest
pickled; and the same over a channel, read by connection threads and by a ComputeThread."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import msgspec
import numpy as np
import pytest

from model_runtime.compute_thread import ComputeThread
from specserve_types.api import RowLogprobs, SamplingParams
from specserve_types.round_channel import ChannelLost, ChannelServer
from specserve_types.round_channel_client import ChannelClient
from specserve_types.round_codec import (
    FRAME_HEADER,
    KIND_MSGPACK,
    KIND_PICKLE,
    CallFrame,
    decode_answer,
    encode_answer,
    encode_call,
)
from specserve_types.round_messages import (
    ProposeBatch,
    ProposeItem,
    ProposeOutput,
    ProposeResult,
    VerifyBatch,
    VerifyItem,
    VerifyOutput,
    VerifyResult,
)


def verify_batch(probs: np.ndarray | None = None, parents: list[int] | None = None) -> VerifyBatch:
    sampling = SamplingParams(temperature=0.7, top_k=10, seed=3, stop=("\n\n",))
    item = VerifyItem("r1", [5], [11, 12, 13], probs, 40, [0, 1, 2], [40, 41, 42, 43], sampling, "exact", 9, 41,
                      prompt_ids=[1, 2], output_ids=[5], copy_blocks=[(2, 7)], draft_parents=parents)
    plain = VerifyItem("r2", [8, 9], [], None, 0, [3], [0, 1], SamplingParams(), "greedy", 0, 2)
    return VerifyBatch([item, plain], (("traceparent", "00-abc-def-01"),))


def verify_result() -> VerifyResult:
    logprobs = RowLogprobs(np.array([-0.5, -1.25, -3.0], np.float32), np.array([[11, 3], [12, 4], [7, 99]], np.int32),
                           np.array([[-0.5, -2.0], [-1.25, -1.5], [-0.75, -3.0]], np.float32),
                           np.array([1, 1, 3], np.int32))
    prompt = RowLogprobs(np.array([-7.5], np.float32), np.zeros((1, 0), np.int32), np.zeros((1, 0), np.float32),
                         np.array([40], np.int32))
    return VerifyResult([VerifyOutput("r1", 2, [11, 12, 99], False, accepted_path=[0, 1], logprobs=logprobs),
                         VerifyOutput("r2", 0, [4], True, prompt_logprobs=prompt)], 0.05, 6, "instance-1")


def propose_batch() -> ProposeBatch:
    item = ProposeItem("r1", [5], 40, [0, 1, 2], [40, 41, 42], 3, SamplingParams(temperature=1.0), 4, 41, True,
                       tree_nodes=6, tree_width=2)
    return ProposeBatch([item])


def propose_result() -> ProposeResult:
    probs = np.random.default_rng(0).random((3, 17), dtype=np.float32)
    return ProposeResult([ProposeOutput("r1", [1, 2, 3], probs, draft_parents=[-1, 0, 0]),
                          ProposeOutput("r2", [7], None)], 0.01, "instance-2")


def split(frame: bytes) -> tuple[int, bytearray]:
    length, kind = FRAME_HEADER.unpack_from(frame)
    assert length == len(frame) - FRAME_HEADER.size + 1
    return kind, bytearray(frame[FRAME_HEADER.size:])


def equal(a: Any, b: Any) -> bool:
    """Dataclass equality with arrays compared by value."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype \
            and np.array_equal(a, b)
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(equal(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("batch", [verify_batch(), verify_batch(np.random.default_rng(1).random((3, 33),
                                                                                                dtype=np.float32)),
                                   verify_batch(parents=[-1, 0, 0]), propose_batch()],
                         ids=["verify", "verify-probs", "verify-tree", "propose"])
def test_a_hot_call_travels_typed_and_decodes_to_the_same_values(batch: Any) -> None:
    method = "verify" if isinstance(batch, VerifyBatch) else "propose"
    kind, payload = split(encode_call(41, method, (batch,), {}))
    assert kind == KIND_MSGPACK
    call = CallFrame(kind, payload)
    assert (call.call_id, call.method) == (41, method)
    args, kwargs = call.arguments()
    assert kwargs == {} and len(args) == 1 and equal(args[0], batch)


@pytest.mark.parametrize(("method", "answer"), [("verify", verify_result()), ("propose", propose_result())])
def test_a_hot_answer_travels_typed_and_its_arrays_are_writable_views(method: str, answer: Any) -> None:
    kind, payload = split(encode_answer(7, method, True, answer, 0.25))
    assert kind == KIND_MSGPACK
    call_id, ok, value, seconds = decode_answer(kind, payload, method)
    assert (call_id, ok, seconds) == (7, True, 0.25) and equal(value, answer)
    for out in getattr(value, "outputs", []):
        probs = getattr(out, "draft_probs", None)
        if probs is not None:
            assert probs.flags.writeable and probs.flags.aligned
            probs[0, 0] = 5.0  # the receiver's own buffer


def test_everything_else_is_pickled() -> None:
    assert split(encode_call(1, "reserve", ("incarnation", []), {}))[0] == KIND_PICKLE
    assert split(encode_call(1, "verify", (verify_batch(),), {"extra": 1}))[0] == KIND_PICKLE  # keyword arguments
    assert split(encode_call(1, "verify", ({"not": "a batch"},), {}))[0] == KIND_PICKLE  # a test's fake
    assert split(encode_answer(1, "verify", False, ValueError("x"), 0.1))[0] == KIND_PICKLE  # an error
    assert split(encode_answer(1, "verify", True, {"fake": 1}, 0.1))[0] == KIND_PICKLE
    odd = propose_result()
    odd.outputs[0].draft_probs = object()  # type: ignore[assignment]  # no MessagePack form: pickled whole
    kind, payload = split(encode_answer(2, "propose", True, odd, 0.1))
    assert kind == KIND_PICKLE and decode_answer(kind, payload, "propose")[0] == 2
    kind, payload = split(encode_call(3, "verify", (verify_batch(),), {"extra": 1}))
    args, kwargs = CallFrame(kind, payload).arguments()
    assert kwargs == {"extra": 1} and equal(args[0], verify_batch())


def test_numpy_scalars_travel_as_numbers() -> None:
    batch = verify_batch()
    batch.items[0].draft_ids = [np.int64(11), np.int64(12), np.int64(13)]  # type: ignore[list-item]
    args, _ = CallFrame(*split(encode_call(1, "verify", (batch,), {}))).arguments()
    assert args[0].items[0].draft_ids == [11, 12, 13]


def test_typed_arguments_are_validated_as_their_constructors_validate() -> None:
    head = 8 + 1 + len(b"verify")  # call id, the method's length, the method
    payload = split(encode_call(1, "verify", (verify_batch(),), {}))[1]
    raw = msgspec.msgpack.decode(payload[head:])
    raw["items"][0]["sampling"]["temperature"] = -1.0  # what the constructor refuses
    call = CallFrame(KIND_MSGPACK, payload[:head] + msgspec.msgpack.encode(raw))
    assert call.method == "verify"
    with pytest.raises(msgspec.ValidationError, match="temperature: must be a finite number"):
        call.arguments()  # SamplingParams' own check, reported with where it failed
    raw["items"][0]["sampling"]["temperature"] = 0.0
    raw["items"][0]["input_ids"] = "not a list"
    with pytest.raises(msgspec.ValidationError):
        CallFrame(KIND_MSGPACK, payload[:head] + msgspec.msgpack.encode(raw)).arguments()


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="kind"):
        CallFrame(9, bytearray(b"x"))
    with pytest.raises(ValueError, match="kind"):
        decode_answer(9, bytearray(b"x"), "verify")


@pytest.fixture(params=["connection-threads", "compute-thread"])
def reader(request: pytest.FixtureRequest) -> Any:
    compute = ComputeThread("test-compute") if request.param == "compute-thread" else None
    yield compute
    if compute is not None:
        compute.close()


def test_over_a_channel_typed_calls_answer_and_bad_ones_fail_cleanly(reader: ComputeThread | None) -> None:
    pool = concurrent.futures.ThreadPoolExecutor(1)
    seen: list[Any] = []

    def verify(batch: VerifyBatch) -> Any:
        seen.append(batch)
        return pool.submit(verify_result)

    def propose(batch: ProposeBatch) -> ProposeResult:
        bad = propose_result()
        bad.seconds = "not a number"  # type: ignore[assignment]  # encodes, and fails the caller's typed decode
        return bad if batch.items[0].k == 99 else propose_result()

    server = ChannelServer({"verify": verify, "propose": propose}, "node", "127.0.0.1", "codec", reader=reader)
    try:
        client = ChannelClient(server.start(), "node")
        assert equal(client.call("verify", verify_batch()), verify_result())
        assert equal(seen[0], verify_batch())
        assert equal(client.call("propose", propose_batch()), propose_result())
        bad = propose_batch()
        bad.items[0].k = 99
        with pytest.raises(ChannelLost, match="does not decode"):
            client.call("propose", bad)
        assert not client.connected  # the link is dropped; the next call connects again
        client = ChannelClient(server.start(), "node")
        assert equal(client.call("verify", verify_batch()), verify_result())
        client.close()
    finally:
        server.close()
        pool.shutdown()
