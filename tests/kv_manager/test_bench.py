"""The benchmark stays runnable: small sizes, JSON-able figures, and the ledger leak-free after it."""

from __future__ import annotations

import json
from types import ModuleType

from kv_manager.bench import run_bench


def test_run_bench_returns_json_able_figures(ray_session: ModuleType) -> None:
    figures = run_bench(batch_size=8, ledger_rounds=20, actor_rounds=5)
    assert json.loads(json.dumps(figures)) == figures
    assert figures["ledger"]["request_rounds_per_s"] > 0 and figures["ledger"]["rounds"] == 20
    assert figures["actor"]["round_trip_ms_p50"] > 0 and figures["actor"]["rounds"] == 5
