"""`specserve bench serve`: the Serve cluster under load through gRPC, speculation on and off, and its
overhead against the in-process engine on the same requests.

    local Ray + the specserve application (cluster/serving/app.py)
      for c in concurrency (closed loop: c clients, each sends its next request when one finishes):
        mode "spec"  (draft model or n-gram, k auto unless --k)   greedy, same prompts
        mode "plain" (draft none, k = 0)
      concurrency 1: each request also runs through the in-process engine (same model, draft, k),
        interleaved request by request so background load falls on both alike -> overhead

Figures per level and mode (cluster/bench/serve_metrics.py): TTFT, TPOT, per-token ITL percentiles (a
chunk of m tokens counts as m tokens at its arrival), output tokens/s, goodput under an SLO.
`same_output` checks the greedy contract on the way: spec and plain (and cluster and in-process)
must emit identical tokens. Prompts are the bench prompt set (cluster/bench/prompts), chat-formatted.
Concurrency 1 runs its requests back to back, so its wall time is the sum of their latencies; its
engine rounds are split into worker compute and the rest (`round_split_concurrency_1`), which is
where the cluster's per-round overhead (RPCs to the workers and the KV ledger actor) shows.
Figures only, never timed assertions; progress on stderr.
"""

from __future__ import annotations

import itertools
import os
import random
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from cluster.bench.bench_prompts import CATEGORIES, load_prompts
from cluster.bench.runtime import environment, progress, set_threads
from cluster.bench.serve_metrics import SLO, RequestTiming, summarize
from cluster.client import SpecServeClient
from cluster.engine.acceptance_stats import AcceptanceStats
from cluster.serving.cpu_binding import thread_cpus
from specserve_types.api import GenerationRequest, SamplingParams, SpecParams

WARMUP_TOKENS = 8
MODES = ("spec", "plain")


@dataclass
class ServeBenchSettings:
    model: str = "smollm2-135m"
    draft: str = "ngram"  # a draft model name/dir, or "ngram"
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16])
    requests: int | None = None  # per level and mode; None = max(8, 2 * concurrency)
    max_tokens: int = 64
    k: int | None = None  # None = auto
    categories: list[str] = field(default_factory=lambda: list(CATEGORIES))
    per_category: int = 2
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.2
    threads: int = 2  # torch threads of each worker and of the in-process engine
    inprocess: bool = True
    grpc_port: int = 9100
    http_port: int = 8100
    kv_blocks: int = 1024
    max_context: int = 1024
    server: str | None = None  # HOST:PORT of a running cluster's gRPC endpoint: measure it, deploy nothing
    round_transport: str = "channel"  # ClusterConfig.round_transport of the deployed cluster
    reservation_windows: bool = True  # ClusterConfig.reservation_windows, of the cluster and the in-process engine
    cpu_binding: str = "auto"  # ClusterConfig.cpu_binding: the verifier's compute thread (and the in-process
    # engine's requests) on CPUs of their own, everything else on the rest (cluster/serving/cpu_binding.py)

    def __post_init__(self) -> None:
        assert self.concurrency and all(c >= 1 for c in self.concurrency), self.concurrency
        assert self.requests is None or self.requests >= 1, self.requests
        assert self.max_tokens >= 1 and self.threads >= 1 and self.per_category >= 1
        assert self.slo_ttft_s > 0 and self.slo_tpot_s > 0

    def requests_at(self, concurrency: int) -> int:
        return self.requests if self.requests is not None else max(8, 2 * concurrency)

    def mode_fields(self, mode: str) -> dict[str, Any]:
        if mode == "plain":
            return {"draft": "none", "k": 0}
        return {"draft": "ngram" if self.draft == "ngram" else "model", "k": self.k}


def cluster_config(s: ServeBenchSettings) -> Any:
    from cluster.serving.config import load_config

    top = max(s.concurrency)
    return load_config(model=s.model, draft=s.draft, worker_threads=s.threads, kv_blocks=s.kv_blocks,
                       max_batch=top, queue_capacity=2 * top, max_context=s.max_context, grpc_port=s.grpc_port,
                       http_port=s.http_port, graceful_shutdown_wait_loop_s=0.2, graceful_shutdown_timeout_s=2.0,
                       round_transport=s.round_transport, reservation_windows=s.reservation_windows,
                       cpu_binding=s.cpu_binding)


