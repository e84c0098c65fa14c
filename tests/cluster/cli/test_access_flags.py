"""The access flags of the command line: the client credential flags (cluster/cli/client_flags.py) on every
command with --server, `specserve up`'s server flags, and the line that says where the Ray token is."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from cluster.cli.client_flags import apply_client_flags
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
