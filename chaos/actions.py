"""The experiments' actions (chaos/experiments/*.json name them: {"type": "python", "module": "chaos.actions"}).

Kills go by PID (os.kill of the pid the replica reports itself) or through Ray's API (ray.kill of an actor
handle), never by process name. Injected faults arm the hooks of specserve_types/faults.py through each
deployment's `inject_fault` (or the KV manager actor's). Every fault is logged in the run's state with its
time, for the report's timeline.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from chaos import state
from chaos.cluster import call, handle
from chaos.load import LoadGenerator, LoadSettings

TARGETS = ("Drafter", "Verifier", "Scheduler", "kv")


# -- load ------------------------------------------------------------------------------------------
def start_load(concurrency: int = 4, deadline_s: float = 60.0, cancel_fraction: float = 0.0,
               short_deadline_fraction: float = 0.0, short_deadline_s: float = 0.5,
               slow_reader_s: float = 0.0, cancel_after_chunks: int = 0, cancel_max_tokens: int = 0,
               k: int | None = None) -> int:
    run = state.current()
    settings = LoadSettings(concurrency, deadline_s, cancel_fraction, short_deadline_fraction, short_deadline_s,
                            slow_reader_s, int(cancel_after_chunks), int(cancel_max_tokens), k)
    run.load = LoadGenerator(run.grpc_address, run.http_base, run.model, run.workload, settings, seed=run.seed,
                             name=f"chaos{len(run.records)}").start()
    return concurrency


def set_load(**knobs: float) -> dict[str, float]:
    """Change the running load's knobs (cancel_fraction, short_deadline_fraction, slow_reader_s, ...)."""
    load = state.current().load
    assert load is not None, "no load running"
    for name, value in knobs.items():
        setattr(load.settings, name, value)
    state.current().fault("load: " + ", ".join(f"{k}={v}" for k, v in sorted(knobs.items())))
    return knobs


def stop_load() -> int:
    """Stop the load and wait for every request in flight to end (bounded by its deadline)."""
    run = state.current()
    if run.load is None:
        return 0
    records = run.load.stop()
    run.records.extend(records)
    run.load = None
    return len(records)


def steady(seconds: float) -> float:
    time.sleep(float(seconds))
    return float(seconds)


# -- kills -----------------------------------------------------------------------------------------
def _sigkill(deployment: str) -> int:
    pid = int(call(deployment, "pid", timeout_s=120))
    os.kill(pid, signal.SIGKILL)
    state.current().fault(f"kill {deployment}", f"SIGKILL pid {pid}")
    return pid


def kill_drafter() -> int:
    return _sigkill("Drafter")


def kill_verifier() -> int:
    return _sigkill("Verifier")


def kill_scheduler() -> int:
    return _sigkill("Scheduler")


def kill_verifier_rank(rank: int = 1) -> str:
    """ray.kill one TP rank actor of the Verifier replica (TP > 1 only; with TP = 1 there is none)."""
    import ray

    ranks = call("Verifier", "rank_actors")
    if not ranks:
        state.current().notes.append("kill_verifier_rank: TP = 1, no rank actor to kill")
        return "skipped: TP = 1"
    ray.kill(ranks[rank % len(ranks)], no_restart=True)
    state.current().fault("kill verifier rank", f"rank {rank % len(ranks)}")
    return f"rank {rank % len(ranks)}"


def kill_kv_manager() -> int:
    """ray.kill the scheduler's KV manager actor (Ray restarts it with an empty ledger)."""
    import ray

    actor = call("Scheduler", "kv_actor")
    pid = int(ray.get(actor.pid.remote(), timeout=30))
    ray.kill(actor, no_restart=False)
    state.current().fault("kill kv manager", f"ray.kill pid {pid}")
    return pid


