"""The application across four Ray nodes with their own addresses (conftest.py): the ingress and scheduler on the
head, the verifier, the drafter and the KV manager each on a node of its own, placed by ClusterConfig.placement
(labels for three, custom resources for two). SmolLM2 drafts for itself (a Drafter deployment), so one deployment
serves the model's drafts, n-gram drafts and none. Checked: each part runs in its node's namespace, the greedy
outputs through gRPC and HTTP equal the in-process engine's token for token, the scheduler reaches the workers over
TCP to their nodes' own addresses (its channel log lines and the sockets seen with ss), the ledger leaks nothing.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import yaml

from cluster.client import SpecServeClient, collect
from tests.cluster.multinode.conftest import MAX_CONTEXT, MAX_TOKENS, PROMPTS, ROLE_LABEL, needs_own_addresses
from tests.cluster.multinode.netns_cluster import VENV_BIN, NetnsCluster

pytestmark = pytest.mark.timeout(600)

GRPC_PORT, HTTP_PORT = 19410, 18410
DEPLOY_TIMEOUT_S = 360.0
PLACEMENT = {  # both ways of naming nodes: custom resources (frontend), labels (the workers)
    "ingress": {"resources": {"specserve-frontend": 1}},
    "scheduler": {"resources": {"specserve-frontend": 1}},
    "verifier": {"labels": {ROLE_LABEL: "verifier"}},
    "drafter": {"labels": {ROLE_LABEL: "drafter"}},
    "kv_manager": {"labels": {ROLE_LABEL: "kv"}},
}
# what runs where: node name -> the process title of the part placed there (Ray names a worker `ray::CLASS...`)
WHERE = {"head": ("Ingress", "Scheduler"), "verifier": ("Verifier",), "drafter": ("Drafter",), "kv": ("KVManager",)}


def cluster_config() -> dict[str, Any]:
    return {"model": "smollm2-135m", "draft": "smollm2-135m", "dtype": "bfloat16", "draft_dtype": "bfloat16",
            "worker_threads": 1, "kv_blocks": 256, "block_size": 16, "queue_capacity": 32, "max_batch": 8,
            "max_context": MAX_CONTEXT, "host": "0.0.0.0", "grpc_port": GRPC_PORT, "http_port": HTTP_PORT,
            "warm_up": False, "health_check_period_s": 2.0, "health_check_timeout_s": 30.0,
            "drafter_retry_seconds": 1.0,
            "graceful_shutdown_wait_loop_s": 0.2, "graceful_shutdown_timeout_s": 2.0, "placement": PLACEMENT}


def serve_on(cluster: NetnsCluster, config_fields: dict[str, Any], name: str) -> subprocess.Popen[bytes]:
    """`specserve up --address HEAD` on the head node with `config_fields`, once its gRPC door answers."""
    config = cluster.root / f"{name}.yaml"
    config.write_text(yaml.safe_dump(config_fields))
    driver = cluster.driver([str(VENV_BIN / "specserve"), "up", "--config", str(config),
                             "--address", cluster.gcs_address], name=name)
    grpc_address = f"{cluster.head.address}:{GRPC_PORT}"
    deadline = time.monotonic() + DEPLOY_TIMEOUT_S
    while True:
        assert driver.poll() is None, f"specserve up exited {driver.returncode}: {_tail(cluster, name)}"
        try:
            with SpecServeClient(grpc_address, timeout_s=5) as client:
                if client.health()[0]:
                    return driver
        except Exception:  # not listening yet (an RpcError, a refused connection)
            pass
        assert time.monotonic() < deadline, f"not serving after {DEPLOY_TIMEOUT_S:.0f} s: {_tail(cluster, name)}"
        time.sleep(2.0)


@contextlib.contextmanager
def serving(cluster: NetnsCluster, config_fields: dict[str, Any], name: str,
            timeout_s: float = 120) -> Iterator[SpecServeClient]:
    """`serve_on`, a gRPC client to the head's door for the block, and `up` stopped after it (Serve shut down)."""
    driver = serve_on(cluster, config_fields, name)
    try:
        with SpecServeClient(f"{cluster.head.address}:{GRPC_PORT}", timeout_s=timeout_s) as client:
            yield client
    finally:
        driver.terminate()
        driver.wait(timeout=60)


