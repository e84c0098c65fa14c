"""One client cannot starve the others (issue 71, fair shares per key), measured from outside the process on a
deployment with API keys: how long a victim key's short request takes alone, beside seven other keys with one long
request each (a batch shared fairly: the floor no scheduler can beat), and while one hog key (a) keeps n: 16 long
generations going or (b) holds 150 streams on one gRPC channel, in the same run.

The bound is in the engine's rounds, not seconds (a timed assertion fails on a busy machine, and speed belongs to
benchmarks): a victim request's rounds are the scheduler's round count after its answer less the count before it
was sent. A fair scheduler admits the victim at its next round whoever fills the batch (the hog yields a slot:
cluster/engine/fair_share.py), so beside the hog it finishes in about the rounds it takes beside fair co-tenants;
a starving one would keep it queued until a hog request ended (up to 200 rounds, its max_tokens). What this bound
catches is starvation of the size issue 71 reported (tens of seconds: hundreds of rounds), where the per-client
limits and the fair order fail; the full batch's yield alone is not visible here (with it switched off the victim's
median read 11 rounds against 10 beside fair co-tenants, 2026-12-07, EPYC: the hog's excess is refused at the door,
so it seldom holds every slot) and is tested in process (tests/cluster/engine/test_fair_share.py). Beside the hog the
victim's median stays within FAIR_ROUNDS of its median beside the fair co-tenants; nothing answers 5xx, the hog's
excess is refused with 429 / RESOURCE_EXHAUSTED and a retry hint, the per-client metrics name key ids (never a key),
and nothing leaks. The seconds are printed beside the rounds (what a user would feel; on 2 vCPUs a round of 8
requests costs ~3x a round of one).
Before the shares (issue 71): one key's n: 16 x 2000 tokens took every batch slot for 45 s, and 150 streams on one
key made another key's request wait 41 s. One deployment for the module, on the session's Ray. Run inside the
loopback-only namespace (scripts/in-netns.sh).
"""

from __future__ import annotations

import re
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
import requests

from cluster.client import CapacityError, Credentials, SpecServeClient
from cluster.serving.auth import client_id
from cluster.serving.config import ClusterConfig, load_config

pytestmark = pytest.mark.timeout(600)

GRPC_PORT, HTTP_PORT = 19610, 18610
MODEL = "smollm2-135m"
HOG = "sk-hog-0123456789abcdef0123"
VICTIM_KEY = "sk-victim-0123456789abcdef01"
VICTIM = {"model": MODEL, "prompt": "def fibonacci(n):", "max_tokens": 8, "ignore_eos": True, "temperature": 0}
SAMPLES = 7
FAIR_ROUNDS = 4  # the victim's median rounds beside the hog, at most this many more than beside fair co-tenants
# (the rounds the others run between the count read before a request and its arrival, and after its answer)
NEIGHBOURS = [f"sk-neighbour-{i}-0123456789abcdef" for i in range(7)]  # a full batch with the victim
MAX_BATCH, QUEUE, MAX_CONTEXT = 8, 200, 512


@pytest.fixture(scope="module")
def served(ray_session: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterConfig]:
    from ray import serve

    from cluster.serving.app import deploy

    key_file = tmp_path_factory.mktemp("keys") / "api-keys"
    key_file.write_text("\n".join([HOG, VICTIM_KEY, *NEIGHBOURS]) + "\n")
    config = load_config(model=MODEL, draft="ngram", worker_threads=1, kv_blocks=512, max_batch=MAX_BATCH,
                         queue_capacity=QUEUE, max_context=MAX_CONTEXT, warm_up=False, grpc_port=GRPC_PORT,
                         http_port=HTTP_PORT, api_key_file=str(key_file), health_check_period_s=1.0,
                         graceful_shutdown_wait_loop_s=0.2, graceful_shutdown_timeout_s=2.0)
    deploy(config)
    try:
        for _ in range(3):  # warm: the first requests pay for lazy imports and first allocations
            assert post(VICTIM, VICTIM_KEY).status_code == 200
        yield config
    finally:
        serve.shutdown()


def post(body: dict[str, Any], key: str, path: str = "/v1/completions") -> requests.Response:
    return requests.post(f"http://127.0.0.1:{HTTP_PORT}{path}", json=body,
                         headers={"Authorization": f"Bearer {key}"}, timeout=300)


@dataclass(frozen=True)
class Victim:
    """The victim's median request: seconds, and the scheduler's rounds from before it was sent to after its answer."""

    seconds: float
    rounds: float


def victim_median() -> Victim:
    times, rounds = [], []
    for _ in range(SAMPLES):
        before = scheduler_stats()["scheduler"]["rounds"]
        started = time.perf_counter()
        answer = post(VICTIM, VICTIM_KEY)
        times.append(time.perf_counter() - started)
        rounds.append(scheduler_stats()["scheduler"]["rounds"] - before)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == VICTIM["max_tokens"]
    return Victim(statistics.median(times), statistics.median(rounds))


def scheduler_stats() -> dict[str, Any]:
    from ray import serve

    return serve.get_deployment_handle("Scheduler", "specserve").stats.remote().result(timeout_s=60)


