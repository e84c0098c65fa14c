"""The Scheduler deployment: admission, per-request streams, and the engine loop against remote workers.

One replica owns one engine (continuous batching over all admitted requests); the engine calls the
Drafter and Verifier deployments through handle adapters (cluster/serving/remote_backends.py) from its own thread.

Admission is bounded: more than `queue_capacity` live completions -> CapacityError at once (the
ingress answers RESOURCE_EXHAUSTED / HTTP 429; nothing waits in a hidden queue). A prompt too long in bytes for the
context is refused before that, and prompts are tokenized on threads, not on the event loop
(cluster/serving/prompt_tokens.py). Each client (an API key's id, or a connection's: GenerateArgs.client) may hold at most
its share, in completions and in tokens (cluster/serving/client_shares.py; past it a capacity refusal too), and the
engine admits the clients' requests in turn (cluster/engine/fair_share.py). A stream whose
consumer goes away (client disconnect, deadline, ingress cancel) aborts its unfinished completions
in the engine, which rolls back their KV reservations.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import ray
from jinja2 import TemplateError
from ray import serve
from ray.serve.exceptions import RayServeException

from cluster.engine.request_state import resolve_max_tokens
from cluster.engine.round_spans import RoundSpans
from cluster.engine.step_record import EngineObserver, Observers
from cluster.engine.stop_strings import stop_matcher
from cluster.serving.chunk_push import ChunkPusher, PushEnded, PushLink, PushLost, PushStarted, PushTarget
from cluster.serving.client_shares import ClientShares, Share
from cluster.serving.config import ClusterConfig
from cluster.serving.engine_loop import Engine, EngineLoop
from cluster.serving.logprob_format import ids_of
from cluster.serving.metrics import SpecMetrics
from cluster.serving.prompt_tokens import PromptBound, PromptEncoder
from cluster.serving.token_pieces import TokenPieces
from cluster.serving.tool_calls import chat_prompt_ids
from specserve_types.api import (
    MAX_TOKENS_LIMIT,
    CapacityError,
    GenerationRequest,
    InvalidRequestError,
    SamplingParams,
    TokenChunk,
)
from specserve_types.faults import FaultHooks
from specserve_types.protocol import GenerateArgs, IndexedChunk, StreamError
from specserve_types.tracing import configure_tracing, shutdown_tracing

logger = logging.getLogger("ray.serve")

# (config, drafter handle or None, verifier handle) -> engine; runs in the engine thread
EngineBuilder = Callable[[ClusterConfig, Any, Any, EngineObserver | None], Engine]  # config, drafter, verifier, observer


def encode_prompt(tokenizer: Any, args: GenerateArgs) -> tuple[int, ...]:
    """Token ids of the prompt: given ids as they are, chat through the target's chat template."""
    if args.prompt_token_ids is not None:
        vocab_size = len(tokenizer)
        if max(args.prompt_token_ids) >= vocab_size:
            raise InvalidRequestError("prompt", f"token ids must be < vocabulary size {vocab_size}")
        return args.prompt_token_ids
    field_name = "messages" if args.chat else "prompt"
    try:
        if args.chat:  # the same calls as `specserve generate --chat`, with the tools and tool calls of one
            ids = chat_prompt_ids(tokenizer, args)
        else:
            ids = tokenizer(args.prompt_text)["input_ids"]
    except InvalidRequestError:  # tool_calls.chat_prompt_ids names the field itself
        raise
    except (TypeError, ValueError, TemplateError) as exc:  # the text was validated (api.check_text): the tokenizer
        # or the chat template refuses what the client sent (e.g. a template's role-order rule): the client's fault
        raise InvalidRequestError(field_name, f"cannot be tokenized: {type(exc).__name__}: {exc}") from None
    if not ids:
        raise InvalidRequestError(field_name, "tokenizes to no tokens")
    return tuple(ids)


def engine_observers(config: ClusterConfig, metrics: SpecMetrics) -> list[EngineObserver]:
    """What watches the engine's steps in this process: the metrics, and round spans when tracing is on."""
    observers: list[EngineObserver] = [metrics]
    if configure_tracing(config.tracing_settings(), "specserve-scheduler") is not None:
        observers.append(RoundSpans())
    return observers


