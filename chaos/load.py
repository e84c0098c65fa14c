"""A bounded load generator: N concurrent requests in flight (gRPC and HTTP), each with a deadline, every chunk
recorded with its arrival time.

    LoadGenerator(workload, LoadSettings(concurrency=4)).start() ... .stop() -> list[RequestRecord]

The workload is a fixed list of `RequestSpec`s (prompt, greedy or seeded sampling, drafting) that the
workers take round-robin; greedy outputs are compared with a no-fault baseline of the same specs
(`run_baseline`, chaos/invariants.py). Knobs a chaos action may turn while the load runs (`LoadSettings`):
the cancel fraction (a cancelled request stops reading at a random chunk and cancels), a short deadline for
a fraction of requests, and a slow reader (a pause after every chunk).
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import requests

from cluster.client import Credentials, RemoteError, SpecServeClient
from specserve_types.api import CapacityError, InvalidRequestError, SpecServeError

PROMPTS = (
    "def fibonacci(n):",
    "The three primary colours are",
    "Write a haiku about the sea.",
    "import numpy as np\n\ndef normalize(x):",
    "Once upon a time, in a small village,",
    "SELECT name, age FROM users WHERE",
)

# the HTTP API's error types (cluster/serving/http_api.py) as the gRPC status codes they stand for
HTTP_ERROR_TYPES = {"unavailable_error": "UNAVAILABLE", "capacity_error": "RESOURCE_EXHAUSTED",
                    "invalid_request_error": "INVALID_ARGUMENT",
                    "internal_error": "INTERNAL"}


@dataclass(frozen=True)
class RequestSpec:
    key: str  # stable name of the spec (the baseline is keyed by it)
    prompt: str
    max_tokens: int
    protocol: str  # "grpc" | "http"
    temperature: float = 0.0
    seed: int | None = None
    draft: str = "model"  # "model" | "ngram" | "none"
    k: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def default_workload(max_tokens: int = 24, http_every: int = 4) -> list[RequestSpec]:
    """Greedy model-drafted and n-gram requests, seeded-sampled ones, and every `http_every`-th over HTTP."""
    specs: list[RequestSpec] = []
    for i, prompt in enumerate(PROMPTS):
        protocol = "http" if i % http_every == http_every - 1 else "grpc"
        specs.append(RequestSpec(f"g{i}", prompt, max_tokens, protocol, draft="model" if i % 2 == 0 else "ngram"))
    for i, prompt in enumerate(PROMPTS[:2]):
        specs.append(RequestSpec(f"s{i}", prompt, max_tokens, "grpc", temperature=0.8, seed=100 + i))
    return specs


@dataclass
class LoadSettings:
    concurrency: int = 4
    deadline_s: float = 60.0  # every request's deadline
    cancel_fraction: float = 0.0  # of requests cancelled at a random chunk
    short_deadline_fraction: float = 0.0  # of requests with `short_deadline_s` instead
    short_deadline_s: float = 0.5
    slow_reader_s: float = 0.0  # pause after every chunk (a slow-reading client)
    cancel_after_chunks: int = 0  # > 0: a cancelled request cancels after this many chunks (else a random token)
    cancel_max_tokens: int = 0  # > 0: a cancelled request asks for this many tokens (surely running when cancelled)
    k: int | None = None  # every request's k instead of its spec's (greedy outputs do not depend on it)


@dataclass
class RequestRecord:
    request_id: str
    spec: str
    protocol: str
    greedy: bool
    start: float  # wall clock (time.time())
    deadline_s: float
    max_tokens: int = 0  # what it asked for (its spec's, or LoadSettings.cancel_max_tokens)
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[list[int]] = field(default_factory=list)
    chunk_offsets: list[int] = field(default_factory=list)  # each chunk's own offset (the server's count before it)
    text: str = ""
    outcome: str = "pending"  # "completed" | "error_finish" | "cancelled" | a status code name (UNAVAILABLE, ...)
    finish_reason: str | None = None
    detail: str = ""
    proposed: int = 0
    accepted: int = 0
    planned_cancel: bool = False

    @property
    def tokens(self) -> list[int]:
        return [t for chunk in self.chunk_tokens for t in chunk]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class LoadGenerator:
    def __init__(self, grpc_address: str, http_base: str, model: str, workload: list[RequestSpec],
                 settings: LoadSettings | None = None, seed: int = 0, name: str = "load") -> None:
        self.grpc_address = grpc_address
        self.http_base = http_base
        self.model = model
        self.workload = workload
        self.settings = settings or LoadSettings()
        self.name = name
        self.records: list[RequestRecord] = []
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._next = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # the credentials of the environment (SPECSERVE_API_KEY, SPECSERVE_TLS_CA_FILE; cluster/client.py), both doors
        self._credentials = Credentials.from_env()
        self._client = SpecServeClient(grpc_address, credentials=self._credentials)

    # -- control -----------------------------------------------------------------------------------
    def start(self) -> LoadGenerator:
        for i in range(self.settings.concurrency):
            thread = threading.Thread(target=self._worker, name=f"{self.name}-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self, timeout_s: float | None = None) -> list[RequestRecord]:
        """Stop issuing; wait for the requests in flight to end (each is bounded by its deadline)."""
        self._stop.set()
        limit = timeout_s if timeout_s is not None else self.settings.deadline_s + 30
        for thread in self._threads:
            thread.join(limit)
        self._client.close()
        with self._lock:
            return list(self.records)

    def run_each_once(self) -> list[RequestRecord]:
        """Every spec once, `concurrency` at a time, without cancels or short deadlines (the baseline)."""
        specs = list(self.workload)
        threads = []
        for i in range(self.settings.concurrency):
            part = specs[i::self.settings.concurrency]
            thread = threading.Thread(target=lambda part=part: [self._one(s, plain=True) for s in part], daemon=True)
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()
        self._client.close()
        return list(self.records)

    # -- workers -----------------------------------------------------------------------------------
    def _take(self) -> tuple[RequestSpec, int]:
        with self._lock:
            index = self._next
            self._next += 1
        return self.workload[index % len(self.workload)], index

    def _worker(self) -> None:
        while not self._stop.is_set():
            spec, _ = self._take()
            self._one(spec)

    def _one(self, spec: RequestSpec, plain: bool = False) -> RequestRecord:
        s = self.settings
        with self._lock:
            draw = self._rng.random(), self._rng.random(), self._rng.randrange(1, max(2, spec.max_tokens // 2))
            index = len(self.records)
        cancel_at = draw[2] if not plain and draw[0] < s.cancel_fraction else None
        deadline = s.short_deadline_s if not plain and draw[1] < s.short_deadline_fraction else s.deadline_s
        max_tokens = s.cancel_max_tokens if cancel_at is not None and s.cancel_max_tokens > 0 else spec.max_tokens
        record = RequestRecord(f"{self.name}-{index}-{spec.key}", spec.key, spec.protocol, spec.greedy, time.time(),
                               deadline, max_tokens, planned_cancel=cancel_at is not None)
        with self._lock:
            self.records.append(record)
        try:
            if spec.protocol == "http":
                self._http(spec, record, cancel_at)
            else:
                self._grpc(spec, record, cancel_at)
        except CapacityError as exc:
            record.outcome, record.detail = "RESOURCE_EXHAUSTED", str(exc)
        except InvalidRequestError as exc:
            record.outcome, record.detail = "INVALID_ARGUMENT", str(exc)
        except RemoteError as exc:
            record.outcome, record.detail = exc.code.name, exc.details
        except SpecServeError as exc:
            record.outcome, record.detail = "INTERNAL", str(exc)
        except requests.Timeout as exc:
            record.outcome, record.detail = "DEADLINE_EXCEEDED", repr(exc)
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as exc:
            # refused, or reset mid-stream (a proxy that died): the transport failed, as gRPC's UNAVAILABLE
            record.outcome, record.detail = "UNAVAILABLE", repr(exc)
        except Exception as exc:  # recorded, never raised: the invariants judge it
            record.outcome, record.detail = "CLIENT_ERROR", repr(exc)
        record.end = time.time()
        return record

    def _add_chunk(self, record: RequestRecord, tokens: list[int], text: str, proposed: int, accepted: int,
                   offset: int) -> None:
        record.chunk_times.append(time.time())
        record.chunk_tokens.append(list(tokens))
        record.chunk_offsets.append(offset)
        record.text += text
        record.proposed += proposed
        record.accepted += accepted
        if self.settings.slow_reader_s > 0:
            time.sleep(self.settings.slow_reader_s)

    def _k(self, spec: RequestSpec) -> int | None:
        return spec.k if self.settings.k is None else int(self.settings.k)

    def _cancel_now(self, record: RequestRecord, cancel_at: int | None) -> bool:
        if cancel_at is None:
            return False
        if self.settings.cancel_after_chunks > 0:
            return len(record.chunk_tokens) >= self.settings.cancel_after_chunks
        return sum(map(len, record.chunk_tokens)) >= cancel_at

    def _grpc(self, spec: RequestSpec, record: RequestRecord, cancel_at: int | None) -> None:
        stream = self._client.generate(
            spec.prompt, timeout_s=record.deadline_s, max_tokens=record.max_tokens, temperature=spec.temperature,
            seed=spec.seed, draft=spec.draft, k=self._k(spec), ignore_eos=True, request_id=record.request_id,
            contract="greedy" if spec.greedy else "exact")
        for item in stream:
            chunk = item.chunk
            self._add_chunk(record, chunk.token_ids, chunk.text_delta, chunk.proposed, chunk.accepted, chunk.offset)
            if chunk.finished:
                record.finish_reason = chunk.finish_reason
                record.outcome = "error_finish" if chunk.finish_reason == "error" else "completed"
                if chunk.finish_reason == "error":
                    record.detail = str((chunk.stats or {}).get("error", ""))
                return
            if self._cancel_now(record, cancel_at):
                stream.cancel()
                record.outcome = "cancelled"
                return
        if record.outcome == "pending":  # the stream ended without a final chunk
            record.outcome = "cancelled" if cancel_at is not None else "TRUNCATED"

    def _http(self, spec: RequestSpec, record: RequestRecord, cancel_at: int | None) -> None:
        body = {"model": self.model, "prompt": spec.prompt, "max_tokens": record.max_tokens, "stream": True,
                "temperature": spec.temperature, "ignore_eos": True, "draft": spec.draft,
                "contract": "greedy" if spec.greedy else "exact"}
        if spec.seed is not None:
            body["seed"] = spec.seed
        if self._k(spec) is not None:
            body["k"] = self._k(spec)
        deadline = time.monotonic() + record.deadline_s
        with requests.post(f"{self.http_base}/v1/completions", json=body, stream=True,
                           headers=self._credentials.http_headers(), verify=self._credentials.http_verify,
                           timeout=(5.0, record.deadline_s)) as response:
            if response.status_code != 200:
                code = {429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED",
                        408: "DEADLINE_EXCEEDED", 400: "INVALID_ARGUMENT"}.get(response.status_code, "INTERNAL")
                record.outcome, record.detail = code, f"HTTP {response.status_code}: {response.text[:200]}"
                return
            for line in response.iter_lines():
                if time.monotonic() > deadline:
                    record.outcome = "DEADLINE_EXCEEDED"
                    return
                if not line or not line.startswith(b"data: "):
                    continue
                data = line[len(b"data: "):]
                if data == b"[DONE]":
                    break
                payload = json.loads(data)
                if "error" in payload:  # an in-band error event: its type says which (cluster/serving/http_api.py)
                    kind = payload["error"].get("type") if isinstance(payload["error"], dict) else None
                    record.outcome = HTTP_ERROR_TYPES.get(str(kind), "INTERNAL")
                    record.detail = json.dumps(payload["error"])[:200]
                    return
                extra = payload.get("specserve") or {}
                for choice in payload.get("choices", []):
                    self._add_chunk(record, extra.get("token_ids", []), choice.get("text", ""),
                                    extra.get("proposed", 0), extra.get("accepted", 0), int(extra.get("offset", 0)))
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
                if self._cancel_now(record, cancel_at):
                    record.outcome = "cancelled"
                    return  # closing the response drops the connection: the server aborts the request
        if record.finish_reason is None:
            record.outcome = "TRUNCATED"
        else:
            record.outcome = "error_finish" if record.finish_reason == "error" else "completed"
