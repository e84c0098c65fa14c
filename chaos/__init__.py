"""Chaos runs: chaostoolkit experiments (chaos/experiments/*.json) that inject faults into a live specserve
cluster under steady load and check that nothing is lost, leaked or changed (docs/chaos.md).

    cluster.py     the cluster a run deploys (SmolLM2-135M drafting for itself), Serve handles, idle/health waits
    state.py       the run's shared state: the cluster's addresses, the load, the fault log
    load.py        the bounded load generator (gRPC + HTTP, deadlines, every chunk recorded)
    actions.py     the experiments' actions: start/stop load, kills by PID or Ray's API, injected faults
    probes.py      the steady-state probes: the cluster answers, the KV ledger is clean
    invariants.py  what must hold after every scenario
    report.py      figures per scenario: JSON, markdown table, PNG timeline
    runner.py      runs experiments with chaoslib, keeps their journals
    cli.py         `specserve chaos run | list` (a plugin subcommand of cluster/cli/main.py)

This package imports `cluster`; nothing in `cluster` imports it (pyproject.toml's layers contract).
"""