def lose_node(node: str, back_after_s: float = 2.0) -> int:
    """A Ray node lost under load: every process of the extra node `node` (chaos/nodes.py: its raylet and the
    workers on it) SIGKILLed at once; `back_after_s` later a node with the same resources joins again (a re-added
    node: `ray start`), where Ray and Serve restart what ran there. Returns how many processes were killed."""
    run = state.current()
    assert run.nodes is not None, "lose_node needs a scenario with extra nodes (its experiment's `nodes`)"
    pids = run.nodes.lose(node)
    run.fault(f"lose node {node}", f"SIGKILL {len(pids)} processes (raylet and workers)")
    time.sleep(float(back_after_s))
    start = time.time()
    run.nodes.add(node)
    run.notes.append(f"node {node} re-added {start - run.faults[-1].at:.1f} s after its loss "
                     f"(ray start: {time.time() - start:.1f} s)")
    return len(pids)


def _serve_actor(prefix: str) -> tuple[str, object]:
    """A Serve system actor (the controller, a proxy) by its Ray name, in Serve's namespace."""
    import ray
    from ray.serve._private.constants import SERVE_NAMESPACE

    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["namespace"] == SERVE_NAMESPACE and a["name"].startswith(prefix))
    if not names:
        raise RuntimeError(f"no Serve actor named {prefix}*")
    return names[0], ray.get_actor(names[0], namespace=SERVE_NAMESPACE)


def kill_controller() -> str:
    """ray.kill the Serve controller (Ray restarts it; replicas and proxies keep serving meanwhile)."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME

    name, actor = _serve_actor(SERVE_CONTROLLER_NAME)
    ray.kill(actor, no_restart=False)
    state.current().fault("kill serve controller", f"ray.kill {name}")
    return name


def kill_proxy() -> str:
    """ray.kill the HTTP proxy actor (the controller starts a new one; gRPC goes through the ingress's own server)."""
    import ray
    from ray.serve._private.constants import SERVE_PROXY_NAME

    name, actor = _serve_actor(SERVE_PROXY_NAME)
    ray.kill(actor, no_restart=True)
    state.current().fault("kill http proxy", f"ray.kill {name}")
    return name


def repeat(action: str, times: int, every_s: float, wait_first_s: float = 0.0, **arguments: Any) -> int:
    """Run one of this module's fault actions `times` times, `every_s` apart (a fault storm)."""
    fn = globals()[action]
    time.sleep(float(wait_first_s))
    for i in range(int(times)):
        fn(**arguments)
        if i + 1 < int(times):
            time.sleep(float(every_s))
    return int(times)


# -- injected faults (hooks of specserve_types/faults.py) ------------------------------------------
def inject(target: str, fault: str, fault_times: int | None = None, **params: Any) -> str:
    """Arm `fault` in `target` (Drafter, Verifier, Scheduler or kv) with `params` (probability, seconds, mode,
    ...); it fires `fault_times` times (or `times`), or until cleared."""
    if fault_times is not None:
        params["times"] = int(fault_times)
    if target == "kv":
        import ray

        actor = call("Scheduler", "kv_actor")
        ray.get(actor.inject_fault.remote(fault, **params), timeout=30)
    else:
        call(target, "inject_fault", fault, **params)
    detail = ", ".join(f"{k}={v}" for k, v in sorted(params.items()))
    state.current().fault(fault, f"{target}: {detail}")
    return fault


def clear_faults() -> dict[str, Any]:
    """Disarm every hook everywhere; returns how often each fault fired per target (since each process started)."""
    import ray

    fired: dict[str, Any] = {}
    for target in ("Drafter", "Verifier", "Scheduler"):
        try:
            fired[target] = call(target, "clear_faults", timeout_s=60)
        except Exception as exc:  # a deployment this cluster does not have, or one being replaced
            fired[target] = f"unreachable: {type(exc).__name__}"
    try:
        actor = call("Scheduler", "kv_actor", timeout_s=60)
        fired["kv"] = ray.get(actor.clear_faults.remote(), timeout=30)
    except Exception as exc:
        fired["kv"] = f"unreachable: {type(exc).__name__}"
    state.current().fired.update({k: v for k, v in fired.items() if isinstance(v, dict)})
    return fired


def replica_pids() -> dict[str, int]:
    """Every deployment's replica pid (a probe of what runs; the report lists replacements)."""
    pids = {}
    for target in ("Drafter", "Verifier", "Scheduler"):
        try:
            pids[target] = int(handle(target).pid.remote().result(timeout_s=60))
        except Exception:
            pids[target] = -1
    return pids
