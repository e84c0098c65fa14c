"""ComputeThread: every call runs on one thread, in order; errors reach the caller; watched sockets are read there."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from model_runtime.compute_thread import ComputeThread


def test_calls_from_many_threads_run_on_one_thread_in_order() -> None:
    compute = ComputeThread("test-compute", torch_threads=1)
    seen: list[tuple[int, int]] = []
    try:
        with ThreadPoolExecutor(4) as callers:
            ids = list(callers.map(lambda i: compute.call(lambda: seen.append((i, threading.get_native_id())) or
                                                          threading.get_native_id()), range(20)))
        assert set(ids) == {compute.native_id} != {threading.get_native_id()}
        assert len(seen) == 20 and {tid for _, tid in seen} == {compute.native_id}
        assert compute.call(torch.get_num_threads) == 1
    finally:
        compute.close()


def test_async_run_does_not_block_the_loop_and_raises_errors() -> None:
    compute = ComputeThread("test-compute")

    async def main() -> tuple[int, int]:
        ticks = 0
        started = threading.Event()

        def slow() -> int:
            started.set()
            threading.Event().wait(0.2)
            return threading.get_native_id()

        task = asyncio.ensure_future(compute.run(slow))
        while not task.done():
            ticks += 1
            await asyncio.sleep(0.01)
        assert started.is_set()
        return await task, ticks

    try:
        native_id, ticks = asyncio.run(main())
        assert native_id == compute.native_id and ticks >= 5  # the loop kept running meanwhile
        with pytest.raises(ZeroDivisionError):
            asyncio.run(compute.run(lambda: 1 / 0))
        assert compute.call(lambda: 7) == 7  # an error does not kill the thread
    finally:
        compute.close()


def test_a_watched_socket_is_read_on_the_compute_thread_between_calls_until_its_reader_raises() -> None:
    compute = ComputeThread("test-compute")
    ours, theirs = socket.socketpair()
    read: list[tuple[bytes, int]] = []

    def on_readable() -> None:
        data = ours.recv(16)
        if not data:
            raise ConnectionError("closed by the peer")
        read.append((data, threading.get_native_id()))

    try:
        compute.watch(ours, on_readable)
        theirs.sendall(b"a")
        assert compute.call(lambda: 1) == 1
        deadline = time.monotonic() + 5
        while not read and time.monotonic() < deadline:
            time.sleep(0.005)
        assert read == [(b"a", compute.native_id)]
        theirs.close()  # the reader raises: the socket is dropped and closed, the thread goes on
        while ours.fileno() != -1 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert ours.fileno() == -1 and compute.call(lambda: 2) == 2
    finally:
        compute.close()


def test_submit_after_delays_the_work_not_the_thread_and_close_refuses_new_work() -> None:
    compute = ComputeThread("test-compute")
    start = time.monotonic()
    later = compute.submit_after(0.2, threading.get_native_id)
    assert compute.call(lambda: 3) == 3 and time.monotonic() - start < 0.2  # the thread was free meanwhile
    assert later.result(5) == compute.native_id and time.monotonic() - start >= 0.2
    with pytest.raises(ZeroDivisionError):
        compute.submit_after(0.01, lambda: 1 / 0).result(5)
    ours, theirs = socket.socketpair()
    compute.watch(ours, lambda: None)
    compute.close()
    assert ours.fileno() == -1  # the sockets it watched closed with it
    theirs.close()
    with pytest.raises(RuntimeError, match="closed"):
        compute.submit(lambda: 1)
