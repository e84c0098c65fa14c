"""The constrained-decoding flags of `specserve generate` and `specserve check exact` (cluster/cli/constraint_flags.py):
each flag -> the GenerationRequest built in process, the same request through --server (gRPC), the check's settings;
at most one constraint; bad values a one-line error naming the flag, before any model loads."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

import cluster.check.exact as check_exact
import cluster.cli.generate_remote as generate_remote
from cluster.cli.constraint_flags import constraint_from_args, logit_bias_from_args
from cluster.cli.generate import build_requests
from cluster.cli.main import build_parser, main
from cluster.client import build_request
from specserve_types.api import Constraint, GenerationRequest, TokenChunk
from specserve_types.protocol import JSON_OBJECT_SCHEMA, IndexedChunk, ServerDefaults, args_from_proto

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}}, "required": ["color"]}
GRAMMAR = 'start: "yes" | "no"\n'


def generate_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["generate", "hello", "--model", "smollm2-135m", *flags])


def requests_for(*flags: str) -> list[GenerationRequest]:
    return build_requests(generate_args(*flags), [1, 2, 3], "ngram")


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    schema, grammar = tmp_path / "schema.json", tmp_path / "yes_no.lark"
    schema.write_text(json.dumps(SCHEMA))
    grammar.write_text(GRAMMAR)
    return {"schema": str(schema), "grammar": str(grammar)}


@pytest.mark.parametrize(
    ("flags", "kind", "value"),
    [
        (("--json-schema", "{schema}"), "json", json.dumps(SCHEMA)),
        (("--json-schema", '{"type": "integer"}'), "json", '{"type": "integer"}'),
        (("--json-object",), "json", JSON_OBJECT_SCHEMA),
        (("--regex", "[0-9]{3}"), "regex", "[0-9]{3}"),
        (("--choice", "red", "--choice", "green"), "choice", '["red", "green"]'),
        (("--choice", '["red", "green"]'), "choice", '["red", "green"]'),
        (("--choice", "only"), "choice", '["only"]'),
        (("--grammar", "{grammar}"), "grammar", GRAMMAR),
    ],
)
def test_each_constraint_flag_builds_the_request(files: dict[str, str], flags: tuple[str, ...], kind: str,
                                                 value: str) -> None:
    flags = tuple(files[flag[1:-1]] if flag in ("{schema}", "{grammar}") else flag for flag in flags)
    requests = requests_for(*flags, "--n", "2")
    assert len(requests) == 2
    for request in requests:  # each completion carries the constraint (the engine keeps a state per completion)
        assert request.constraint is not None
        assert (request.constraint.kind, request.constraint.value) == (kind, value)
        assert request.constraint.field == flags[0]  # the engine's errors name the flag
        assert request.sampling.logit_bias == ()


def test_no_flag_is_free_text() -> None:
    (request,) = requests_for()
    assert request.constraint is None and request.sampling.logit_bias == ()


@pytest.mark.parametrize(
    "flags",
    [("--logit-bias", "50=-100", "--logit-bias", "3=2.5"), ("--logit-bias", '{"50": -100, "3": 2.5}')],
)
def test_logit_bias_flags(flags: tuple[str, ...]) -> None:
    (request,) = requests_for(*flags, "--regex", "a+")
    assert request.sampling.logit_bias == ((3, 2.5), (50, -100.0))
    assert request.constraint == Constraint("regex", "a+", "--regex")


@pytest.mark.parametrize(
    "flags",
    [("--regex", "a", "--choice", "b"), ("--json-object", "--grammar", "g.lark"), ("--json-schema", "{}", "--regex", "a")],
)
def test_at_most_one_constraint_flag(flags: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        generate_args(*flags)
    assert info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (("--json-schema", "/no/such/schema.json"), "--json-schema: cannot read /no/such/schema.json"),
        (("--json-schema", "{oops"), "--json-schema: is not valid JSON"),
        (("--grammar", "/no/such.lark"), "--grammar: cannot read"),
        (("--regex", ""), "--regex: must be non-empty"),
        (("--choice", "[1, 2]"), "--choice: choice 0 must be a non-empty string"),
        (("--choice", "[oops"), "--choice: one value starting with '[' must be a JSON list"),
        (("--logit-bias", "50"), "--logit-bias: expected ID=BIAS"),
        (("--logit-bias", "x=1"), "--logit-bias: expected ID=BIAS"),
        (("--logit-bias", "50=300"), "--logit-bias: bias of token 50 must be in [-100, 100]"),
        (("--logit-bias", "50=nan"), "--logit-bias: bias of token 50 must be a finite number"),
        (("--logit-bias=-1=1",), "--logit-bias: token ids must be integers >= 0"),
        (("--logit-bias", "1=1", "--logit-bias", "1=2"), "--logit-bias: token 1 given twice"),
        (("--logit-bias", "[1]"), "--logit-bias: expected ID=BIAS"),
        (("--logit-bias", '{"a": 1}'), "--logit-bias: token ids must be integers"),
    ],
)
def test_bad_flags_are_one_line_errors_before_anything_loads(flags: tuple[str, ...], says: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    # a model that does not exist: the flags are refused before it is looked for
    assert main(["generate", "hello", "--model", "no-such-model", "--draft", "ngram", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {says}"), err
    assert err.count("\n") == 1


class FakeClient:
    """SpecServeClient's interface for generate_via_server: the request it would send, and a stream back."""

    sent: list[Any] = []

    def __init__(self, address: str, credentials: Any = None) -> None:
        pass

    def __enter__(self) -> FakeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def generate(self, prompt: str, **fields: Any) -> list[IndexedChunk]:
        FakeClient.sent.append(build_request(prompt, **fields))
        return [IndexedChunk(0, TokenChunk("r", [7, 8], '{"', proposed=3, accepted=2, forced=1), "greedy"),
                IndexedChunk(0, TokenChunk("r", [9], "}", proposed=1, accepted=1, forced=1, finish_reason="stop",
                                           stats={}), "greedy")]

    def stats(self) -> dict[str, Any]:
        return {"engine": {}}


