"""Runs chaos experiments (chaos/experiments/*.json) against one live cluster and keeps their journals.

    deploy the cluster -> baseline (every workload spec once, no faults: the greedy truth, the acceptance)
    for each scenario, each trial: chaoslib.run_experiment (hypothesis, method, rollbacks) -> journal
        -> the KV report once idle -> invariants (chaos/invariants.py) -> figures (chaos/report.py)
    -> report.json, report.md, timeline.png, journals/<scenario>-<trial>.json, records/<scenario>-<trial>.jsonl

An experiment's `cluster` (optional) holds ClusterConfig overrides it needs (e.g. a small KV pool), and its `nodes`
(optional) the extra Ray nodes it needs (chaos/nodes.py: a node-loss scenario's, with the placement in `cluster`
that puts a part on each): the runner runs such scenarios last, on a cluster redeployed with them. An experiment's `configuration` holds its tunables (`duration`, ...); the run overrides `duration`
(chaoslib substitutes `${duration}` in the activities' arguments). `explained_errors` in the experiment
lists outcomes its fault is documented to produce besides the typed errors (e.g. "error_finish").
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos import probes, state
from chaos.cluster import (
    GRPC_PORT,
    HTTP_PORT,
    call,
    chaos_config,
    deploy_cluster,
    gcs_address,
    shutdown_cluster,
)
from chaos.invariants import Verdict, baseline_outputs, judge
from chaos.load import LoadGenerator, LoadSettings, RequestRecord, RequestSpec, default_workload
from chaos.nodes import ExtraNodes, NodeSpec
from chaos.report import markdown, scenario_figures, timeline_png

EXPERIMENTS_DIR = Path(__file__).resolve().parent / "experiments"
SMOKE = ("drafter-kill", "verifier-raise", "drafter-garbage")


def scenario_names() -> list[str]:
    return sorted(p.stem for p in EXPERIMENTS_DIR.glob("*.json"))


def load_experiment(name: str) -> dict[str, Any]:
    path = EXPERIMENTS_DIR / f"{name}.json"
    if not path.exists():
        raise ValueError(f"no chaos scenario {name!r}; known: {', '.join(scenario_names())}")
    return json.loads(path.read_text())


def cluster_of(experiment: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The ClusterConfig overrides and the extra nodes an experiment needs (both empty: the default cluster)."""
    return experiment.get("cluster", {}), experiment.get("nodes", [])


def nodes_root() -> Path:
    """Short paths (Ray's sockets live under each node's temp folder): the run's RAY_TMPDIR (scripts/in-netns.sh)."""
    return Path(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()) / "n"


def acceptance_rate(records: list[RequestRecord]) -> float | None:
    proposed = sum(r.proposed for r in records if r.outcome == "completed")
    return None if proposed == 0 else round(sum(r.accepted for r in records if r.outcome == "completed") / proposed, 3)


def acceptance_by_spec(records: list[RequestRecord]) -> dict[str, tuple[int, int]]:
    """(accepted, proposed) per workload spec over the completed requests."""
    out: dict[str, tuple[int, int]] = {}
    for r in records:
        if r.outcome == "completed":
            accepted, proposed = out.get(r.spec, (0, 0))
            out[r.spec] = (accepted + r.accepted, proposed + r.proposed)
    return out


def same_mix_rate(by_spec: dict[str, tuple[int, int]], records: list[RequestRecord]) -> float | None:
    """The baseline's acceptance over the spec mix of `records` (n-gram and model drafting, greedy and sampled
    accept very differently: a few requests after a fault are compared with the same requests' baseline)."""
    rates = [by_spec[r.spec] for r in records if r.outcome == "completed" and r.spec in by_spec and by_spec[r.spec][1]]
    proposed = sum(p for _, p in rates)
    return None if proposed == 0 else round(sum(a for a, _ in rates) / proposed, 3)


@dataclass
class ScenarioRun:
    name: str
    trial: int
    verdict: Verdict
    figures: dict[str, Any]
    records: list[RequestRecord]
    faults: list[state.FaultEvent]
    journal_status: str


@dataclass
class ChaosRun:
    out_dir: Path
    baseline: dict[str, list[int]]
    baseline_acceptance: float | None
    baseline_by_spec: dict[str, tuple[int, int]] = field(default_factory=dict)
    scenarios: list[ScenarioRun] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(s.verdict.ok for s in self.scenarios)