@pytest.fixture(scope="module")
def served(netns_cluster: NetnsCluster) -> Iterator[NetnsCluster]:
    driver = serve_on(netns_cluster, cluster_config(), "up")
    yield netns_cluster
    driver.terminate()  # `up` shuts Serve down: the next module deploys afresh
    driver.wait(timeout=60)


def _tail(cluster: NetnsCluster, name: str) -> str:
    path = cluster.logs / f"{name}.log"
    return path.read_text(errors="replace")[-3000:] if path.exists() else "(no log)"


@pytest.fixture(scope="module")
def client(served: NetnsCluster) -> Iterator[SpecServeClient]:
    with SpecServeClient(f"{served.head.address}:{GRPC_PORT}", timeout_s=120) as c:
        yield c


def test_each_part_runs_on_its_own_node(served: NetnsCluster) -> None:
    titles = {node.spec.name: [p for p in node.processes() if " ray::" in f" {p.split(' ', 1)[1]}"]
              for node in served.nodes}
    for name, parts in WHERE.items():
        for part in parts:
            assert any(part in title for title in titles[name]), (name, part, titles[name])
            others = [n for n in titles if n != name]
            assert not any(part in title for n in others for title in titles[n]), (part, titles)


@pytest.mark.parametrize("draft", ["model", "ngram", "none"])
def test_grpc_greedy_equals_in_process(client: SpecServeClient, reference: dict[str, dict[str, Any]],
                                       draft: str) -> None:
    for prompt in PROMPTS:
        (sample,) = collect(client.generate(prompt, max_tokens=MAX_TOKENS, k=4, contract="greedy",
                                            draft=draft)).values()
        assert sample["token_ids"] == reference[prompt]["token_ids"], (draft, prompt)
        assert sample["text"] == reference[prompt]["text"]
        if draft == "model":  # SmolLM2 drafting for itself: every greedy draft survives, and drafts were made
            assert sample["accepted"] == sample["proposed"] > 0


def test_http_answers_the_same(served: NetnsCluster, reference: dict[str, dict[str, Any]]) -> None:
    url = f"http://{served.head.address}:{HTTP_PORT}/v1/completions"
    for prompt in PROMPTS:
        body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": MAX_TOKENS, "k": 4, "draft": "model"}
        answer = requests.post(url, json=body, timeout=120).json()
        assert answer["choices"][0]["text"] == reference[prompt]["text"], answer
        assert answer["choices"][0]["token_ids"] == reference[prompt]["token_ids"]


def test_concurrent_streams(client: SpecServeClient, reference: dict[str, dict[str, Any]]) -> None:
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(PROMPTS[i % 2], ["model", "ngram"][i // 2 % 2]) for i in range(8)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda job: collect(client.generate(job[0], max_tokens=MAX_TOKENS, k=4,
                                                                    draft=job[1])), jobs))
    for (prompt, _), samples in zip(jobs, results, strict=True):
        assert samples[0]["token_ids"] == reference[prompt]["token_ids"]


def test_rounds_cross_nodes_over_tcp(served: NetnsCluster, client: SpecServeClient) -> None:
    """The scheduler's links to the verifier, drafter and KV manager are TCP connections to their nodes' own
    addresses: its channel log lines say so, and ss in the head's namespace shows them established."""
    collect(client.generate(PROMPTS[0], max_tokens=4, k=4, draft="model"))
    workers = {served.node(name).address for name in ("verifier", "drafter", "kv")}
    logs = served.log_text(f"{served.head.spec.name}/**/*")
    connected = set(re.findall(r"channel connected: tcp \S+ -> ([\d.]+):\d+", logs))
    assert workers <= connected, (workers, connected)
    assert "channel connected: unix" not in logs  # nothing of the round shares the scheduler's node
    established = served.head.sh("ss -Htn state established")
    peers = {line.split()[-1].rsplit(":", 1)[0] for line in established.splitlines() if line.strip()}
    assert workers <= peers, established
    # and the workers listen on their own addresses, not loopback
    for name in ("verifier", "drafter", "kv"):
        node = served.node(name)
        listening = served.node(name).sh("ss -Htln")
        assert f"{node.address}:" in listening, listening