def test_server_gets_the_same_constraint_and_json_shows_forced(monkeypatch: pytest.MonkeyPatch,
                                                               files: dict[str, str],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(generate_remote, "SpecServeClient", FakeClient)
    FakeClient.sent = []
    assert main(["generate", "hello", "--server", "127.0.0.1:1", "--json", "--json-schema", files["schema"],
                 "--logit-bias", "5=-100"]) == 0
    (sent,) = FakeClient.sent
    args = args_from_proto(sent, ServerDefaults("m"))
    local = build_requests(generate_args("--json-schema", files["schema"], "--logit-bias", "5=-100"), [1], "ngram")[0]
    assert args.constraint is not None and local.constraint is not None
    assert (args.constraint.kind, args.constraint.value) == (local.constraint.kind, local.constraint.value)
    assert args.sampling.logit_bias == local.sampling.logit_bias == ((5, -100.0),)
    out = json.loads(capsys.readouterr().out)
    assert out["samples"] == [{"token_ids": [7, 8, 9], "text": '{"}', "finish_reason": "stop", "proposed": 4,
                               "accepted": 3, "forced": 2}]


def test_check_exact_takes_the_same_flags(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`check exact --choice ... --logit-bias ...`: the settings carry the constraint (its requests' and the
    reference's mask) and the bias (in the sampling the requests and the reference share)."""
    seen: dict[str, Any] = {}

    class Report:
        exit_code = 0

        def render(self, decode: Any) -> str:
            return "report"

    def fake_check(model: str, draft: str, prompts: list[str], settings: Any, **kwargs: Any) -> tuple[Any, Any]:
        seen["settings"] = settings
        return Report(), None

    monkeypatch.setattr(check_exact, "check_in_process", fake_check)
    assert main(["check", "exact", "--choice", " red", "--choice", " green", "--logit-bias", "11=-5",
                 "--n", "10"]) == 0
    settings = seen["settings"]
    assert settings.constraint == Constraint("choice", '[" red", " green"]', "--choice")
    assert settings.logit_bias == ((11, -5.0),) and settings.sampling(3).logit_bias == ((11, -5.0),)
    assert main(["check", "exact", "--regex", ""]) == 2
    assert "error: --regex: must be non-empty" in capsys.readouterr().err


def test_flag_helpers_read_a_namespace() -> None:
    args = generate_args("--choice", "a", "--logit-bias", "1=0.5")
    assert constraint_from_args(args) == Constraint("choice", '["a"]', "--choice")
    assert logit_bias_from_args(args) == ((1, 0.5),)