# ---------------------------------------------------------------------- one request
def stream_request(client: SpecServeClient, prompt_ids: list[int], fields: dict[str, Any],
                   max_tokens: int) -> RequestTiming:
    timing = RequestTiming(sent_at=time.perf_counter())
    for item in client.generate(prompt_ids, max_tokens=max_tokens, temperature=0.0, contract="greedy", **fields):
        now = time.perf_counter()
        timing.add_chunk(item.chunk.token_ids, now)
        if item.chunk.finished:
            timing.finish(item.chunk.finish_reason, now, item.chunk.stats)
    return timing


def run_in_process(engine: Any, request_id: str, prompt_ids: list[int], fields: dict[str, Any],
                   max_tokens: int, cpus: Sequence[int] | None = None) -> RequestTiming:
    """One request through the in-process engine on this thread; `cpus`: the verifier's compute CPUs while it runs
    (the cluster's verifier runs on them: the same forward on the same core)."""
    request = GenerationRequest(request_id, tuple(prompt_ids), SamplingParams(max_tokens=max_tokens),
                                SpecParams(contract="greedy", k=fields["k"], draft=fields["draft"]))
    timing = RequestTiming(sent_at=time.perf_counter())
    with thread_cpus(cpus):
        engine.submit(request)
        while engine.has_unfinished():
            chunks = engine.step()
            now = time.perf_counter()
            for chunk in chunks:
                timing.add_chunk(chunk.token_ids, now)
                if chunk.finished:
                    timing.finish(chunk.finish_reason, now, chunk.stats)
    return timing


# ---------------------------------------------------------------------- levels
def run_level(client: SpecServeClient, prompts: list[list[int]], concurrency: int, fields: dict[str, Any],
              max_tokens: int) -> tuple[list[RequestTiming], float]:
    """Closed loop: `concurrency` clients; returns the timings (in prompt order) and the wall time."""
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        timings = list(pool.map(lambda ids: stream_request(client, ids, fields, max_tokens), prompts))
    return timings, time.perf_counter() - start


def run_sequential(s: ServeBenchSettings, client: SpecServeClient, engine: Any | None,
                   prompts: list[list[int]], cpus: Sequence[int] | None = None,
                   ) -> dict[str, dict[str, list[RequestTiming]]]:
    """Concurrency 1: every request through the cluster and (if `engine`) in process, interleaved."""
    runs: dict[str, dict[str, list[RequestTiming]]] = {m: {"cluster": [], "inprocess": []} for m in MODES}
    for index, prompt in enumerate(prompts):
        for mode in (MODES if index % 2 == 0 else MODES[::-1]):
            fields = s.mode_fields(mode)
            sides = ["cluster", "inprocess"] if engine is not None else ["cluster"]
            for side in (sides if index % 2 == 0 else sides[::-1]):
                if side == "cluster":
                    runs[mode][side].append(stream_request(client, prompt, fields, s.max_tokens))
                else:
                    runs[mode][side].append(run_in_process(engine, f"{mode}-{index}", prompt, fields, s.max_tokens,
                                                           cpus))
    return runs


def acceptance_of(timings: list[RequestTiming]) -> dict[str, Any] | None:
    total = AcceptanceStats()
    for t in timings:
        if t.stats and t.stats.get("acceptance"):
            total = total.merge(AcceptanceStats.from_dict(t.stats["acceptance"]))
    return total.to_dict() if total.rounds else None


def same_output(a: list[RequestTiming], b: list[RequestTiming]) -> float:
    return sum(x.token_ids == y.token_ids for x, y in zip(a, b, strict=True)) / len(a) if a else 1.0


def level_row(s: ServeBenchSettings, concurrency: int, mode: str, timings: list[RequestTiming], wall_s: float,
              plain: list[RequestTiming] | None) -> dict[str, Any]:
    row = {"concurrency": concurrency, "mode": mode, **s.mode_fields(mode),
           **summarize(timings, wall_s, SLO(s.slo_ttft_s, s.slo_tpot_s)), "acceptance": acceptance_of(timings),
           "finish_reasons": dict(sorted({r: sum(t.finish_reason == r for t in timings)
                                          for r in {t.finish_reason for t in timings}}.items(), key=str))}
    if plain is not None:
        row["same_output_as_plain"] = same_output(timings, plain)
    return row


