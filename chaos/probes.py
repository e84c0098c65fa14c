"""The experiments' steady-state probes: the cluster answers a greedy request, and the KV ledger is clean."""

from __future__ import annotations

import time
from typing import Any

from chaos import state
from chaos.cluster import call, wait_idle
from cluster.client import Credentials, SpecServeClient, collect


def cluster_answers(timeout_s: float = 180.0) -> bool:
    """A short greedy request completes (retried while replicas are being replaced)."""
    run = state.current()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with SpecServeClient(run.grpc_address, timeout_s=30) as client:
                (sample,) = collect(client.generate("def add(a, b):", max_tokens=4, temperature=0.0,
                                                    ignore_eos=True)).values()
            if sample["finish_reason"] == "length":
                return True
        except Exception:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(1.0)


def http_answers(timeout_s: float = 180.0) -> bool:
    """A short greedy completion over HTTP (through Serve's proxy) completes, retried while it is replaced."""
    import requests

    run = state.current()
    body = {"model": run.model, "prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            credentials = Credentials.from_env()  # the same key and roots as the load (chaos/load.py)
            response = requests.post(f"{run.http_base}/v1/completions", json=body, timeout=30,
                                     headers=credentials.http_headers(), verify=credentials.http_verify)
            if response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length":
                return True
        except (requests.RequestException, KeyError, ValueError):
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(1.0)


def kv_report(timeout_s: float = 120.0) -> dict[str, Any]:
    """Once idle: the ledger's audit (leaked blocks, reserved/committed per namespace) and the reconciliation
    of the ledger against the engine's live requests."""
    wait_idle(timeout_s)
    report = call("Scheduler", "audit")
    counts = {ns: {"reserved": c.reserved, "committed": c.committed} for ns, c in report.counts.items()}
    return {"leaked_blocks": len(report.leaked_blocks), "audit_errors": list(report.errors), "counts": counts,
            "held_blocks": sum(c["reserved"] + c["committed"] for c in counts.values()),
            "ledger_check": call("Scheduler", "check_ledger")}


def kv_clean(timeout_s: float = 120.0) -> bool:
    report = kv_report(timeout_s)
    return (report["leaked_blocks"] == 0 and not report["audit_errors"] and report["held_blocks"] == 0
            and report["ledger_check"] is None)
