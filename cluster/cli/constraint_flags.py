"""The constrained-decoding flags of `specserve generate` and `specserve check exact` (docs/api.md):

    --json-schema FILE    a JSON Schema (FILE, or the schema's JSON itself when it starts with '{')
    --json-object         any JSON object (OpenAI's json_object)
    --regex REGEX         the whole output matches REGEX (llguidance's regex syntax)
    --choice A --choice B the output is one of the strings (repeatable, or one JSON list: --choice '["A", "B"]')
    --grammar FILE        a grammar in llguidance's Lark syntax (FILE holds it; a `start` rule)
    --logit-bias ID=BIAS  add BIAS in [-100, 100] to token ID's raw logit (repeatable, or one JSON object:
                          --logit-bias '{"50256": -100}')

At most one constraint flag. A bad value is an InvalidRequestError naming the flag: one line, exit status 2.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specserve_types.api import Constraint, InvalidRequestError, SamplingParams
from specserve_types.protocol import (
    JSON_OBJECT_SCHEMA,
    choice_constraint,
    json_schema_constraint,
    logit_bias_pairs,
)


def add_constraint_flags(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("constrained decoding (at most one constraint; docs/api.md)")
    one = group.add_mutually_exclusive_group()
    one.add_argument("--json-schema", metavar="FILE", default=None,
                     help="the output is JSON valid under this JSON Schema: a file, or the schema itself when it "
                          "starts with '{' ('{}': any JSON value)")
    one.add_argument("--json-object", action="store_true", help="the output is a JSON object (OpenAI's json_object)")
    one.add_argument("--regex", metavar="REGEX", default=None,
                     help="the whole output matches this regular expression (llguidance's syntax)")
    one.add_argument("--choice", metavar="TEXT", action="append", default=None,
                     help="the output is exactly one of these strings (repeatable, or one JSON list)")
    one.add_argument("--grammar", metavar="FILE", default=None,
                     help="the output follows this grammar, a file in llguidance's Lark syntax (a `start` rule)")
    group.add_argument("--logit-bias", metavar="ID=BIAS", action="append", default=None,
                       help="add BIAS (in [-100, 100]; -100 bans the token) to token ID's raw logit, as OpenAI's "
                            "logit_bias (repeatable, or one JSON object {\"ID\": BIAS})")


def _read(flag: str, path: str) -> str:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(flag, f"cannot read {path}: {exc}") from None


def _choices(values: list[str]) -> list[str]:
    if len(values) == 1 and values[0].lstrip().startswith("["):
        try:
            parsed = json.loads(values[0])
        except ValueError as exc:
            raise InvalidRequestError("--choice", f"one value starting with '[' must be a JSON list: {exc}") from None
        if not isinstance(parsed, list):
            raise InvalidRequestError("--choice", "must be a JSON list of strings")
        return parsed
    return values


def constraint_from_args(args: argparse.Namespace) -> Constraint | None:
    """The request's constraint from the flags (None: free text)."""
    if args.json_schema is not None:
        text = args.json_schema if args.json_schema.lstrip().startswith("{") else _read("--json-schema",
                                                                                         args.json_schema)
        return json_schema_constraint(text, "--json-schema")
    if args.json_object:
        return Constraint("json", JSON_OBJECT_SCHEMA, "--json-object")
    if args.regex is not None:
        if not args.regex:
            raise InvalidRequestError("--regex", "must be non-empty")
        return Constraint("regex", args.regex, "--regex")
    if args.choice is not None:
        return choice_constraint(_choices(args.choice), "--choice")
    if args.grammar is not None:
        text = _read("--grammar", args.grammar)
        if not text.strip():
            raise InvalidRequestError("--grammar", f"{args.grammar} is empty")
        return Constraint("grammar", text, "--grammar")
    return None


def logit_bias_from_args(args: argparse.Namespace) -> tuple[tuple[int, float], ...]:
    """SamplingParams.logit_bias from the --logit-bias flags (ID=BIAS pairs, or one JSON object), in bounds."""
    pairs = _logit_bias(args.logit_bias or [])
    try:
        SamplingParams(logit_bias=pairs)
    except InvalidRequestError as exc:
        raise InvalidRequestError("--logit-bias", exc.message) from None
    return pairs


def check_constraint_flags(args: argparse.Namespace) -> None:
    """Refuse bad constraint flags before anything is loaded (files read, JSON parsed, bounds checked)."""
    constraint_from_args(args)
    logit_bias_from_args(args)


def _logit_bias(values: list[str]) -> tuple[tuple[int, float], ...]:
    if len(values) == 1 and values[0].lstrip().startswith("{"):
        try:
            parsed = json.loads(values[0])
        except ValueError as exc:
            raise InvalidRequestError("--logit-bias", f"a value starting with '{{' must be a JSON object: {exc}") \
                from None
        if not isinstance(parsed, dict):
            raise InvalidRequestError("--logit-bias", "must be a JSON object {\"ID\": BIAS}")
        return logit_bias_pairs(parsed, "--logit-bias")
    pairs = []
    for value in values:
        token, sep, bias = value.partition("=")
        try:
            pairs.append((int(token), float(bias)))
        except ValueError:
            raise InvalidRequestError("--logit-bias", f"expected ID=BIAS (e.g. 50256=-100), got {value!r}") from None
        if not sep:
            raise InvalidRequestError("--logit-bias", f"expected ID=BIAS (e.g. 50256=-100), got {value!r}")
    return logit_bias_pairs(pairs, "--logit-bias")