ROUND_PARTS = ("round", "verify", "verify_call", "draft", "kv")


def round_split(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float] | None:
    """Mean milliseconds per engine round between two `engine.stats()` snapshots: `verify` as timed in
    the verifier, `verify_hop` the rest of the verify call (transport and the replica's dispatch), `draft` the
    propose call, `kv` the reserve and commit calls, `other` the rest (planning, acceptance, bookkeeping).
    With round channels (the snapshots' `transport`, remote_backends.transport_totals) also each channel's own
    time per round, `<worker>_transport` (round trip minus the worker's handler: framing, pickling, sockets,
    wake-ups), and `hops`: every cross-process cost on the round's path, the verify hop plus the drafter's and
    the ledger's transport plus `kv_ahead_wait` (the time waited for the ledger call made beside the verify
    after the verify answered); `kv_ahead_transport` is that call's own transport, off the path."""
    rounds = after["rounds"] - before["rounds"]
    if rounds <= 0:
        return None
    ms = {part: 1000 * (after[f"{part}_seconds"] - before[f"{part}_seconds"]) / rounds for part in ROUND_PARTS}
    ms["verify_hop"] = ms.pop("verify_call") - ms["verify"]
    ms["other"] = ms["round"] - ms["verify"] - ms["verify_hop"] - ms["draft"] - ms["kv"]
    split: dict[str, Any] = {"rounds": rounds, **{f"{part}_ms": value for part, value in ms.items()}}
    t0, t1 = before.get("transport") or {}, after.get("transport") or {}
    if t1.get("kind") == "channel":
        transport = {name: 1000 * (t1[name]["transport_seconds"] - t0.get(name, {}).get("transport_seconds", 0.0))
                     / rounds for name in ("verifier", "drafter", "kv", "kv_ahead") if name in t1}
        split |= {f"{name}_transport_ms": value for name, value in transport.items()}
        split |= {f"{name}_calls_per_round": (t1[name]["calls"] - t0.get(name, {}).get("calls", 0)) / rounds
                  for name in transport}
        wait = 1000 * (after.get("kv_ahead_wait_seconds", 0.0) - before.get("kv_ahead_wait_seconds", 0.0)) / rounds
        split["kv_ahead_wait_ms"] = wait
        split["hops_ms"] = ms["verify_hop"] + transport.get("drafter", 0.0) + transport.get("kv", 0.0) + wait
    split["transport"] = t1.get("kind", "in process")
    return split


def cluster_snapshot(client: SpecServeClient) -> dict[str, Any]:
    """The scheduler's engine statistics with its round channels' totals (`transport`)."""
    stats = client.stats()
    return {**stats["engine"], "transport": stats.get("transport")}


BOOTSTRAP_SAMPLES = 2000
BOOTSTRAP_SEED = 0


def paired_ratio_interval(cluster: Sequence[float], inprocess: Sequence[float], level: float = 0.90,
                          samples: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED) -> tuple[float, float] | None:
    """A percentile bootstrap interval for sum(cluster) / sum(inprocess), resampling the requests as pairs (each
    request ran on both sides back to back, so a burst of the host's load falls on a pair, not on one side's mean).
    None with fewer than two pairs. Seeded: the same timings give the same interval."""
    pairs = [(c, i) for c, i in zip(cluster, inprocess, strict=True)]
    if len(pairs) < 2:
        return None
    rng = random.Random(seed)
    ratios = []
    for _ in range(samples):
        draw = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        ratios.append(sum(c for c, _ in draw) / sum(i for _, i in draw))
    ratios.sort()
    tail = (1.0 - level) / 2
    return ratios[int(tail * (samples - 1))], ratios[int((1.0 - tail) * (samples - 1))]


def request_work(t: RequestTiming) -> dict[str, Any]:
    """One request's record in `work.per_request`: its rounds, latency and TTFT, where its time went as its engine
    timed it (draft: the propose calls; verify: the verifier's forwards; queued: arrival to admission), and the k
    auto chose and when (s after arrival: where the two sides' policies part)."""
    stats = t.stats or {}

    def ms(seconds: float | None) -> float | None:
        return round(1000 * seconds, 2) if isinstance(seconds, float | int) else None

    return {"rounds": stats.get("rounds"), "latency_ms": ms(t.latency), "ttft_ms": ms(t.ttft),
            **{f"{part}_ms": ms(stats.get(f"{part}_seconds")) for part in ("draft", "verify", "queued")},
            "policy": [[e.get("at"), e.get("k")] for e in stats.get("policy_events", [])]}


