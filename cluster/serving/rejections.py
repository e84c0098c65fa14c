"""The log of refused requests: one WARNING line per refusal, no traceback, rate-limited per kind of refusal.

A refusal is the client's doing (bad input, a full server, an unknown application) and costs the server
nothing to answer, so it must not cost much to log either: a client looping on one bad request would
otherwise flood the log. Refusals of the same kind (code and field) log at most one line per `window_s`;
the next line that passes says how many were suppressed since.

Owner: the ingress replica's event loop (no lock).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

MAX_REASON_CHARS = 200  # a client chooses the reason's contents (it quotes values): bounded in the log


class RejectionLog:
    def __init__(self, logger: logging.Logger, window_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._window_s = window_s
        self._clock = clock
        self._last: dict[tuple[str, str], float] = {}  # (code, field) -> when its last line was written
        self._suppressed: dict[tuple[str, str], int] = {}
        self.total = 0  # refusals seen, logged or not

    def rejected(self, request_id: str, code: str, field: str | None, reason: str) -> bool:
        """Record one refusal; returns whether a line was written."""
        self.total += 1
        key = (code, field or "-")
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self._window_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        self._last[key] = now
        suppressed = self._suppressed.pop(key, 0)
        note = f" (+{suppressed} like it suppressed in the last {self._window_s:g}s)" if suppressed else ""
        # the client chose the id and the reason's quoted values: escaped (one line) and bounded
        self._logger.warning("request %s refused: %s field=%s reason=%s%s", ascii(request_id[:MAX_REASON_CHARS]),
                             code, ascii(key[1][:MAX_REASON_CHARS]), ascii(reason[:MAX_REASON_CHARS]), note)
        return True