def test_stats_and_no_leaks(served: NetnsCluster, client: SpecServeClient) -> None:
    stats = client.stats()
    assert stats["engine"]["model"] == "smollm2-135m" and stats["kv"]["leaked_blocks"] == 0
    transport = stats.get("transport") or stats["scheduler"].get("transport") or {}
    if transport:
        assert transport.get("kind") == "channel", json.dumps(transport)[:500]
    audit = served.python("from ray import serve\nimport json\n"
                          "h = serve.get_deployment_handle('Scheduler', 'specserve')\n"
                          "r = h.audit.remote().result(timeout_s=60)\n"
                          "r.assert_no_leaks()\n"
                          "print(json.dumps({ns: [c.reserved, c.committed] for ns, c in r.counts.items()}))")
    counts = json.loads(audit.strip().splitlines()[-1])
    assert all(v == [0, 0] for v in counts.values()), counts


def _channel_bytes(served: NetnsCluster) -> dict[tuple[str, str], int]:
    """Bytes sent + received so far on each of the scheduler's round-channel connections ((local, peer) ->
    bytes): ss's TCP info for each established connection in the head's namespace whose peer is a channel
    endpoint from the scheduler's log lines (Ray's own connections are not counted)."""
    logs = served.log_text(f"{served.head.spec.name}/**/*")
    endpoints = set(re.findall(r"channel connected: tcp \S+ -> ([\d.]+:\d+)", logs))
    counted = {}
    lines = served.head.sh("ss -Htin state established").splitlines()
    for line, info in zip(lines, lines[1:], strict=False):
        fields = line.split()
        if len(fields) < 4 or fields[-1] not in endpoints:
            continue
        sent = re.search(r"bytes_sent:(\d+)", info)
        received = re.search(r"bytes_received:(\d+)", info)
        counted[(fields[-2], fields[-1])] = (int(sent.group(1)) if sent else 0) + (
            int(received.group(1)) if received else 0)
    return counted


def _bytes_per_node(served: NetnsCluster, before: dict[tuple[str, str], int],
                    after: dict[tuple[str, str], int]) -> dict[str, int]:
    """Each worker node's bytes between the two snapshots (a connection made in between counts from 0; one
    closed in between is lost: a drafter that timed out under load reconnects)."""
    by_address = {served.node(name).address: name for name in ("verifier", "drafter", "kv")}
    totals = dict.fromkeys(by_address.values(), 0)
    for (local, peer), count in after.items():
        totals[by_address[peer.rsplit(":", 1)[0]]] += count - before.get((local, peer), 0)
    return totals


def measure_rounds(client: SpecServeClient, batches: int = 2) -> dict[str, float]:
    """4 concurrent greedy requests of 40 tokens drafted by the model at k = 4, `batches` times: the round's split
    (cluster/bench/serve.py round_split: each hop's transport, the verify, the draft) over all of them."""
    from concurrent.futures import ThreadPoolExecutor

    from cluster.bench.serve import cluster_snapshot, round_split

    collect(client.generate(PROMPTS[0], max_tokens=4, k=4, draft="model"))  # every link connected
    before = cluster_snapshot(client)
    with ThreadPoolExecutor(max_workers=4) as pool:
        for _ in range(batches):
            list(pool.map(lambda i: collect(client.generate(PROMPTS[i % 2], max_tokens=40, k=4, draft="model")),
                          range(4)))
    split = round_split(before, cluster_snapshot(client))
    assert split is not None and split["transport"] == "channel"
    return split


def describe_split(split: dict[str, float]) -> str:
    return ", ".join(f"{key.removesuffix('_ms')} {value:.2f}" for key, value in split.items()
                     if key.endswith("transport_ms") or key in ("hops_ms", "round_ms", "verify_ms", "draft_ms"))