def overhead_row(mode: str, cluster: list[RequestTiming], inprocess: list[RequestTiming]) -> dict[str, Any]:
    def mean(values: list[float | None]) -> float:
        present = [v for v in values if v is not None]
        return sum(present) / len(present) if present else 0.0

    sides = {name: {"latency_seconds": mean([t.latency for t in ts]), "ttft_seconds": mean([t.ttft for t in ts]),
                    "tpot_seconds": mean([t.tpot for t in ts])} for name, ts in (("cluster", cluster),
                                                                                  ("inprocess", inprocess))}
    # the work each side did for the same tokens: where the auto policies drafted differently (each times its own
    # costs), the rounds differ, and the overhead is the policy's as much as the transport's
    work = {name: {"rounds": sum(int((t.stats or {}).get("rounds", 0)) for t in ts),
                   "drafted": sum(int(((t.stats or {}).get("acceptance") or {}).get("proposed", 0)) for t in ts),
                   "per_request": [request_work(t) for t in ts]}
            for name, ts in (("cluster", cluster), ("inprocess", inprocess))}
    overhead = {f"{key.removesuffix('_seconds')}_overhead": sides["cluster"][key] / sides["inprocess"][key] - 1.0
                if sides["inprocess"][key] > 0 else None for key in sides["cluster"]}
    latencies = [(c.latency, i.latency) for c, i in zip(cluster, inprocess, strict=True)
                 if c.latency is not None and i.latency is not None]
    interval = paired_ratio_interval([c for c, _ in latencies], [i for _, i in latencies])
    overhead["latency_overhead_ci90"] = None if interval is None else [interval[0] - 1.0, interval[1] - 1.0]
    return {"mode": mode, "requests": len(cluster), **sides, **overhead, "work": work,
            "meets_goal_10pct": overhead["latency_overhead"] is not None and overhead["latency_overhead"] <= 0.10,
            "same_output": same_output(cluster, inprocess)}


# ---------------------------------------------------------------------- the run
def run_serve_bench(s: ServeBenchSettings) -> dict[str, Any]:
    """Start (or reuse) Ray, deploy, measure, shut the application down; returns the JSON figures."""
    import ray
    from ray import serve

    from cluster.engine.factory import load_tokenizer, model_dir, tokenize_prompt
    from cluster.serving.app import deploy

    set_threads(s.threads)
    env = environment()
    config = cluster_config(s)
    tokenizer = load_tokenizer(model_dir(s.model))
    prompt_set = load_prompts(s.categories, s.per_category)
    prompt_ids = [tokenize_prompt(tokenizer, p.text, chat=True) for p in prompt_set]
    if s.server is not None:  # someone else's cluster (`specserve up`): measured as it is, left running
        progress(f"measuring the running cluster at {s.server} (its model should be {s.model})")
        with SpecServeClient(s.server, timeout_s=600) as client:
            return _measure(s, client, prompt_ids, env)
    started_ray = not ray.is_initialized()
    plan = config.cpu_plan() if started_ray else None  # a Ray someone else started is placed as it is
    env["cpu_plan"] = plan.describe() if plan is not None else None
    # this thread (the clients' threads it starts, and a local Ray's processes) on the service CPUs
    with thread_cpus(plan.service if plan is not None else None):
        if started_ray:
            progress("starting a local Ray (loopback)" + (f"; CPUs: {plan.describe()}" if plan else ""))
            config.local_ray_env()
            ray.init(num_cpus=os.cpu_count(), include_dashboard=False, _node_ip_address="127.0.0.1",
                     log_to_driver=False)
        try:
            progress(f"deploying {s.model} (draft {s.draft}) on gRPC 127.0.0.1:{s.grpc_port}")
            deploy(config, cpu_plan=plan)
            with SpecServeClient(f"127.0.0.1:{s.grpc_port}", timeout_s=600) as client:
                return _measure(s, client, prompt_ids, env, plan.ranks[0] if plan is not None else None)
        finally:
            serve.shutdown()
            if started_ray:
                ray.shutdown()


