"""One thread owns the engine; asyncio code talks to it only through commands and chunk sinks.

    event loop (requests)                      engine thread
    ---------------------                      -------------
    call(submit) ---- command queue ------->   run commands between rounds (submit, abort, stats)
    await future <--- future --------------'   step() -> chunks
    asyncio.Queue <-- call_soon_threadsafe --  deliver each chunk to its request's sink

The engine is never touched from two threads. A round that raises fails every live request with
finish_reason="error" and aborts it in the engine (rolling back its reservations); the loop goes on.

Held chunks (`hold_chunks_until`): a round's chunks are handed to the event loop once the next round's first
worker request is on its way (the drafter's propose, or the verify where the round drafts nothing: the adapters'
`on_sent`), not at the round's end: the event loop's streaming work then overlaps a worker's compute instead of
this thread's planning and ledger call (the two threads share one GIL). Only a send from this thread releases
them (with overlap, the propose runs on the draft thread and the verify releases). A round without a worker call
releases them at its end; an idle loop before it waits. (Released at the verify alone, a Qwen pair's spec chunks
waited for the propose before each verify: its first token reached the client 60-80 ms after the engine made it.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

from specserve_types.api import GenerationRequest, TokenChunk

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.5


class Engine(Protocol):
    tokenizer: Any
    observer: Any  # an EngineObserver or None (cluster/engine/step_record.py)

    def submit(self, request: GenerationRequest) -> None: ...
    def submit_group(self, requests: list[GenerationRequest]) -> None: ...
    def step(self) -> list[TokenChunk]: ...
    def abort(self, request_id: str) -> None: ...
    def has_unfinished(self) -> bool: ...
    def stats(self) -> dict: ...


ChunkSink = Callable[[TokenChunk], None]
Command = tuple[Callable[[Engine], Any], concurrent.futures.Future]


class EngineLoop:
    def __init__(self, build_engine: Callable[[], Engine], name: str = "specserve-engine") -> None:
        self._build_engine = build_engine
        self._commands: queue.Queue[Command | None] = queue.Queue()
        self._sinks: dict[str, ChunkSink] = {}  # engine request id -> sink; engine thread only
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._engine: Engine | None = None
        self.startup_error: BaseException | None = None
        self.rounds = 0
        self.failed_rounds = 0
        self._hold = False  # set once, on the engine thread, before the first round
        self._held: list[TokenChunk] = []  # the last round's chunks, not yet delivered; engine thread only
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # -- any thread ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        return self._ready.wait(timeout_s)

    @property
    def engine(self) -> Engine:
        """The engine, for read-only attributes (tokenizer); call its methods through `call`."""
        assert self._engine is not None, "engine not built yet"
        return self._engine

    @property
    def healthy(self) -> bool:
        return self._ready.is_set() and self.startup_error is None and self._thread.is_alive()

    def call(self, fn: Callable[[Engine], Any]) -> concurrent.futures.Future:
        """Run `fn(engine)` in the engine thread between rounds."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._stopping.is_set() or not self._thread.is_alive():
            future.set_exception(RuntimeError("engine loop is not running"))
        else:
            self._commands.put((fn, future))
        return future

    async def acall(self, fn: Callable[[Engine], Any]) -> Any:
        return await asyncio.wrap_future(self.call(fn))

    def submit(self, request: GenerationRequest, sink: ChunkSink) -> concurrent.futures.Future:
        """Submit and route the request's chunks to `sink` (engine thread); errors land on the future."""

        def submit(engine: Engine) -> None:
            engine.submit(request)  # raises before the sink is registered: nothing to clean up
            self._sinks[request.request_id] = sink

        return self.call(submit)

    def submit_group(self, requests: list[GenerationRequest], sinks: dict[str, ChunkSink]
                     ) -> concurrent.futures.Future:
        """The n completions of one prompt, all or none (they share the prompt's KV in the engine); each
        request's chunks go to `sinks[request_id]`."""

        def submit_group(engine: Engine) -> None:
            engine.submit_group(requests)  # raises before any sink is registered: nothing to clean up
            self._sinks.update(sinks)

        return self.call(submit_group)

    def abort(self, request_id: str) -> concurrent.futures.Future:
        """Abort a request; its sink is dropped at once (the abort chunk goes nowhere)."""

        def abort(engine: Engine) -> None:
            if self._sinks.pop(request_id, None) is not None:
                engine.abort(request_id)

        return self.call(abort)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        self._commands.put(None)
        self._thread.join(timeout_s)

    # -- engine thread ------------------------------------------------------------------------------
    def hold_chunks_until(self, *workers: Any) -> None:
        """While building the engine (on the engine thread): hold each round's chunks until the next request to
        any of `workers` (the verifier and drafter adapters) with an `on_sent` hook is sent (module docstring)."""
        for worker in workers:
            if worker is not None and hasattr(worker, "on_sent"):
                worker.on_sent = self._sent
                self._hold = True

    def _sent(self) -> None:
        """A worker request is on its way: on the engine thread, the held chunks go out; from another thread
        (the draft thread's propose, with overlap) nothing happens: the held chunks are this thread's."""
        if threading.current_thread() is self._thread:
            self.release_held()

    def release_held(self) -> None:
        """Deliver the held chunks (engine thread)."""
        held, self._held = self._held, []
        for chunk in held:
            self._deliver(chunk)

    def _run(self) -> None:
        try:
            self._engine = self._build_engine()
        except BaseException as exc:  # reported through `healthy` / `startup_error`
            logger.exception("engine construction failed")
            self.startup_error = exc
            self._ready.set()
            return
        self._ready.set()
        engine = self._engine
        while not self._stopping.is_set():
            if self._held and not engine.has_unfinished():
                self.release_held()  # before waiting for work
            self._run_commands(engine, block=not engine.has_unfinished())
            if self._stopping.is_set() or not engine.has_unfinished():
                continue
            try:
                chunks = engine.step()
            except Exception as exc:
                self.failed_rounds += 1
                logger.exception("engine round failed; failing %d live request(s)", len(self._sinks))
                self.release_held()
                self._fail_all(engine, exc)
                continue
            self.rounds += 1
            self.release_held()  # a round without a verify call
            if self._hold:
                self._held = list(chunks)
            else:
                for chunk in chunks:
                    self._deliver(chunk)
        self.release_held()
        self._fail_all(engine, RuntimeError("engine loop stopped"))
        close = getattr(engine, "close", None)
        if close is not None:
            close()  # the engine's own threads (overlapped drafting)
        while True:  # commands that arrived after the stop
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[1].set_running_or_notify_cancel():
                item[1].set_exception(RuntimeError("engine loop stopped"))

    def _run_commands(self, engine: Engine, block: bool) -> None:
        try:
            item = self._commands.get(timeout=IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(engine))
                except BaseException as exc:
                    future.set_exception(exc)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, chunk: TokenChunk) -> None:
        sink = self._sinks.pop(chunk.request_id, None) if chunk.finished else self._sinks.get(chunk.request_id)
        if sink is None:
            return
        try:
            sink(chunk)
        except Exception:  # the consumer is gone (e.g. its event loop closed): stop the request
            logger.exception("chunk sink of %s failed; aborting it", chunk.request_id)
            if self._sinks.pop(chunk.request_id, None) is not None:
                self._engine.abort(chunk.request_id)

    def _fail_all(self, engine: Engine, exc: BaseException) -> None:
        sinks, self._sinks = self._sinks, {}
        for request_id, sink in sinks.items():
            try:
                engine.abort(request_id)
            except Exception:
                logger.exception("abort of %s after a failed round failed", request_id)
            try:
                sink(TokenChunk(request_id, [], finish_reason="error",
                                stats={"error": f"{type(exc).__name__}: {exc}"}))
            except Exception:
                logger.exception("chunk sink of %s failed", request_id)
