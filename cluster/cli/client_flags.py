"""The credential flags of every command that talks to a running cluster (generate / bench serve / check exact
--server; chaos reads the same variables). Each flag sets the environment variable `Credentials.from_env()`
reads (cluster/client.py), so every client this process makes, and its children, present the same credentials:

    --api-key-file PATH   SPECSERVE_API_KEY_FILE  (the file's first key; or SPECSERVE_API_KEY holds the key itself)
    --tls                 SPECSERVE_TLS=1         (TLS, trusting the system roots)
    --tls-ca-file PATH    SPECSERVE_TLS_CA_FILE   (TLS, trusting the PEM roots in PATH: a self-signed certificate)

No flag takes a key itself: a key on the command line lands in the shell history and in `ps`. Every `specserve`
parser is a `SecretSafeParser`: no abbreviated long options, and no error that repeats a value it did not understand
(`--api-ke=KEY`, `--apikey KEY`).
"""

from __future__ import annotations

import argparse
import os
from typing import NoReturn

from cluster.client import ENV_API_KEY_FILE, ENV_TLS, ENV_TLS_CA_FILE, Credentials

KEY_ON_COMMAND_LINE = ("--api-key is refused: a key on the command line lands in the shell history and in `ps`; "
                       "put it in a file (--api-key-file PATH) or in SPECSERVE_API_KEY")


class SecretSafeParser(argparse.ArgumentParser):
    """The class of every `specserve` parser (the root's; `add_subparsers` hands it to every subcommand's): long
    options are never abbreviated (`allow_abbrev=False`: `--api-ke KEY` cannot become `--api-key-file KEY`), and an
    error names the options it did not understand without the values that came with them (argparse would print
    `unrecognized arguments: --api-ke=KEY`, the key included)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        super().error(redact_argparse_error(message))


UNRECOGNIZED = "unrecognized arguments: "


def redact_argparse_error(message: str) -> str:
    """argparse's error without the values the user typed where no option takes them: unrecognized arguments keep
    their option names (cut at `=`), an ambiguous option its name, an ignored explicit argument nothing."""
    if message.startswith(UNRECOGNIZED):
        words = message[len(UNRECOGNIZED):].split(" ")
        names = [word.split("=", 1)[0] for word in words if word.startswith("-")]
        hidden = sum(1 for word in words if not word.startswith("-") or "=" in word)
        note = f"{hidden} value{'s' if hidden != 1 else ''} not shown" if hidden else ""
        return UNRECOGNIZED + " ".join(names) + (f" ({note})" if names and note else note)
    if message.startswith("ambiguous option: ") and " could match " in message:
        option, matches = message[len("ambiguous option: "):].split(" could match ", 1)
        return f"ambiguous option: {option.split('=', 1)[0]} could match {matches}"
    if ": ignored explicit argument " in message:
        return message.split(": ignored explicit argument ", 1)[0] + ": ignored explicit argument (not shown)"
    return message


class _RefuseKey(argparse.Action):
    """`--api-key KEY`: refused without repeating the key (argparse would otherwise read it as an abbreviation of
    --api-key-file and echo the key as a path it cannot read)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        parser.error(KEY_ON_COMMAND_LINE)


def refuse_key_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument("--api-key", action=_RefuseKey, nargs="?", help=argparse.SUPPRESS)


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("credentials of a --server (docs/security.md)")
    refuse_key_flag(group)
    group.add_argument("--api-key-file", default=None, metavar="PATH",
                       help=f"send the first API key in PATH (or set SPECSERVE_API_KEY / {ENV_API_KEY_FILE})")
    group.add_argument("--tls", action="store_true", help=f"connect with TLS, system roots ({ENV_TLS}=1)")
    group.add_argument("--tls-ca-file", default=None, metavar="PATH",
                       help=f"connect with TLS trusting the PEM certificates in PATH ({ENV_TLS_CA_FILE})")


def apply_client_flags(args: argparse.Namespace) -> Credentials:
    """Export the flags given to this process's environment; returns the credentials now in force (reading the
    key file now, so a missing file fails before any call)."""
    if args.api_key_file:
        os.environ[ENV_API_KEY_FILE] = args.api_key_file
    if args.tls:
        os.environ[ENV_TLS] = "1"
    if args.tls_ca_file:
        os.environ[ENV_TLS_CA_FILE] = args.tls_ca_file
    try:
        return Credentials.from_env()
    except OSError as exc:
        raise SystemExit(f"error: cannot read {exc.filename}: {exc.strerror}") from None