def test_what_crosses_each_node_boundary_per_round(served: NetnsCluster, client: SpecServeClient) -> None:
    """The round channels' bytes per engine round on each worker's connection(s), and the round's split with
    each hop's transport, measured around batches of greedy requests; printed for docs/multinode.md (beside the
    single-node layout's: test_single_node.py). No KV block and no logits row crosses: a round's frames are token
    ids, grants and (sampled) a draft's probabilities."""
    needs_own_addresses(served)  # the connections are told apart by their node's address
    collect(client.generate(PROMPTS[0], max_tokens=4, k=4, draft="model"))  # every link connected
    before = _channel_bytes(served)
    split = measure_rounds(client)
    after = _channel_bytes(served)
    rounds = int(split["rounds"])
    per_round = {name: count / rounds for name, count in _bytes_per_node(served, before, after).items()}
    print(f"\nround channels per round ({rounds} rounds of 4 requests x 40 tokens, k 4, draft model): "
          + ", ".join(f"{name} {b / 1024:.2f} KiB" for name, b in per_round.items()))
    print(f"across nodes, per round (ms): {describe_split(split)}")
    assert rounds > 0 and all(b > 0 for b in per_round.values()), (per_round, before, after)
    # SmolLM2's vocabulary is 49152: one float32 logits row is 192 KiB; a KV block (16 tokens) 720 KiB in bf16
    assert all(b < 64 * 1024 for b in per_round.values()), per_round


# -- last: a node lost under load (destructive: the module's deployment ends with it) -----------------------------
def test_drafter_node_lost_under_load_then_readded(served: NetnsCluster, client: SpecServeClient,
                                                   reference: dict[str, dict[str, Any]]) -> None:
    """Every process of the drafter's node killed at once (its raylet, agents and the Drafter replica) while 4
    streams run: the scheduler's drafter link breaks, the engine decodes plainly and no request fails or changes;
    the node comes back (`ray start` again in its namespace), Serve places a new Drafter there (the only node with
    its label), the engine tries it again after its back-off and the model drafts again."""
    import threading

    failures: list[str] = []
    done: list[int] = []
    stop = threading.Event()

    def stream(index: int) -> None:
        prompt = PROMPTS[index % 2]
        while not stop.is_set():
            try:
                (sample,) = collect(client.generate(prompt, max_tokens=MAX_TOKENS, k=4, draft="model")).values()
            except Exception as exc:  # noqa: BLE001 - every failure is the finding
                failures.append(f"{type(exc).__name__}: {exc}")
                continue
            if sample["token_ids"] != reference[prompt]["token_ids"]:
                failures.append(f"diverged: {prompt!r}")
            done.append(index)

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(3.0)
    drafter = served.node("drafter")
    assert any("Drafter" in title for title in drafter.processes())
    killed = drafter.kill()
    before_loss = len(done)
    lost_at = time.monotonic()
    time.sleep(10.0)
    after_loss = len(done) - before_loss
    stop.set()
    for thread in threads:
        thread.join(timeout=120)
    assert failures == [], failures[:5]
    assert after_loss > 0  # requests went on while the node was gone
    print(f"\ndrafter node lost ({len(killed)} processes): {after_loss} requests completed in the next 10 s, "
          f"{len(done)} in all, 0 failed or diverged")

    served.restart_node("drafter")
    deadline = time.monotonic() + 240
    while True:
        (sample,) = collect(client.generate(PROMPTS[0], max_tokens=MAX_TOKENS, k=4, draft="model")).values()
        assert sample["token_ids"] == reference[PROMPTS[0]]["token_ids"]
        if sample["accepted"] > 0:
            break
        assert time.monotonic() < deadline, "the model does not draft again after the node came back"
        time.sleep(2.0)
    print(f"drafting again {time.monotonic() - lost_at:.1f} s after the loss")
    assert any("Drafter" in title for title in drafter.processes())
    stats = client.stats()
    assert stats["kv"]["leaked_blocks"] == 0