def orphaned_actors(expected: int, timeout_s: float = 60.0) -> int:
    """Alive Ray actors beyond the count after the baseline, once replacements have settled."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        alive = sum(1 for a in ray._private.state.actors().values() if a.get("State") == "ALIVE")
        if alive <= expected or time.monotonic() > deadline:
            return max(0, alive - expected)
        time.sleep(1.0)


def alive_actors() -> int:
    import ray

    return sum(1 for a in ray._private.state.actors().values() if a.get("State") == "ALIVE")


def engine_events(tries: int = 3, timeout_s: float = 60.0) -> tuple[list[dict[str, Any]], str | None]:
    """The scheduler engine's fallback events (its whole life), and why they could not be read (None: read). A busy
    or restarting replica is asked again (`tries` in all, 2 s apart): an unread record must not pass for an empty one,
    so the error is kept beside the events in the scenario's figures."""
    error: str | None = None
    for attempt in range(tries):
        try:
            return list(call("Scheduler", "stats", timeout_s=timeout_s)["engine"]["fallback_events"]), None
        except Exception as exc:
            error = f"stats unread after {attempt + 1} tries: {exc!r}"[:300]
            time.sleep(2.0)
    return [], error


def run_scenario(name: str, trial: int, duration: float, seed: int, workload: list[RequestSpec],
                 baseline: dict[str, list[int]], baseline_acceptance: float | None, out_dir: Path,
                 actors_expected: int, model: str,
                 baseline_by_spec: dict[str, tuple[int, int]] | None = None,
                 nodes: ExtraNodes | None = None) -> ScenarioRun:
    from chaoslib.experiment import run_experiment

    experiment = load_experiment(name)
    run = state.begin(state.RunState(f"127.0.0.1:{GRPC_PORT}", f"http://127.0.0.1:{HTTP_PORT}", model, workload,
                                     seed=seed + trial, nodes=nodes))
    config = {**experiment.get("configuration", {}), "duration": duration}
    journal = run_experiment(experiment, settings={}, experiment_vars=(config, {}))
    if run.load is not None:  # a method that failed before its stop_load: the rollbacks stopped it, or we do
        run.records.extend(run.load.stop())
        run.load = None
    journals = out_dir / "journals"
    journals.mkdir(parents=True, exist_ok=True)
    (journals / f"{name}-{trial}.json").write_text(json.dumps(journal, indent=1, default=str))
    records = out_dir / "records"  # every request of the scenario, every chunk with its arrival time
    records.mkdir(exist_ok=True)
    (records / f"{name}-{trial}.jsonl").write_text("".join(json.dumps(r.to_json()) + "\n" for r in run.records))
    kv = probes.kv_report()
    specs = {s.key: s for s in workload}
    explained = frozenset(experiment.get("explained_errors", []))
    verdict = judge(run.records, specs, baseline, kv, explained)
    failed = [f"{r['activity']['name']}: {str(r.get('exception') or '')[-200:]}" for r in journal.get("run", [])
              if r.get("status") != "succeeded"]
    if failed:  # chaoslib goes on after a failed action: a fault never injected, load never started
        verdict.violations.append(f"experiment actions failed: {failed}")
    if not run.records:
        verdict.violations.append("no request was sent")
    if journal.get("status") != "completed":
        verdict.violations.append(f"experiment {journal.get('status')}: {journal.get('deviated') and 'hypothesis deviated'}")
    orphans = orphaned_actors(actors_expected)
    if orphans:
        verdict.violations.append(f"{orphans} orphaned Ray actors")
    events, stats_error = engine_events()
    fallback_times = [float(e["at"]) for e in events if "at" in e]
    last_fault = run.faults[-1].at if run.faults else 0.0
    after = [r for r in run.records if r.start >= last_fault + 5.0]
    acceptance = {"baseline": baseline_acceptance, "after": acceptance_rate(after),
                  "baseline_same_mix": same_mix_rate(baseline_by_spec or {}, after),
                  "fallback_events": sorted({str(e.get("event")) for e in events}), "stats_error": stats_error}
    figures = scenario_figures(name if trial == 0 else f"{name}#{trial}", verdict, run.records, run.faults,
                               fallback_times, acceptance)
    figures["orphaned_actors"] = orphans
    figures["journal_status"] = journal.get("status")
    figures["fault_log"] = [{"at": f.at, "fault": f.fault, "detail": f.detail} for f in run.faults]
    figures["notes"] = run.notes
    figures["fired"] = run.fired
    return ScenarioRun(name, trial, verdict, figures, run.records, run.faults, str(journal.get("status")))


