"""`bench serve`'s report: per concurrency level, the overhead against the in-process engine, the round's hops."""

from __future__ import annotations

from typing import Any

from cluster.cli.bench_tables import pct, table


def interval_cell(interval: list[float] | None) -> str:
    return "-" if not interval else f"{pct(interval[0])}..{pct(interval[1])}"


def work_cells(overhead: dict[str, Any]) -> list[str]:
    """Rounds and drafted tokens, cluster / in process, for the same requests (absent in older JSON)."""
    work = overhead.get("work")
    if not work:
        return ["-", "-"]
    return [f"{work['cluster'][key]} / {work['inprocess'][key]}" for key in ("rounds", "drafted")]


def format_serve(result: dict[str, Any]) -> str:
    s = result["settings"]
    ms = 1000.0

    def dist(row: dict[str, Any], key: str, stat: str) -> float | None:
        values = row[key]
        return None if values is None else values[stat] * ms

    out = [f"bench serve: {s['model']} (draft {s['draft']}) through gRPC, greedy, max {s['max_tokens']} tokens; "
           f"latencies in ms, ITL per token (chunk = m tokens at once); SLO TTFT <= {s['slo_ttft_s'] * ms:.0f} ms "
           f"and TPOT <= {s['slo_tpot_s'] * ms:.0f} ms"]
    headers = ["conc", "mode", "reqs", "tok/s", "TTFT p50", "TTFT p99", "TPOT mean", "TPOT p99", "ITL p50",
               "ITL p90", "ITL p99", "goodput/s", "SLO %", "accept", "tok/round", "=plain"]
    rows = []
    for r in result["levels"]:
        acc = r.get("acceptance") or {}
        rows.append([r["concurrency"], r["mode"], r["requests"], r["output_tokens_per_second"],
                     dist(r, "ttft_seconds", "p50"), dist(r, "ttft_seconds", "p99"), dist(r, "tpot_seconds", "mean"),
                     dist(r, "tpot_seconds", "p99"), dist(r, "itl_seconds", "p50"), dist(r, "itl_seconds", "p90"),
                     dist(r, "itl_seconds", "p99"), r["goodput_requests_per_second"], pct(r["slo_attainment"]),
                     acc.get("acceptance_rate"), acc.get("mean_tokens_per_round"), r.get("same_output_as_plain")])
    out.append(table(headers, rows))
    if result["inprocess_overhead"]:
        out.append("\ncluster overhead vs the in-process engine, concurrency 1, same requests (goal <= 10%; 90% CI: "
                   "a paired bootstrap over the requests; rounds and drafted tokens cluster / in process):")
        out.append(table(
            ["mode", "reqs", "e2e ms", "in-proc ms", "e2e +%", "90% CI", "TTFT +%", "TPOT +%", "<=10%", "=in-proc",
             "rounds", "drafted"],
            [[o["mode"], o["requests"], o["cluster"]["latency_seconds"] * ms, o["inprocess"]["latency_seconds"] * ms,
              pct(o["latency_overhead"]), interval_cell(o.get("latency_overhead_ci90")), pct(o["ttft_overhead"]),
              pct(o["tpot_overhead"]), o["meets_goal_10pct"],
              o["same_output"], *work_cells(o)] for o in result["inprocess_overhead"]]))
    split = result.get("round_split_concurrency_1") or {}
    if all(split.get(side) for side in ("cluster", "inprocess")):
        out.append("\nper engine round at concurrency 1 (ms; verify as timed in the verifier, verify_hop = the rest of "
                   "its call, draft = the propose call, kv = reserve + commit calls, other = planning, acceptance):")
        parts = ["round", "verify", "verify_hop", "draft", "kv", "other"]
        out.append(table(["side", "rounds", *parts], [[side, split[side]["rounds"], *[split[side][f"{p}_ms"] for p in parts]]
                                                      for side in ("cluster", "inprocess")]))
        hops = [p for p in ("verifier_transport", "drafter_transport", "kv_transport", "kv_ahead_wait",
                            "kv_ahead_transport", "hops") if f"{p}_ms" in split["cluster"]]
        if hops:  # round channels: each one's own time (round trip - the worker's handler), and every hop together
            out.append(f"cluster round transport: {split['cluster']['transport']}; ms per round: "
                       + ", ".join(f"{p} {split['cluster'][f'{p}_ms']:.3f}" for p in hops))
    env = result["environment"]
    out.append(f"\nCPU: {env['cpu']} ({env['cpu_kernel']} kernels); CPU binding: {env.get('cpu_plan') or 'none'}")
    out.append(f"load average {env['loadavg_at_start'][0]:.1f} -> {env['loadavg_at_end'][0]:.1f}; "
               f"KV blocks leaked: {result['cluster']['kv_leaked_blocks']}; "
               f"fallback events: {len(result['cluster']['fallback_events'])}")
    if chunks := result["cluster"].get("chunks"):  # how the scheduler's chunks reached the ingress (chunk_push.py)
        out.append(f"chunks pushed to the ingress: {chunks['pushed']}, through Serve's stream: {chunks['through_serve']}"
                   f"; inbox unreachable: {chunks['push_fallbacks']} requests, link lost: {chunks['push_lost']}")
    return "\n".join(out)
