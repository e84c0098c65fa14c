"""Every input's cost is bounded before it is paid (docs/api.md, "Limits"), measured from outside the process against
the live cluster (live_api/conftest.py): a victim client's median latency alone, then while other clients flood the
server with (a) requests of many stop strings and (b) huge prompts, in the same run. The victim stays within 3x its
latency alone, nothing answers 5xx, and each oversized input is refused with a 400 naming its field.

Before the bounds, 16,000 stop strings of 500 characters took another client from 0.09 s to 6.1 s, and twelve 1 MiB
CJK prompts, tokenized on the scheduler's event loop, held it for 30 s (issue 71).
Run inside the loopback-only namespace (scripts/in-netns.sh).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest
import requests

from cluster.client import SpecServeClient
from cluster.serving.config import ClusterConfig
from specserve_types.api import InvalidRequestError
from tests.cluster.serving.live_api.helpers import BASE_URL, MAX_CONTEXT, assert_no_leaks

pytestmark = pytest.mark.timeout(300)

VICTIM = {"prompt": "def fibonacci(n):", "max_tokens": 8, "ignore_eos": True}
VICTIM_SAMPLES = 9
ATTACKERS = 4
BOUND = 3.0  # the victim's median under a flood, at most this many times its median alone
CJK = "漢字仮名交じり文"
STARTS = " \ne"  # 3 bytes a character, about 2 tokens a character with SmolLM2's tokenizer


def post(body: dict[str, Any], path: str = "/v1/completions", timeout: float = 120) -> requests.Response:
    data = json.dumps(body, ensure_ascii=False).encode()  # UTF-8, as a client sends CJK
    return requests.post(f"{BASE_URL}{path}", data=data, headers={"content-type": "application/json"},
                         timeout=timeout)


def victim_median() -> float:
    times = []
    for _ in range(VICTIM_SAMPLES):
        started = time.perf_counter()
        answer = post(VICTIM)
        times.append(time.perf_counter() - started)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == VICTIM["max_tokens"]
    return statistics.median(times)


@contextmanager
def flood(bodies: list[dict[str, Any]]) -> Iterator[Counter]:
    """ATTACKERS clients sending `bodies` in turn, as fast as they are answered, until the block ends; yields the
    count of their answers by status (and the field a 400 named)."""
    stop = threading.Event()
    seen: Counter = Counter()
    lock = threading.Lock()

    def attack(first: int) -> None:
        at = first
        while not stop.is_set():
            answer = post(bodies[at % len(bodies)])
            at += 1
            key = answer.status_code, (answer.json()["error"]["param"] if answer.status_code == 400 else None)
            with lock:
                seen[key] += 1

    with ThreadPoolExecutor(ATTACKERS) as pool:
        attackers = [pool.submit(attack, index) for index in range(ATTACKERS)]
        try:
            time.sleep(1.0)  # the flood under way
            yield seen
        finally:
            stop.set()
            for attacker in attackers:
                attacker.result(timeout=120)


def alone_and_under_flood(bodies: list[dict[str, Any]]) -> tuple[float, float, Counter]:
    """The victim's median latency alone, then under a flood of `bodies` (measured one after the other: the
    machine's other load changes less in between)."""
    alone = victim_median()
    with flood(bodies) as seen:
        loaded = victim_median()
    print(f"victim median alone {alone:.3f} s, under the flood {loaded:.3f} s ({loaded / alone:.2f}x); "
          f"flood answers {dict(seen)}")
    return alone, loaded, seen


def stop_strings(count: int, length: int) -> list[str]:
    """Stop strings the output keeps almost starting (a blank, a newline, a letter, then what never comes)."""
    return [(STARTS[i % len(STARTS)] + f"{i:03d}" + "#" * length)[:length] for i in range(count)]


@pytest.fixture(scope="module")
def warm(cluster: ClusterConfig) -> None:
    for _ in range(3):
        assert post(VICTIM).status_code == 200


def test_a_stop_string_flood_leaves_the_victim_within_bound(warm: None) -> None:
    """At the limits (64 stop strings, 4096 characters) the requests run; past them (2000 of 500 characters, which
    took the engine's thread 0.1 s a token) they are refused."""
    at_limit = {"prompt": "def fibonacci(n):", "max_tokens": 8, "ignore_eos": True, "stop": stop_strings(64, 64)}
    too_many = {"prompt": "x", "max_tokens": 64, "ignore_eos": True, "stop": stop_strings(2000, 500)}  # 1 MB
    alone, loaded, seen = alone_and_under_flood([at_limit, too_many, too_many])
    assert loaded <= BOUND * alone
    assert set(seen) == {(200, None), (400, "stop")}, seen


def test_a_huge_prompt_flood_leaves_the_victim_within_bound(warm: None) -> None:
    """1 MiB of CJK text (refused by its bytes, before it is tokenized), one just within what the vocabulary
    allows (tokenized off the scheduler's loop, then too long for the context) and one past 1 MiB (refused at the
    door)."""
    most = (MAX_CONTEXT - 16) * 81 // 3  # SmolLM2's longest token is 81 bytes
    bodies = [{"prompt": CJK * (1 << 17), "max_tokens": 16},
              {"prompt": (CJK * most)[:most], "max_tokens": 16},
              {"prompt": "x" * ((1 << 20) + 1), "max_tokens": 16}]
    alone, loaded, seen = alone_and_under_flood(bodies)
    assert loaded <= BOUND * alone
    assert set(seen) == {(400, "prompt")}, seen


def test_oversized_inputs_are_refused_naming_the_field(cluster: ClusterConfig,
                                                       client: SpecServeClient) -> None:
    """Both doors, each field past its limit: a 400 / INVALID_ARGUMENT naming it, fast."""
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/completions", {"prompt": "x", "stop": ["ab" * 250] * 16_000}, "stop"),  # issue 71's 8 MB
        ("/v1/completions", {"prompt": "x", "stop": ["s" * 257]}, "stop"),
        ("/v1/completions", {"prompt": "x", "n": 16, "max_tokens": 1025}, "n"),
        ("/v1/completions", {"prompt": CJK * (1 << 17)}, "prompt"),
        ("/v1/completions", {"prompt": [1] * (MAX_CONTEXT + 1)}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 2049}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": CJK * 20_000}]}, "messages"),
    ]
    for path, body, field_name in cases:
        started = time.perf_counter()
        answer = post(body, path)
        assert answer.status_code == 400, answer.text[:300]
        assert answer.json()["error"]["param"] == field_name, answer.text[:300]
        assert time.perf_counter() - started < 5
    grpc_cases: list[tuple[Callable[[], Any], str]] = [
        (lambda: list(client.generate("x", stop=["s"] * 65)), "stop"),
        (lambda: list(client.generate(CJK * (1 << 17), max_tokens=8)), "prompt"),
        (lambda: list(client.generate("x", n=16, max_tokens=1025)), "n"),
    ]
    for call, field_name in grpc_cases:
        with pytest.raises(InvalidRequestError) as refused:
            call()
        assert refused.value.field == field_name
    assert_no_leaks()
