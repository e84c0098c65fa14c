"""`specserve` command line: one thin dispatcher; each subcommand lives in its own module.

    specserve models list | prepare [NAME...]     -> model_runtime.cli_models
    specserve generate "PROMPT" [flags]           -> cluster.cli_generate
    specserve bench runtime | spec | serve        -> cluster.cli_bench
    specserve up [--config FILE]                  -> cluster.cli_up
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand name -> module exposing add_parser(subparsers) and run(args) -> int
SUBCOMMANDS: dict[str, str] = {
    "models": "model_runtime.cli_models",
    "generate": "cluster.cli_generate",
    "bench": "cluster.cli_bench",
    "up": "cluster.cli_up",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in SUBCOMMANDS.values():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue  # subcommand not built yet
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
