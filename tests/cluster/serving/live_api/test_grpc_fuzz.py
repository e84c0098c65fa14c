"""The gRPC surface fuzzed: hypothesis draws GenerateRequests over the proto's fields (valid and not), and bytes
that are not one (garbage, truncations, invalid UTF-8 in string fields). Every call must end OK or with a
client-fault status, never UNKNOWN, INTERNAL or UNAVAILABLE; the server stays healthy and leaks nothing.
"""

from __future__ import annotations

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.client import SpecServeClient
from cluster.serving.config import ClusterConfig
from cluster.serving.grpc_service import SERVICE_NAME
from specserve_types.proto import specserve_pb2 as pb
from tests.cluster.serving.live_api.helpers import assert_no_leaks

CLIENT_FAULTS = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.NOT_FOUND}
INT32 = st.integers(-(2**31), 2**31 - 1)
FLOATS = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, 0.5, 1.0, 2.0, -1.0])
TEXT = st.text(max_size=24) | st.sampled_from(["", "x", "def f(x):", "\x00", "é漢字🙂", "\r\n\t"])


NAMED = st.text(min_size=1, max_size=24)
# constrained decoding (issue 69): constraints the server compiles, or Constraint() (no kind: free text) ...
GOOD_CONSTRAINTS = st.sampled_from([
    pb.Constraint(), pb.Constraint(regex="[a-z ]+"), pb.Constraint(choice=pb.Choices(choices=["yes", "no"])),
    pb.Constraint(json_object=True), pb.Constraint(json_schema='{"type": "integer"}'),
    pb.Constraint(grammar='start: "a"+ " " "b"\n'),
])
BROKEN = st.sampled_from(["", "{", "(", "[a-", "start: (", '{"type": "nonsense"}', "{}", "a" * 70_000])


@st.composite
def wild_constraints(draw: st.DrawFn) -> pb.Constraint:
    """... or any value of any kind: mostly refused (INVALID_ARGUMENT naming constraint.KIND), never a fault."""
    kind = draw(st.sampled_from(["json_schema", "json_object", "regex", "choice", "grammar"]))
    if kind == "json_object":
        return pb.Constraint(json_object=draw(st.booleans()))
    if kind == "choice":
        return pb.Constraint(choice=pb.Choices(choices=draw(st.lists(TEXT | BROKEN, max_size=3))))
    return pb.Constraint(**{kind: draw(TEXT | BROKEN)})


# field -> (values the server should take, anything of the field's type)
FIELDS: dict[str, tuple[st.SearchStrategy, st.SearchStrategy]] = {
    "model": (st.sampled_from(["", "smollm2-135m"]), TEXT),
    "request_id": (st.just(""), TEXT),  # "" = the server names it (fuzzed ids could repeat)
    "stop": (st.lists(NAMED, max_size=2), st.lists(TEXT, max_size=2)),
    "ignore_eos": (st.booleans(), st.booleans()),
    "contract": (st.sampled_from(["", "exact", "typical"]), st.sampled_from(["greedy", "Exact"]) | TEXT),
    "draft": (st.sampled_from(["", "model", "ngram", "none"]), TEXT),
    "temperature": (st.floats(0.0, 2.0), FLOATS),
    "top_p": (st.floats(0.01, 1.0), FLOATS),
    "min_p": (st.floats(0.0, 1.0), FLOATS),
    "repetition_penalty": (st.floats(0.5, 2.0), FLOATS),
    "presence_penalty": (st.floats(-2.0, 2.0), FLOATS),
    "frequency_penalty": (st.floats(-2.0, 2.0), FLOATS),
    "top_k": (st.integers(0, 50), INT32),
    "seed": (st.integers(-(2**63), 2**63 - 1), st.integers(-(2**63), 2**63 - 1)),
    "k": (st.integers(0, 8), INT32),
    "n": (st.integers(1, 3), INT32),
    # valid lengths stay short (a long one would only slow the run); the wild ones are mostly refused
    "max_tokens": (st.integers(1, 6), st.integers(-2, 0) | st.sampled_from([300, 8193, 2**31 - 1, -(2**31)])),
    "constraint": (GOOD_CONSTRAINTS, wild_constraints()),
    # SmolLM2's vocabulary is 49152 ids
    "logit_bias": (st.dictionaries(st.integers(0, 49_151), st.floats(-100.0, 100.0), max_size=3),
                   st.dictionaries(INT32, FLOATS, max_size=3)),
    # log-probabilities (issue 70): echo allows max_tokens 0
    "logprobs": (st.integers(0, 20), INT32),
    "echo": (st.booleans(), st.booleans()),
    "logprobs_mode": (st.sampled_from(["", "raw", "processed"]), TEXT),
}
OPTIONAL = {"temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "top_k",
            "seed", "k", "n", "max_tokens", "constraint", "logit_bias", "logprobs", "echo", "logprobs_mode"}


