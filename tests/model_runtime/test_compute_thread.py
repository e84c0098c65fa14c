"""ComputeThread: every call runs on one thread, in order; errors reach the caller."""

from __future__ import annotations

import asyncio
import threading
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