def run_streams(client: SpecServeClient, reference: dict[str, dict[str, Any]], outcomes: list[str],
                stop: Any, draft: str = "ngram", streams: int = 4) -> list[Any]:
    """`streams` threads sending greedy requests until `stop` is set, each outcome appended: ok (the in-process
    engine's tokens), error_finish (ended by the server mid-way, its tokens a prefix of the reference's),
    diverged, or `error TYPE: ...` (the call raised)."""
    import threading

    def stream(index: int) -> None:
        prompt = PROMPTS[index % 2]
        want = reference[prompt]["token_ids"]
        while not stop.is_set():
            try:
                (sample,) = collect(client.generate(prompt, max_tokens=MAX_TOKENS, k=4, draft=draft)).values()
            except Exception as exc:  # noqa: BLE001 - every failure is recorded
                outcomes.append(f"error {type(exc).__name__}: {str(exc)[:160]}")
                time.sleep(1.0)
                continue
            if sample["finish_reason"] == "error":
                outcomes.append("error_finish" if want[:len(sample["token_ids"])] == sample["token_ids"] else "diverged")
                time.sleep(1.0)
                continue
            outcomes.append("ok" if sample["token_ids"] == want else "diverged")

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(streams)]
    for thread in threads:
        thread.start()
    return threads


def summary(outcomes: list[str]) -> tuple[int, list[str], int, int]:
    """ok, raised errors, error_finish, diverged."""
    return (outcomes.count("ok"), [o for o in outcomes if o.startswith("error ")], outcomes.count("error_finish"),
            outcomes.count("diverged"))


def test_verifier_node_lost_under_load_then_readded(served: NetnsCluster, client: SpecServeClient,
                                                    reference: dict[str, dict[str, Any]]) -> None:
    """The verifier's node killed at once under 4 streams and started again 5 s later: Serve places a new
    Verifier there (the only node with its label); the requests in flight are requeued and re-prefilled (§6):
    none fails, none diverges."""
    errors, error_finish, diverged = lost_under_load(served, client, reference, "verifier", "Verifier")
    assert (errors, error_finish, diverged) == ([], 0, 0), sorted(set(errors))[:5]


def test_kv_node_lost_under_load_then_readded(served: NetnsCluster, client: SpecServeClient,
                                              reference: dict[str, dict[str, Any]]) -> None:
    """The KV manager's node killed at once under 4 streams and started again 5 s later: the restarted actor
    (on the node that came back) rebuilds its ledger from the scheduler's live record (§6) and the requests in
    flight go on: none fails, none diverges, nothing leaks."""
    errors, error_finish, diverged = lost_under_load(served, client, reference, "kv", "KVManager")
    assert (errors, error_finish, diverged) == ([], 0, 0), sorted(set(errors))[:5]
    with SpecServeClient(f"{served.head.address}:{GRPC_PORT}", timeout_s=60) as fresh:
        assert fresh.stats()["kv"]["leaked_blocks"] == 0


def lost_under_load(served: NetnsCluster, client: SpecServeClient, reference: dict[str, dict[str, Any]],
                    name: str, part: str) -> tuple[list[str], int, int]:
    """Node `name` (hosting `part`) lost 3 s into 4 greedy streams and started again (`lose_node`); the streams'
    (errors, error finishes, diverged), the counts printed."""
    import threading

    outcomes: list[str] = []
    stop = threading.Event()
    threads = run_streams(client, reference, outcomes, stop)
    time.sleep(3.0)
    recovered = lose_node(served, name, part, outcomes)
    stop.set()
    for thread in threads:
        thread.join(timeout=180)
    ok, errors, error_finish, diverged = summary(outcomes)
    print(f"\n{name} node lost, back after 5 s: {ok} ok, {len(errors)} errors, {error_finish} error_finish, "
          f"{diverged} diverged; 4 more served {recovered:.1f} s after the loss")
    return errors, error_finish, diverged


def lose_node(served: NetnsCluster, name: str, part: str, outcomes: list[str], back_after_s: float = 5.0) -> float:
    """Kill every process of node `name` at once, start it again `back_after_s` later, wait until `part` runs
    there again and 4 more requests ended well; the seconds from the loss to then."""
    node = served.node(name)
    ok_before = outcomes.count("ok")
    killed = node.kill()
    assert killed, name
    lost_at = time.monotonic()
    time.sleep(back_after_s)
    served.restart_node(name)
    deadline = time.monotonic() + 300
    while outcomes.count("ok") < ok_before + 4 or not any(part in title for title in node.processes()):
        assert time.monotonic() < deadline, outcomes[-10:]
        time.sleep(1.0)
    return time.monotonic() - lost_at
