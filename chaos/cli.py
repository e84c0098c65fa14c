"""`specserve chaos run | list`: a plugin subcommand (cluster/cli/main.py imports this module by name, so
`cluster` never imports `chaos` statically).

    specserve chaos list
    specserve chaos run [--scenario NAME ...] [--duration S] [--trials N] [--seed S] [--json-out PATH]

`run` needs the loopback network namespace: outside it, it re-executes itself under scripts/in-netns.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
IN_NETNS = REPO / "scripts" / "in-netns.sh"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("chaos", help="fault-injection runs under load (README: Chaos runs)")
    sub = parser.add_subparsers(dest="chaos_command", required=True)
    sub.add_parser("list", help="the scenarios (chaos/experiments/*.json)")
    run = sub.add_parser("run", help="run scenarios against a local cluster and write the report")
    run.add_argument("--scenario", action="append", default=None,
                     help="a scenario's name (its experiment file's stem); repeatable; default: all but the "
                          "negative control")
    run.add_argument("--smoke", action="store_true", help="the smoke subset (the test suite's three)")
    run.add_argument("--duration", type=float, default=20.0, help="seconds of load after the faults per scenario")
    run.add_argument("--trials", type=int, default=1)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--concurrency", type=int, default=4)
    run.add_argument("--out-dir", default="bench_results/chaos", help="report.json/.md, timeline.png, journals/")
    run.add_argument("--json-out", default=None, help="also write the JSON report here")
    run.add_argument("--qwen", action="store_true", help="the Qwen2.5-Coder 1.5B/0.5B pair instead of SmolLM2")
    return parser


def run(args: argparse.Namespace) -> int:
    from chaos.runner import SMOKE, load_experiment, scenario_names

    if args.chaos_command == "list":
        for name in scenario_names():
            experiment = load_experiment(name)
            print(f"{name:18s} {','.join(experiment.get('tags', [])[1:]):16s} {experiment['title']}")
        return 0
    if not os.environ.get("SPECSERVE_IN_NETNS") and IN_NETNS.exists():
        os.execv(str(IN_NETNS), [str(IN_NETNS), sys.executable, "-m", "cluster.cli", *sys.argv[1:]])
    from chaos.runner import run_matrix

    names = args.scenario or (list(SMOKE) if args.smoke else
                              [n for n in scenario_names() if "control" not in load_experiment(n).get("tags", [])])
    overrides = {"model": "qwen2.5-coder-1.5b", "draft": "qwen2.5-coder-0.5b"} if args.qwen else {}
    chaos = run_matrix(names, duration=args.duration, trials=args.trials, seed=args.seed, out_dir=Path(args.out_dir),
                       progress=lambda line: print(line, file=sys.stderr, flush=True),
                       concurrency=args.concurrency, **overrides)
    print((chaos.out_dir / "report.md").read_text())
    if args.json_out:
        Path(args.json_out).write_text((chaos.out_dir / "report.json").read_text())
    print(json.dumps({"ok": chaos.ok, "faults": sum(len(s.faults) for s in chaos.scenarios),
                      "report": str(chaos.out_dir)}))
    return 0 if chaos.ok else 1
