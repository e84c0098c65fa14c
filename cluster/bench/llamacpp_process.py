"""llama.cpp in a child process of its own, so its OpenMP settings never touch our engine's.

llama.cpp's OpenMP threads spin between tokens with the default wait policy, and on this project's shared
2-core VM that made its 2-thread decoding ~100x slower (SmolLM2-135M: 64 s for 32 tokens; 0.54 s with
OMP_WAIT_POLICY=PASSIVE). torch and llama_cpp share one libgomp.so.1, which reads the policy once, when it
loads; PASSIVE in our own process slowed our bf16 Qwen-1.5B decode step by ~40% (184 -> 255 ms). So the
child starts with PASSIVE and the parent keeps its own. The child owns the `LlamaCppPeer` (models, runs);
the bench talks to it over a pipe, one call at a time.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing.connection import Connection
from typing import Any

from cluster.bench.llamacpp import LlamaCppPeer, LlamaCppRun, LlamaCppSettings

WAIT_POLICY = "PASSIVE"


def _serve(conn: Connection, settings: LlamaCppSettings) -> None:
    try:
        peer = LlamaCppPeer(settings)
    except Exception as exc:  # reported to the parent, which raises it
        conn.send((False, f"{type(exc).__name__}: {exc}"))
        return
    conn.send((True, None))
    while (message := conn.recv()) is not None:
        name, args = message
        try:
            conn.send((True, getattr(peer, name)(*args)))
        except Exception as exc:
            conn.send((False, f"{type(exc).__name__}: {exc}"))


class LlamaCppProcess:
    """The LlamaCppPeer interface (modes, run, report), served by a child process started with
    OMP_WAIT_POLICY=PASSIVE. Owner: the bench thread that created it; `close` ends the child."""

    def __init__(self, settings: LlamaCppSettings) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        before = os.environ.get("OMP_WAIT_POLICY")
        os.environ["OMP_WAIT_POLICY"] = WAIT_POLICY  # inherited by the child only: ours read it at start
        try:
            self._proc = ctx.Process(target=_serve, args=(child, settings), name="llamacpp-peer", daemon=True)
            self._proc.start()
        finally:
            if before is None:
                del os.environ["OMP_WAIT_POLICY"]
            else:
                os.environ["OMP_WAIT_POLICY"] = before
        child.close()
        self._answer()  # the models loaded, or the child's error

    def _answer(self) -> Any:
        ok, value = self._conn.recv()
        if not ok:
            raise RuntimeError(f"llama.cpp process: {value}")
        return value

    def _call(self, name: str, *args: Any) -> Any:
        self._conn.send((name, args))
        return self._answer()

    def modes(self) -> list[str]:
        return self._call("modes")

    def run(self, mode: str, prompt_id: str, category: str, prompt_ids: list[int], max_tokens: int,
            warmup: bool = False) -> LlamaCppRun:
        return self._call("run", mode, prompt_id, category, prompt_ids, max_tokens, warmup)

    def report(self, our_plain: dict[str, list[int]] | None = None) -> dict[str, Any]:
        result = self._call("report", our_plain)
        result["settings"]["omp_wait_policy"] = f"{WAIT_POLICY} (llama.cpp's own process)"
        result["version"] = f"llama-cpp-python {result['version']} (not how llama.cpp's users run it)"
        return result

    def close(self) -> None:
        if self._proc.is_alive():
            self._conn.send(None)
            self._proc.join(timeout=30)
            if self._proc.is_alive():
                self._proc.kill()