@st.composite
def generate_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    """A valid request with up to two fields (and the prompt) possibly wild: shrinks towards a valid one."""
    wild = draw(st.sets(st.sampled_from([*FIELDS, "prompt"]), max_size=2))
    request = pb.GenerateRequest()
    shape = draw(st.sampled_from(["text", "token_ids", "chat"]))
    if "prompt" in wild:
        shape = draw(st.sampled_from(["text", "token_ids", "chat", "none", "chat+ids"]))
    if shape in ("text", "chat"):
        request.text = draw(TEXT if "prompt" in wild else NAMED)
    if shape in ("token_ids", "chat+ids"):
        ids = st.lists(st.integers(-5, 60_000) | INT32, max_size=12) if "prompt" in wild else \
            st.lists(st.integers(0, 49_151), min_size=1, max_size=12)
        request.token_ids.ids.extend(draw(ids))
    if shape.startswith("chat"):
        request.chat = True
        roles = st.sampled_from(["user", "system", "assistant", "tool", ""]) if "prompt" in wild else st.just("user")
        for role, content in draw(st.lists(st.tuples(roles, TEXT if "prompt" in wild else NAMED), max_size=2)):
            request.messages.add(role=role, content=content)
    for name, (good, anything) in FIELDS.items():
        if name in OPTIONAL and name not in wild and not draw(st.booleans()):
            continue  # unset: the server's default
        value = draw(anything if name in wild else good)
        if name == "stop":
            request.stop.extend(value)
        elif name == "constraint":
            request.constraint.CopyFrom(value)
        elif name == "logit_bias":
            request.logit_bias.update(value)
        else:
            setattr(request, name, value)
    return request


@st.composite
def corrupted(draw: st.DrawFn) -> bytes:
    data = draw(generate_requests()).SerializeToString()
    how = draw(st.sampled_from(["garbage", "truncate", "flip", "bad-utf8"]))
    if how == "garbage" or not data:
        return draw(st.binary(min_size=1, max_size=64))
    if how == "truncate":
        return data[:draw(st.integers(0, len(data) - 1))]
    if how == "flip":
        at = draw(st.integers(0, len(data) - 1))
        return data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1:]
    text = pb.GenerateRequest(text="ab", max_tokens=2).SerializeToString()
    return text.replace(b"ab", draw(st.sampled_from([b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80"])))  # \xed\xa0\x80 = U+D800


def call(channel: grpc.Channel, data: bytes) -> grpc.StatusCode:
    generate = channel.unary_stream(f"/{SERVICE_NAME}/Generate")  # bytes as they are
    try:
        for _ in generate(data, timeout=120):
            pass
    except grpc.RpcError as error:
        assert error.code() in CLIENT_FAULTS, (data, error.code(), error.details())
        assert "Traceback" not in (error.details() or "")
        return error.code()
    return grpc.StatusCode.OK


def test_fuzzed_requests_answer_ok_or_a_client_fault(cluster: ClusterConfig, client: SpecServeClient) -> None:
    seen: dict[grpc.StatusCode, int] = {}
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as channel:
        @settings(max_examples=120, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(data=generate_requests().map(lambda r: r.SerializeToString()) | corrupted())
        def fuzz(data: bytes) -> None:
            code = call(channel, data)
            seen[code] = seen.get(code, 0) + 1

        fuzz()
    assert seen.get(grpc.StatusCode.OK, 0) > 0 and seen.get(grpc.StatusCode.INVALID_ARGUMENT, 0) > 0, seen
    assert client.health() == (True, "ok")
    assert_no_leaks()
