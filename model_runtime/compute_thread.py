"""One long-lived thread that runs every forward pass of a worker process.

Ray Serve runs a replica's sync methods on anyio worker threads, and a call often lands on a thread
that did not exist before. Each new calling thread makes OpenMP start a new thread team for torch's
intra-op work, so forwards ran ~5-13% slower in a replica than in the driver (measured with a
40-linear workload; Qwen 1.5B verify rounds 261 ms in the Verifier vs 231 ms in process). Workers
therefore submit all model work to one `ComputeThread`: one warm OpenMP team, and one stated owner
of the model's weights and KV pool (nothing else touches them).

The thread also reads sockets handed to it (`watch`): the round channel's connections
(specserve_types/round_channel.py), so a round's request wakes the thread that runs it. Handing a frame
from a connection thread to this one cost a second wake-up on the round's path (0.3 ms at the median on
a 2-vCPU VM, where waking a halted vCPU is a hypervisor's round trip).

    other threads                 compute thread (one loop)
    -------------                 -------------------------
    submit(fn) -- queue + wake -> select(wake pipe, watched sockets) -> on_readable() for each ready socket
                                  run one queued fn (its future's callbacks run here), select again
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import os
import selectors
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

T = TypeVar("T")
log = logging.getLogger(__name__)

_Work = tuple[concurrent.futures.Future, Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def bind_thread(name: str, cpus: Sequence[int]) -> tuple[int, ...] | None:
    """Pin the calling thread (and the threads it starts later: its OpenMP team) to `cpus`; None (and a warning)
    where the kernel refuses them."""
    try:
        os.sched_setaffinity(0, set(cpus))
    except (OSError, AttributeError) as exc:  # CPUs outside this process's cpuset; no affinity API
        log.warning("%s: cannot run on CPUs %s (%s); left on the process's", name, sorted(cpus), exc)
        return None
    log.info("%s runs on CPUs %s", name, sorted(cpus))
    return tuple(sorted(cpus))


class ComputeThread:
    """Runs callables one at a time, in submission order, on a single named thread; and reads the sockets it
    watches on that thread between them."""

    def __init__(self, name: str, torch_threads: int = 0, cpus: Sequence[int] | None = None) -> None:
        """`cpus`: the CPUs this thread (and the OpenMP team it starts) runs on, set before its first torch call
        (cluster/serving/cpu_binding.py plans them); None: the process's."""
        self.name = name
        self._queue: collections.deque[_Work] = collections.deque()  # appended by any thread, popped by ours
        self._lock = threading.Lock()
        self._closing = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()  # the compute thread's only (registrations go through it)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self.native_id: int = self.call(threading.get_native_id)
        self.cpus: tuple[int, ...] | None = self.call(bind_thread, name, cpus) if cpus else None
        if torch_threads > 0:
            self.call(torch.set_num_threads, torch_threads)

    # -- any thread ---------------------------------------------------------------------------------
    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn` on the compute thread and wait for it (from any thread except the compute thread)."""
        assert threading.get_ident() != self._thread.ident, "call() from the compute thread would deadlock"
        return self.submit(fn, *args, **kwargs).result()

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        """Queue `fn` on the compute thread; its future's done-callbacks run on the compute thread."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._closing:
                raise RuntimeError(f"{self.name} is closed")
            self._queue.append((future, fn, args, kwargs))
        if threading.get_ident() != self._thread.ident:  # our own thread looks at the queue before it sleeps
            self._wake()
        return future

    def submit_after(self, seconds: float, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """`submit(fn, *args)` `seconds` from now (an injected latency: the caller waits, this thread does not)."""
        outer: concurrent.futures.Future[T] = concurrent.futures.Future()

        def chain(inner: concurrent.futures.Future[T]) -> None:
            exc = inner.exception()
            if exc is None:
                outer.set_result(inner.result())
            else:
                outer.set_exception(exc)

        def later() -> None:
            try:
                self.submit(fn, *args).add_done_callback(chain)
            except RuntimeError as exc:  # closed meanwhile
                outer.set_exception(exc)

        timer = threading.Timer(seconds, later)
        timer.daemon = True
        timer.start()
        return outer

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn` on the compute thread without blocking the caller's event loop."""
        return await asyncio.wrap_future(self.submit(fn, *args, **kwargs))

    def watch(self, sock: socket.socket, on_readable: Callable[[], None]) -> None:
        """Call `on_readable()` on the compute thread whenever `sock` has data, until it raises (OSError: the
        peer went away) or the thread closes; then the socket is closed. `on_readable` reads in blocking mode
        and must return once it has handled what it read."""
        self.submit(self._register, sock, on_readable)

    def close(self) -> None:
        """Finish what was submitted, then stop the thread (closing the sockets it watches)."""
        with self._lock:
            self._closing = True
        self._wake()
        self._thread.join()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (a wake is pending anyway) or closed

    # -- the compute thread -------------------------------------------------------------------------
    def _register(self, sock: socket.socket, on_readable: Callable[[], None]) -> None:
        self._selector.register(sock, selectors.EVENT_READ, on_readable)

    def _drop(self, sock: socket.socket) -> None:
        self._selector.unregister(sock)
        sock.close()

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    pending = bool(self._queue)
                    if not pending and self._closing:
                        return
                for key, _ in self._selector.select(0 if pending else None):
                    if key.data is None:
                        self._drain_wakes()
                        continue
                    try:
                        key.data()
                    except Exception as exc:  # OSError: the caller went away; anything else is a bug
                        if not isinstance(exc, OSError):
                            log.exception("%s: a watched socket's reader failed", self.name)
                        self._drop(key.fileobj)  # type: ignore[arg-type]
                with self._lock:
                    work = self._queue.popleft() if self._queue else None
                if work is not None:
                    self._execute(work)
        finally:
            for key in list(self._selector.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
            self._selector.close()
            self._wake_w.close()

    def _drain_wakes(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    @staticmethod
    def _execute(work: _Work) -> None:
        future, fn, args, kwargs = work
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 (raised at the caller, as ThreadPoolExecutor does)
            future.set_exception(exc)
        else:
            future.set_result(result)