def one_observer(observers: list[EngineObserver]) -> EngineObserver | None:
    """The engine's observer (it takes one, at construction): none, the one, or all of them in turn."""
    if not observers:
        return None
    return observers[0] if len(observers) == 1 else Observers(observers)


def completion_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Completion `index` of n: a seeded request gets seed + index, so the n samples differ."""
    if index == 0 or sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=sampling.seed + index)


def route_project_logs(into: logging.Logger = logger) -> None:
    """The project's own loggers (`specserve.*`: the round channels' connections, the cluster engine's start) into
    this replica's Serve log at INFO: Serve gives its handlers to `ray.serve` only, so they went nowhere. Once per
    process; nothing where `into` has no handlers (outside a replica)."""
    try:
        serve.get_replica_context()
    except RayServeException:  # not in a replica (a test's Scheduler): the process's logging stays as it is
        return
    project = logging.getLogger("specserve")
    if project.handlers or not into.handlers:
        return
    for handler in into.handlers:
        project.addHandler(handler)
    project.setLevel(logging.INFO)
    project.propagate = False


class Scheduler(FaultHooks):
    def __init__(self, config: ClusterConfig, drafter: Any, verifier: Any,
                 engine_builder: EngineBuilder | None = None) -> None:
        route_project_logs()
        if engine_builder is None:
            from cluster.serving.remote_backends import build_cluster_engine as engine_builder
        self._config = config
        self.metrics = SpecMetrics(ray_metrics=ray.is_initialized())
        observer = one_observer(engine_observers(config, self.metrics))
        def build() -> Engine:
            engine = engine_builder(config, drafter, verifier, observer)
            self._loop.hold_chunks_until(getattr(engine, "drafter", None), getattr(engine, "verifier", None))
            return engine

        self._loop = EngineLoop(build)
        self._live = 0  # admitted completions not yet finished or aborted
        self._pending: dict[str, dict[str, int]] = {}  # client request id -> unfinished engine ids (event loop)
        self._counters = {"admitted": 0, "rejected_capacity": 0, "rejected_client_share": 0, "rejected_invalid": 0,
                          "aborted": 0, "finished": 0, "errored": 0}
        self._shares = ClientShares(config.client_limits(),  # each client's completions and tokens (event loop)
                                    lambda client, share: self.metrics.client_share(client, share.completions,
                                                                                    share.tokens),
                                    self.metrics.client_refused)
        self._started_at = time.time()
        self._pusher: ChunkPusher | None = None  # links to the ingresses' chunk inboxes (made on this event loop)
        # the chunks' way to the ingress (cluster/serving/chunk_push.py): pushed or through the Serve stream, the
        # requests whose inbox could not be reached, the requests ended by a link lost mid-way
        self._chunks = {"pushed": 0, "through_serve": 0, "push_fallbacks": 0, "push_lost": 0}
        self._token_pieces: TokenPieces | None = None  # token texts for log-probabilities (event loop)
        self._loop.start()
        self._loop.wait_ready()  # Serve marks the replica RUNNING only once the engine is built
        if self._loop.startup_error is not None:
            raise RuntimeError(f"engine construction failed: {self._loop.startup_error!r}") \
                from self._loop.startup_error
        tokenizer = self._loop.engine.tokenizer
        self._prompt_bound = PromptBound.of(tokenizer)  # the vocabulary read once (a second for 150k tokens)
        self._encoder = PromptEncoder(lambda args: encode_prompt(tokenizer, args), config.tokenizer_threads)
        logger.info("scheduler ready: model=%s draft=%s, a token at most %s bytes of a prompt", config.model,
                    config.draft, self._prompt_bound.bytes_per_token)

    def _readable(self, item: IndexedChunk, args: GenerateArgs, prompt: tuple[int, ...], started: set[int]
                  ) -> IndexedChunk:
        """The chunk with what a client reads beside log-probabilities: the texts of the tokens they name, and with
        echo the prompt's ids and text on each completion's first chunk (the tokenizer is here, not at the door)."""
        chunk, first = item.chunk, item.index not in started
        started.add(item.index)
        echo = args.echo and first
        if chunk.logprobs is None and chunk.prompt_logprobs is None and not echo:
            return item
        ids = set(chunk.token_ids) | ids_of(chunk.logprobs) | ids_of(chunk.prompt_logprobs)
        if chunk.prompt_logprobs is not None or echo:
            ids |= set(prompt)
        text = None
        if echo:
            text = args.prompt_text if args.prompt_text is not None else \
                self._loop.engine.tokenizer.decode(list(prompt), skip_special_tokens=False)
        if self._token_pieces is None:
            self._token_pieces = TokenPieces(self._loop.engine.tokenizer)
        return dataclasses.replace(item, pieces=self._token_pieces.pieces(ids),
                                   prompt_token_ids=prompt if echo or chunk.prompt_logprobs is not None else (),
                                   prompt_text=text)

    async def generate(self, args: GenerateArgs, push_to: PushTarget | None = None) -> AsyncIterator[Any]:
        """Stream IndexedChunk items of the n completions; a StreamError instead if refused. With `push_to` (an
        ingress's chunk inbox, cluster/serving/chunk_push.py) an admitted request's chunks go over that socket: the
        stream then yields PushStarted, and PushEnded(count) after the last chunk (or a StreamError)."""
        completion_ids = args.completion_ids()
        try:  # before anything is reserved or tokenized
            self._prompt_bound.check(args, self._max_context())
        except InvalidRequestError as exc:
            self._counters["rejected_invalid"] += 1
            yield StreamError.of(exc)
            return
        if self._live + len(completion_ids) > self._config.queue_capacity:
            self._counters["rejected_capacity"] += 1
            yield StreamError("capacity", f"server is full: {self._live} requests in flight, "
                              f"queue_capacity={self._config.queue_capacity}; retry later")
            return
        if args.request_id in self._pending:
            self._counters["rejected_invalid"] += 1
            yield StreamError("invalid", f"request id {args.request_id!r} is already in flight", "request_id")
            return
        if (refused := self._shares.take_completions(args.client, len(completion_ids))) is not None:
            self._counters["rejected_client_share"] += 1
            yield StreamError("capacity", refused)
            return
        self._live += len(completion_ids)  # taken before the first await: admission cannot overshoot
        taken = Share(completions=len(completion_ids))  # given back in the `finally`
        pending: dict[str, int] = {}  # engine request id -> completion index, until its final chunk
        self._pending[args.request_id] = pending
        try:
            try:
                stop = args.sampling.stop  # its automaton built on that thread too, not the engine's
                prompt = await self._encoder.encode(args, also=(lambda: stop_matcher(stop)) if stop else None)
                args = self._resolved(args, len(prompt))  # an unset max_tokens: what the context leaves
            except InvalidRequestError as exc:
                self._counters["rejected_invalid"] += 1
                yield StreamError.of(exc)
                return
            if len(prompt) + args.sampling.max_tokens > (max_context := self._max_context()):  # as the engine would
                self._counters["rejected_invalid"] += 1
                yield StreamError("invalid", f"prompt ({len(prompt)} tokens) + max_tokens ({args.sampling.max_tokens})"
                                  f" exceeds the context of {max_context} tokens", "prompt")
                return
            tokens = len(prompt) + len(completion_ids) * args.sampling.max_tokens  # the KV it may come to hold
            if (refused := self._shares.take_tokens(args.client, tokens)) is not None:
                self._counters["rejected_client_share"] += 1
                yield StreamError("capacity", refused)
                return
            taken = Share(len(completion_ids), tokens)
            chunks: asyncio.Queue[tuple[int, TokenChunk]] = asyncio.Queue()
            event_loop = asyncio.get_running_loop()
            requests = [GenerationRequest(engine_id, prompt, completion_sampling(args.sampling, index), args.spec,
                                          constraint=args.constraint, trace_context=args.trace_context,
                                          tenant=args.client)
                        for index, engine_id in enumerate(completion_ids)]

            def sink(index: int) -> Callable[[TokenChunk], None]:
                return lambda chunk: event_loop.call_soon_threadsafe(chunks.put_nowait, (index, chunk))

            pending.update({engine_id: index for index, engine_id in enumerate(completion_ids)})  # a cancel from
            try:  # here on aborts them; the n completions share the prompt's KV (one prefill, engine.submit_group)
                await asyncio.wrap_future(self._loop.submit_group(
                    requests, {engine_id: sink(index) for index, engine_id in enumerate(completion_ids)}))
            except (InvalidRequestError, CapacityError) as exc:
                pending.clear()  # all or none: nothing was submitted
                key = "rejected_invalid" if isinstance(exc, InvalidRequestError) else "rejected_capacity"
                self._counters[key] += 1
                yield StreamError.of(exc)
                return
            self._counters["admitted"] += len(completion_ids)
            link = await self._push_link(push_to)
            key = push_to.key if push_to is not None else 0
            if link is not None:
                yield PushStarted()
            pushed = 0
            started: set[int] = set()  # completions whose first chunk went out
            while pending:
                index, chunk = await chunks.get()
                if chunk.finished and pending.pop(chunk.request_id, None) is not None:  # aborts are counted already
                    self._counters["errored" if chunk.finish_reason == "error" else "finished"] += 1
                    stats = {**(chunk.stats or {}), "prompt_tokens": len(prompt)}
                    chunk = dataclasses.replace(chunk, stats=stats)
                    self.metrics.finished(stats, chunk.finish_reason)
                item = self._readable(IndexedChunk(index, dataclasses.replace(chunk, request_id=args.request_id),
                                                   args.spec.contract), args, prompt, started)
                if link is None:
                    self._chunks["through_serve"] += 1
                    yield item
                else:  # PushLost: the request ends with an internal error (below), and is aborted
                    try:
                        link.push(key, item)
                    except PushLost:
                        self._chunks["push_lost"] += 1
                        raise
                    pushed += 1
                    self._chunks["pushed"] += 1
            if link is not None:
                yield PushEnded(pushed)
        except Exception:  # an engine-loop failure: logged here, reported in-band without internals, aborted below
            logger.exception("request %s failed", args.request_id)
            yield StreamError("internal", f"internal server error (request id {args.request_id})")
        finally:
            self._live -= len(completion_ids)
            self._shares.give_back(args.client, taken.completions, taken.tokens)
            self._abort_pending(pending)
            if self._pending.get(args.request_id) is pending:
                del self._pending[args.request_id]

    def _max_context(self) -> int:
        """The engine's context (the config's, capped by the model's)."""
        return getattr(getattr(self._loop.engine, "config", None), "max_context", self._config.max_context)

    def _resolved(self, args: GenerateArgs, prompt_len: int) -> GenerateArgs:
        """`args` with max_tokens set where the request left it unset: the context left beside the prompt, within
        MAX_TOKENS_LIMIT and the request's share of max_request_tokens (n completions), so that the checks below
        and the client's share count what it may come to hold, and a request that sets nothing is never refused
        for its default (resolve_max_tokens)."""
        if args.sampling.max_tokens is not None:
            return args
        most = min(MAX_TOKENS_LIMIT, self._config.max_request_tokens // args.n)
        if most < 1:  # n alone is more than a request may generate
            self._config.request_limits().check_tokens(args.n, 1)
        return dataclasses.replace(args, sampling=resolve_max_tokens(args.sampling, prompt_len, self._max_context(),
                                                                     most))

    async def _push_link(self, push_to: PushTarget | None) -> PushLink | None:
        """The link to the ingress's inbox; None (the chunks go through the Serve stream) without one or if it
        cannot be reached."""
        if push_to is None:
            return None
        if self._pusher is None:
            self._pusher = ChunkPusher(ray.get_runtime_context().get_node_id() if ray.is_initialized() else None)
        try:
            return await self._pusher.link(push_to.endpoint)
        except (OSError, EOFError, TimeoutError) as exc:
            self._chunks["push_fallbacks"] += 1
            logger.warning("the ingress's chunk inbox %r cannot be reached (%r): this request's chunks go through "
                           "the Serve stream", push_to.endpoint, exc)
            return None

    def _abort_pending(self, pending: dict[str, int]) -> int:
        for engine_id in pending:
            self._counters["aborted"] += 1
            self.metrics.finished(None, "abort")
            self._loop.abort(engine_id)
        count = len(pending)
        pending.clear()
        return count

    async def abort(self, request_id: str) -> int:
        """Abort a request's unfinished completions (the ingress calls this when its client leaves, besides
        cancelling the stream: a cancelled stream alone reaches this replica only when Serve closes the
        generator). Returns how many were aborted; 0 if it already finished."""
        pending = self._pending.get(request_id)
        return self._abort_pending(pending) if pending else 0

    async def stats(self) -> dict:
        from cluster.serving.remote_backends import transport_totals

        engine_stats, audit, transport = await self._loop.acall(
            lambda engine: (engine.stats(), engine.kv.audit(), transport_totals(engine)))
        return {
            "kv": {"counts": {ns: dataclasses.asdict(c) for ns, c in audit.counts.items()},
                   "leaked_blocks": len(audit.leaked_blocks), "errors": list(audit.errors)},
            "scheduler": {**self._counters, "live": self._live, "rounds": self._loop.rounds,
                          "clients": {client: dataclasses.asdict(share) for client, share in self._shares.clients().items()},
                          "failed_rounds": self._loop.failed_rounds,
                          "uptime_s": round(time.time() - self._started_at, 3)},
            "chunks": dict(self._chunks),
            "engine": engine_stats,
            "transport": transport,  # the round channels' calls and times (remote_backends.transport_totals)
        }

    async def metrics_text(self) -> bytes:
        """The Prometheus text of this scheduler's metrics (the ingress's `GET /metrics`), gauges refreshed."""
        await self._refresh_gauges()
        return self.metrics.text()

    async def _refresh_gauges(self) -> None:
        engine_stats, audit = await self._loop.acall(lambda engine: (engine.stats(), engine.kv.audit()))
        self.metrics.set_gauges(engine_stats, {ns: dataclasses.asdict(c) for ns, c in audit.counts.items()})

    async def audit(self) -> Any:
        """The KV ledger's audit (kv_manager.schema.AuditReport): counts per namespace, leaked blocks."""
        return await self._loop.acall(lambda engine: engine.kv.audit())

    async def check_ledger(self) -> str | None:
        """The ledger against the engine's live requests (SpecEngine.check_ledger): None if they agree,
        else what the ledger holds that no running request owns."""
        def check(engine: Any) -> str | None:
            try:
                engine.check_ledger()
            except AssertionError as exc:
                return str(exc)
            return None
        return await self._loop.acall(check)

    # -- chaos runs (chaos/): fault hooks of this process, its pid, the KV manager actor it owns -------------
    async def kv_actor(self) -> Any:
        """The handle of this replica's KV manager actor."""
        return await self._loop.acall(lambda engine: engine.kv.inner.actor)

    async def health(self) -> tuple[bool, str]:
        if not self._loop.healthy:
            return False, "engine loop is not running"
        try:
            await asyncio.wait_for(self._loop.acall(lambda engine: None), timeout=self._config.health_check_timeout_s)
        except Exception as exc:
            return False, f"engine loop does not answer: {exc!r}"
        return True, "ok"

    async def check_health(self) -> None:
        """Serve's periodic health check: an engine thread that died, or a KV manager actor lost for good (dead,
        or restarted and not rebuilt: `RemoteKV.ledger_lost` rebuilds a restarted one), makes the replica unhealthy. It also refreshes the gauges (queue, running,
        KV blocks) that Ray's metrics export between scrapes."""
        if not self._loop.healthy:
            raise RuntimeError("engine loop is not running")
        try:
            await asyncio.wait_for(self._refresh_gauges(), timeout=self._config.health_check_timeout_s / 2)
        except Exception as exc:  # a slow or refused ledger call: the gauges wait for the next period
            logger.warning("gauges not refreshed: %r", exc)
        try:
            lost = await asyncio.wait_for(self._loop.acall(lambda engine: engine.kv.ledger_lost()),
                                          timeout=self._config.health_check_timeout_s / 2)
        except Exception as exc:  # a busy engine thread: asked again next period
            logger.warning("KV manager not checked: %r", exc)
            return
        if lost:
            # the KV manager actor died for good, or its ledger could not be rebuilt: every round of this engine is
            # refused from now on, so the replica restarts (a new engine, a new ledger actor)
            raise RuntimeError("the KV manager lost its ledger: restarting the scheduler replica")

    def __del__(self) -> None:
        if (loop := getattr(self, "_loop", None)) is not None:
            loop.stop(timeout_s=self._config.graceful_shutdown_timeout_s)
        if (pusher := getattr(self, "_pusher", None)) is not None:
            pusher.close()
        if (encoder := getattr(self, "_encoder", None)) is not None:
            encoder.close()
        shutdown_tracing()


SchedulerDeployment = serve.deployment(Scheduler, name="Scheduler")
