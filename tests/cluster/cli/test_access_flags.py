"""The access flags of the command line: the client credential flags (cluster/cli/client_flags.py) on every
command with --server, `specserve up`'s server flags, and the line that says where the Ray token is."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from cluster.cli.client_flags import apply_client_flags, redact_argparse_error
from cluster.cli.main import build_parser
from cluster.cli.up import ray_auth_note
from cluster.cli.up_once import own_credentials
from cluster.client import ENV_API_KEY, ENV_API_KEY_FILE, ENV_TLS, ENV_TLS_CA_FILE, Credentials
from cluster.serving.config import load_config

KEY = "sk-cli-0123456789abcdef"


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No credential variables, and none left behind: apply_client_flags exports the flags to os.environ, so each
    name is recorded (set, then deleted) for monkeypatch to remove after the test (a later test's clients would
    otherwise read them)."""
    for name in (ENV_API_KEY, ENV_API_KEY_FILE, ENV_TLS, ENV_TLS_CA_FILE, "SPECSERVE_API_KEYS"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


@pytest.mark.parametrize("argv", [["generate", "x", "--server", "h:1"], ["bench", "serve", "--server", "h:1"],
                                  ["check", "exact", "--server", "h:1"]])
def test_every_server_command_takes_the_credential_flags(argv: list[str], tmp_path: Path, clean_env: None) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(f"{KEY}\n")
    args = build_parser().parse_args([*argv, "--api-key-file", str(key_file), "--tls-ca-file", "/ca.pem"])
    assert apply_client_flags(args) == Credentials(KEY, tls=True, ca_file="/ca.pem")
    assert Credentials.from_env() == Credentials(KEY, tls=True, ca_file="/ca.pem")  # clients made later agree


def test_a_missing_key_file_fails_before_any_call(clean_env: None) -> None:
    args = argparse.Namespace(api_key_file="/nonexistent/key", tls=False, tls_ca_file=None)
    with pytest.raises(SystemExit, match="cannot read /nonexistent/key"):
        apply_client_flags(args)


def test_up_takes_key_file_and_tls_and_once_uses_them(tmp_path: Path, clean_env: None) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text(f"{KEY}\nsk-second-0123456789\n")
    args = build_parser().parse_args(["up", "--api-key-file", str(key_file), "--tls-cert-file", "c.pem",
                                      "--tls-key-file", "k.pem"])
    assert (args.api_key_file, args.tls_cert_file, args.tls_key_file) == (str(key_file), "c.pem", "k.pem")
    config = load_config(None, api_key_file=str(key_file), tls_cert_file="c.pem", tls_key_file="k.pem")
    assert own_credentials(config) == Credentials(KEY, tls=True, ca_file="c.pem")
    with pytest.raises(ValueError, match="tls_cert_file and tls_key_file go together"):
        load_config(None, tls_cert_file="c.pem")


def test_ray_auth_note_says_where_the_token_is() -> None:
    assert ray_auth_note({"RAY_AUTH_MODE": "disabled"}).startswith("off (RAY_AUTH_MODE=disabled)")
    assert ray_auth_note({}).startswith("off")
    assert "RAY_AUTH_TOKEN variable" in ray_auth_note({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "t" * 32})
    assert "t" * 32 not in ray_auth_note({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "t" * 32})
    assert "/secrets/ray" in ray_auth_note({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "/secrets/ray"})
    assert ray_auth_note({"RAY_AUTH_MODE": "token"}).startswith(f"token in {Path.home() / '.ray' / 'auth_token'}")


@pytest.mark.parametrize("argv", [["generate", "x", "--server", "h:1"], ["bench", "serve", "--server", "h:1"],
                                  ["check", "exact", "--server", "h:1"], ["up"]])
def test_a_key_on_the_command_line_is_refused_without_echoing_it(argv: list[str],
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`--api-key KEY` (which argparse would read as --api-key-file KEY and echo as an unreadable path): exit 2,
    saying where keys go, and the key nowhere in the output."""
    for flag in (["--api-key", KEY], [f"--api-key={KEY}"]):
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args([*argv, *flag])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "--api-key-file PATH" in err and KEY not in err


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _parsers(sub)
    return found


def test_no_parser_takes_an_abbreviation() -> None:
    parsers = _parsers(build_parser())
    assert {"specserve up", "specserve bench serve", "specserve check exact", "specserve generate"} <= {
        p.prog for p in parsers}
    assert [p.prog for p in parsers if p.allow_abbrev] == []


@pytest.mark.parametrize("argv", [["generate", "x", "--server", "h:1"], ["bench", "serve", "--server", "h:1"],
                                  ["check", "exact", "--server", "h:1"], ["up"]])
def test_an_abbreviated_or_misspelt_key_flag_is_an_error_without_the_key(argv: list[str],
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """`--api-ke=KEY` (argparse would print it back in 'ambiguous option' or 'unrecognized arguments'), and the
    misspellings a key lands behind: exit 2, the option named, the key nowhere."""
    tls = "--tls-key-fil" if argv == ["up"] else "--tls-ca"
    for flag in ([f"--api-ke={KEY}"], ["--api-ke", KEY], [f"--apikey={KEY}"], ["--api_key", KEY],
                 [f"--api-key-fil={KEY}"], [f"{tls}={KEY}"], ["--api-ke", KEY, "--api-k", KEY]):
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args([*argv, *flag])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert KEY not in err and flag[0].split("=")[0] in err, err
        assert "not shown" in err


def test_a_harmless_abbreviation_is_an_error_too(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--verb"])
    assert "unrecognized arguments: --verb" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", f"-v{KEY}"])  # a short flag's glued value
    assert KEY not in capsys.readouterr().err


def test_argparse_errors_redacted() -> None:
    assert redact_argparse_error(f"unrecognized arguments: --api-ke={KEY} {KEY} -x") == (
        "unrecognized arguments: --api-ke -x (2 values not shown)")
    assert redact_argparse_error(f"unrecognized arguments: {KEY}") == "unrecognized arguments: 1 value not shown"
    assert redact_argparse_error(f"ambiguous option: --api-k={KEY} could match --api-key, --api-key-file") == (
        "ambiguous option: --api-k could match --api-key, --api-key-file")
    assert redact_argparse_error("argument --max-tokens: invalid int value: 'x'") == (
        "argument --max-tokens: invalid int value: 'x'")  # a value of a known option stays
