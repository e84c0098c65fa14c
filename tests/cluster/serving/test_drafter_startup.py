"""The scheduler's warm-up waits for the drafter's replica (cluster/serving/remote_backends.py wait_for_drafter): a
handle that answers lets it go on at once; one that does not answer in time, or fails, is reported and the warm-up
runs without it, as before (the engine's fallback to plain decoding handles a drafter that is down)."""

from __future__ import annotations

import logging
from typing import Any

from cluster.serving.remote_backends import wait_for_drafter


class FakeHandle:
    """A Serve handle's `vocab_size.remote().result(timeout_s)`: the vocabulary size, or `error` raised, at once
    (`result` raises it; `remote` raises it where `fails_to_send`)."""

    def __init__(self, error: Exception | None = None, fails_to_send: bool = False) -> None:
        self.error, self.fails_to_send = error, fails_to_send
        self.waited: list[float | None] = []
        self.vocab_size = self

    def remote(self) -> FakeHandle:
        if self.fails_to_send and self.error is not None:
            raise self.error
        return self

    def result(self, timeout_s: float | None = None) -> int:
        self.waited.append(timeout_s)
        if self.error is not None:
            raise self.error
        return 49152


def test_a_live_drafter_is_waited_for_with_the_given_timeout() -> None:
    handle = FakeHandle()
    assert wait_for_drafter(handle, 300.0) is True
    assert handle.waited == [300.0]


def test_a_drafter_that_never_comes_up_is_reported_and_the_warm_up_goes_on(caplog: Any) -> None:
    handle = FakeHandle(TimeoutError("no replica within 2.0s"))
    with caplog.at_level(logging.WARNING, logger="specserve.cluster"):
        assert wait_for_drafter(handle, 2.0) is False
    assert handle.waited == [2.0]
    assert "no drafter replica within 2 s" in caplog.text


def test_a_drafter_whose_call_fails_is_reported_and_the_warm_up_goes_on(caplog: Any) -> None:
    handle = FakeHandle(RuntimeError("replica crashed in its constructor"), fails_to_send=True)
    with caplog.at_level(logging.WARNING, logger="specserve.cluster"):
        assert wait_for_drafter(handle, 1.0) is False
    assert "replica crashed in its constructor" in caplog.text
