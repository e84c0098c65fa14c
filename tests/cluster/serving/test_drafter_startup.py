"""The scheduler's warm-up waits for the drafter's replica (cluster/serving/remote_backends.py wait_for_drafter): a
handle that answers lets it go on at once; one that does not answer in time, or fails, is reported and the warm-up
runs without it, as before (the engine's fallback to plain decoding handles a drafter that is down)."""

from __future__ import annotations

import logging
from typing import Any

from cluster.serving.remote_backends import wait_for_drafter


class FakeResponse:
    def __init__(self, handle: FakeHandle) -> None:
        self.handle = handle

    def result(self, timeout_s: float | None = None) -> int:
        self.handle.waited.append(timeout_s)
        if self.handle.up:
            return 49152
        raise TimeoutError(f"no replica within {timeout_s}s")


class FakeMethod:
    def __init__(self, handle: FakeHandle) -> None:
        self.handle = handle

    def remote(self) -> FakeResponse:
        return FakeResponse(self.handle)


class FakeHandle:
    """A Serve handle's `vocab_size.remote().result(timeout_s)`: blocks until a replica answers, here at once."""

    def __init__(self, up: bool) -> None:
        self.up = up
        self.waited: list[float | None] = []
        self.vocab_size = FakeMethod(self)


def test_a_live_drafter_is_waited_for_with_the_given_timeout() -> None:
    handle = FakeHandle(up=True)
    assert wait_for_drafter(handle, 300.0) is True
    assert handle.waited == [300.0]


def test_a_drafter_that_never_comes_up_is_reported_and_the_warm_up_goes_on(caplog: Any) -> None:
    handle = FakeHandle(up=False)
    with caplog.at_level(logging.WARNING, logger="specserve.cluster"):
        assert wait_for_drafter(handle, 2.0) is False
    assert handle.waited == [2.0]
    assert "no drafter replica within 2 s" in caplog.text


def test_a_drafter_whose_call_fails_is_reported_and_the_warm_up_goes_on(caplog: Any) -> None:
    class Broken(FakeHandle):
        def __init__(self) -> None:
            super().__init__(up=True)
            self.vocab_size = self  # type: ignore[assignment]

        def remote(self) -> Any:
            raise RuntimeError("replica crashed in its constructor")

    with caplog.at_level(logging.WARNING, logger="specserve.cluster"):
        assert wait_for_drafter(Broken(), 1.0) is False
    assert "replica crashed in its constructor" in caplog.text