def load_inprocess_engine(s: ServeBenchSettings, cpus: Sequence[int] | None) -> Any:
    """The in-process side's engine, warmed up as the cluster's engine is (ClusterConfig.warm_up: both auto policies
    start from measured costs, so with speculation on both sides choose k alike), built on `cpus`, the CPUs its
    rounds run on (run_in_process). Built on the service CPUs instead, among Ray's processes, its warm-up read a
    SmolLM2 verify of 2 rows at 1.31x one (its rounds: ~1.05x) and its auto decoded plainly in 4 of 6 runs
    (docs/cluster-cost.md "The chunks' own socket, and the q4 default at concurrency 1")."""
    from cluster.engine.factory import build_local_engine
    from cluster.serving.config import make_config

    settings = make_config(model=s.model, draft=s.draft, max_batch=1, max_context=s.max_context, kv_blocks=None,
                           warm_up=True, reservation_windows=s.reservation_windows)
    with thread_cpus(cpus):
        return build_local_engine(s.model, s.draft, settings.engine_config(), settings.local_runtime())


def _measure(s: ServeBenchSettings, client: SpecServeClient, prompt_ids: list[list[int]],
             env: dict[str, Any], inprocess_cpus: Sequence[int] | None = None) -> dict[str, Any]:
    engine = None
    if s.inprocess and 1 in s.concurrency:
        progress("loading the in-process engine")
        engine = load_inprocess_engine(s, inprocess_cpus)
    progress("warming up")
    for mode in MODES:
        stream_request(client, prompt_ids[-1], s.mode_fields(mode), WARMUP_TOKENS)
        if engine is not None:
            run_in_process(engine, f"warmup-{mode}", prompt_ids[-1], s.mode_fields(mode), WARMUP_TOKENS,
                           inprocess_cpus)
    cycle = itertools.cycle(prompt_ids)
    levels, overheads, rounds, costs = [], [], {}, {}
    for level_index, concurrency in enumerate(s.concurrency):
        prompts = [next(cycle) for _ in range(s.requests_at(concurrency))]
        progress(f"concurrency {concurrency}: {len(prompts)} requests per mode, max {s.max_tokens} tokens")
        if concurrency == 1:
            before = {"cluster": cluster_snapshot(client), "inprocess": engine.stats() if engine else None}
            runs = run_sequential(s, client, engine, prompts, inprocess_cpus)
            timed = {m: (runs[m]["cluster"], sum(t.latency or 0.0 for t in runs[m]["cluster"])) for m in MODES}
            if engine is not None:
                overheads = [overhead_row(m, runs[m]["cluster"], runs[m]["inprocess"]) for m in MODES]
                rounds = {"cluster": round_split(before["cluster"], cluster_snapshot(client)),
                          "inprocess": round_split(before["inprocess"], engine.stats())}
                # each side's auto policy starts from its own warm-up's costs (seconds by rows scored): where they
                # differ, the two sides may draft differently on the first requests
                costs = {side: before[side].get("cost_model") for side in ("cluster", "inprocess")}
        else:
            order = MODES if level_index % 2 == 0 else MODES[::-1]
            timed = {m: run_level(client, prompts, concurrency, s.mode_fields(m), s.max_tokens) for m in order}
        for mode in MODES:
            timings, wall = timed[mode]
            levels.append(level_row(s, concurrency, mode, timings, wall, timed["plain"][0] if mode == "spec" else None))
            progress(f"  {mode}: {levels[-1]['output_tokens_per_second']:.1f} tok/s")
    stats = client.stats()
    env["loadavg_at_end"] = list(os.getloadavg())
    return {"settings": asdict(s), "environment": env, "levels": levels, "inprocess_overhead": overheads,
            "round_split_concurrency_1": rounds, "cost_models_at_concurrency_1": costs,
            "cluster": {"kv_leaked_blocks": stats["kv"]["leaked_blocks"], "scheduler": stats["scheduler"],
                        "fallback_events": stats["engine"].get("fallback_events", []),
                        "transport": stats.get("transport"), "chunks": stats.get("chunks")}}