def run_matrix(names: list[str], duration: float = 20.0, trials: int = 1, seed: int = 0,
               out_dir: Path = Path("bench_results/chaos"), progress: Callable[[str], None] = print,
               deploy: bool = True, concurrency: int = 4, **config_overrides: Any) -> ChaosRun:
    config = chaos_config(**config_overrides)
    out_dir.mkdir(parents=True, exist_ok=True)
    nodes: ExtraNodes | None = None  # the extra Ray nodes of the deployed cluster, if any
    if deploy:
        progress(f"deploying {config.model} (draft {config.draft}) on 127.0.0.1:{config.grpc_port} ...")
        deploy_cluster(config)
    try:
        workload = default_workload()
        state.begin(state.RunState(f"127.0.0.1:{GRPC_PORT}", f"http://127.0.0.1:{HTTP_PORT}", config.model, workload))
        progress("baseline: every request once, no faults ...")
        records = LoadGenerator(f"127.0.0.1:{GRPC_PORT}", f"http://127.0.0.1:{HTTP_PORT}", config.model, workload,
                                LoadSettings(concurrency=concurrency), name="baseline").run_each_once()
        specs = {s.key: s for s in workload}
        baseline = baseline_outputs(records, specs)
        chaos = ChaosRun(out_dir, baseline, acceptance_rate(records), acceptance_by_spec(records))
        actors = alive_actors()
        deployed: tuple[dict[str, Any], list[dict[str, Any]]] = ({}, [])  # the deployed cluster's overrides, nodes
        for name in sorted(names, key=lambda n: cluster_of(load_experiment(n)) != ({}, [])):  # own clusters last
            wanted = cluster_of(load_experiment(name))
            if wanted != deployed:
                if not deploy:
                    raise ValueError(f"scenario {name!r} needs its own cluster {wanted}: run it with deploy=True")
                progress(f"redeploying with {wanted[0] or 'the default settings'}"
                         f"{f' and {len(wanted[1])} extra Ray nodes' if wanted[1] else ''} for {name} ...")
                shutdown_cluster()
                if nodes is not None:
                    nodes.stop()
                nodes = ExtraNodes(nodes_root(), gcs_address(), [NodeSpec.of(n) for n in wanted[1]]) \
                    if wanted[1] else None
                deploy_cluster(chaos_config(**{**config_overrides, **wanted[0]}), nodes)
                deployed = wanted
                actors = alive_actors()
            for trial in range(trials):
                progress(f"[{len(chaos.scenarios) + 1}/{len(names) * trials}] {name} (trial {trial + 1}/{trials}, "
                         f"{duration:.0f}s) ...")
                result = run_scenario(name, trial, duration, seed, workload, baseline, chaos.baseline_acceptance,
                                      out_dir, actors, config.model, chaos.baseline_by_spec, nodes)
                chaos.scenarios.append(result)
                v = result.verdict
                progress(f"    {'ok' if v.ok else 'FAILED'}: {v.sent} sent, {v.completed_exact} exact, "
                         f"{v.cancelled} cancelled, errors {v.typed_errors}, lost {v.lost}, diverged {v.diverged}, "
                         f"leaked {v.leaked_blocks}, faults {len(result.faults)}"
                         + "".join(f"\n      {line}" for line in v.violations[:10]))
        write_report(chaos)
        return chaos
    finally:
        if deploy:
            shutdown_cluster()
        if nodes is not None:
            nodes.stop()


def write_report(chaos: ChaosRun) -> None:
    figures = [s.figures for s in chaos.scenarios]
    summary = {"baseline_acceptance": chaos.baseline_acceptance, "ok": chaos.ok,
               "faults": sum(len(s.faults) for s in chaos.scenarios), "scenarios": figures}
    (chaos.out_dir / "report.json").write_text(json.dumps(summary, indent=1, default=str))
    (chaos.out_dir / "report.md").write_text(markdown(figures))
    timeline_png(chaos.out_dir / "timeline.png",
                 [(s.figures["scenario"], s.records, s.faults) for s in chaos.scenarios])
