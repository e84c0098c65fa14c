"""`specserve` command line: one thin dispatcher; each subcommand lives in its own module.

    specserve models list | prepare [NAME...]     -> cluster.cli.models
    specserve generate "PROMPT" [flags]           -> cluster.cli.generate
    specserve bench runtime | spec | serve        -> cluster.cli.bench
    specserve up [--config FILE]                  -> cluster.cli.up
    specserve check exact [flags]                 -> cluster.cli.check
    specserve kernels                             -> cluster.cli.kernels
    specserve chaos run | list                    -> chaos.cli (a plugin: imported by name, see PLUGINS)
"""

from __future__ import annotations

import argparse
import importlib
import sys

from cluster.cli.client_flags import SecretSafeParser

# subcommand name -> module exposing add_parser(subparsers) and run(args) -> int
SUBCOMMANDS: dict[str, str] = {
    "models": "cluster.cli.models",
    "generate": "cluster.cli.generate",
    "bench": "cluster.cli.bench",
    "up": "cluster.cli.up",
    "check": "cluster.cli.check",
    "kernels": "cluster.cli.kernels",
}
# plugin subcommands from packages above `cluster` (imported dynamically: cluster never imports them statically)
PLUGINS: dict[str, str] = {"chaos": "chaos.cli"}


def build_parser() -> argparse.ArgumentParser:
    # every parser below is a SecretSafeParser (no abbreviations, no value repeated in an error): add_subparsers
    # makes each subcommand's parser, and theirs, of the root's class
    parser = SecretSafeParser(prog="specserve", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in [*SUBCOMMANDS.values(), *PLUGINS.values()]:
        module = importlib.import_module(module_name)
        sub = module.add_parser(subparsers)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