def wait_idle(timeout_s: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while (stats := scheduler_stats())["scheduler"]["live"] or stats["engine"]["running"] or stats["engine"]["waiting"]:
        assert time.monotonic() < deadline, stats["scheduler"]
        time.sleep(0.2)
    return stats


def beside(load: Callable[[int, threading.Event, Counter], None], workers: int) -> tuple[Victim, Counter]:
    """The victim's median while `workers` threads run `load(index, stop, seen)` until the victim is done."""
    stop = threading.Event()
    seen: Counter = Counter()
    with ThreadPoolExecutor(workers) as pool:
        loads = [pool.submit(load, index, stop, seen) for index in range(workers)]
        try:
            time.sleep(2.0)  # the load holds the batch
            loaded = victim_median()
        finally:
            stop.set()
        for running in loads:
            running.result(timeout=300)
    return loaded, seen


def neighbours(index: int, stop: threading.Event, seen: Counter) -> None:
    """A fair co-tenant: its own key, one long request at a time."""
    body = {"model": MODEL, "prompt": f"# neighbour {index}\nOnce upon a time", "max_tokens": 120,
            "ignore_eos": True, "temperature": 0.8, "seed": index}
    while not stop.is_set():
        seen[post(body, NEIGHBOURS[index]).status_code] += 1


def under(hog: Callable[[int, threading.Event, Counter], None], workers: int) -> tuple[Victim, Victim, Counter]:
    """The victim's median alone, beside fair neighbours, and beside the hog; returns (alone, beside the hog) after
    checking the bound (in rounds; the seconds printed)."""
    alone = victim_median()
    fair, neighbours_seen = beside(neighbours, len(NEIGHBOURS))
    loaded, seen = beside(hog, workers)
    print(f"victim median alone {alone.rounds:g} rounds {alone.seconds:.3f} s, beside {len(NEIGHBOURS)} fair "
          f"neighbours {fair.rounds:g} rounds {fair.seconds:.3f} s, beside the hog {loaded.rounds:g} rounds "
          f"{loaded.seconds:.3f} s ({loaded.seconds / fair.seconds:.2f}x fair in seconds); hog answers {dict(seen)}")
    assert set(neighbours_seen) == {200}, neighbours_seen
    assert loaded.rounds <= fair.rounds + FAIR_ROUNDS, (alone, fair, loaded)
    return alone, loaded, seen


def test_one_keys_n16_generations_leave_the_other_key_within_bound(served: ClusterConfig) -> None:
    lock = threading.Lock()
    body = {"model": MODEL, "prompt": "Once upon a time", "n": 16, "max_tokens": 200, "ignore_eos": True,
            "temperature": 0.8, "seed": 1}

    def hog(_: int, stop: threading.Event, seen: Counter) -> None:
        while not stop.is_set():
            answer = post(body, HOG)
            with lock:
                seen[answer.status_code] += 1
            if answer.status_code == 429:
                assert answer.headers["Retry-After"] == str(served.retry_after_s)
                time.sleep(0.2)

    _, _, seen = under(hog, workers=2)
    assert set(seen) <= {200, 429} and seen[429] >= 1, seen  # the second n: 16 waits outside: past the hog's tokens
    stats = wait_idle()
    assert stats["scheduler"]["clients"] == {}
    assert stats["kv"]["leaked_blocks"] == 0


def test_150_streams_on_one_key_leave_the_other_key_within_bound(served: ClusterConfig) -> None:
    hog_client = SpecServeClient(f"127.0.0.1:{GRPC_PORT}", credentials=Credentials(api_key=HOG), timeout_s=300)
    limit = served.client_limits().completions  # half the queue: 100
    lock = threading.Lock()

    def hog(_: int, stop: threading.Event, seen: Counter) -> None:
        streams = [hog_client.generate(f"# stream {i}\ndef f{i}(x):", max_tokens=48, ignore_eos=True, k=2)
                   for i in range(150)]

        def consume(stream: Any) -> str:
            try:
                for _ in stream:
                    if stop.is_set():
                        stream.cancel()
                        return "cancelled"
                return "finished"
            except CapacityError as refused:
                assert refused.retry_after_s == served.retry_after_s
                return "refused"

        with ThreadPoolExecutor(150) as readers:
            outcomes = list(readers.map(consume, streams))
        with lock:
            seen.update(outcomes)

    _, _, seen = under(hog, workers=1)
    assert seen["refused"] >= 150 - limit and seen["refused"] + seen["finished"] + seen["cancelled"] == 150, seen
    metrics = requests.get(f"http://127.0.0.1:{HTTP_PORT}/metrics", timeout=60).text
    hog_id = client_id(HOG, None)
    assert re.search(rf'specserve_client_refusals_total{{client="{hog_id}",limit="(completions|tokens)"}} [1-9]',
                     metrics), [line for line in metrics.splitlines() if "client" in line]
    assert HOG not in metrics and VICTIM_KEY not in metrics
    stats = wait_idle()
    assert stats["scheduler"]["clients"] == {}
    assert stats["kv"]["leaked_blocks"] == 0
    hog_client.close()
