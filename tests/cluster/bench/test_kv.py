"""`specserve bench kv` stays runnable: small sizes, JSON-able figures, the ledger and the actor
leak-free after it (the bench asserts both), and the CLI writes the same figures it prints.

Run under scripts/in-netns.sh (loopback only); Ray starts once per session (`ray_session`).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from cluster.bench.kv import run_bench
from cluster.cli import main


def test_run_bench_returns_json_able_figures(ray_session: ModuleType) -> None:
    figures = run_bench(batch_size=8, ledger_rounds=20, actor_rounds=5)
    assert json.loads(json.dumps(figures)) == figures
    assert figures["ledger"]["request_rounds_per_s"] > 0 and figures["ledger"]["rounds"] == 20
    assert figures["actor"]["round_trip_ms_p50"] > 0 and figures["actor"]["rounds"] == 5
    assert figures["actor"]["empty_call_ms_p50"] > 0 and figures["actor"]["batch_size"] == 8


def test_bench_kv_cli_ledger_only_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "kv.json"
    assert main(["bench", "kv", "--no-actor", "--json-out", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert set(figures) == {"ledger"} and figures["ledger"]["batch_size"] == 64
    printed = capsys.readouterr().out
    assert printed.startswith("kv_manager bench: batch 64, k 4") and "ledger reserve+commit" in printed
    assert "actor" not in printed
