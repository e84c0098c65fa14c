"""A build lock left by a killed build does not hang every later process (model_runtime/kernel_build.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from model_runtime.kernel_build import STALE_LOCK_S, clear_stale_lock


def test_a_lock_older_than_a_build_is_removed(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    assert clear_stale_lock(tmp_path)
    assert not lock.exists()


def test_a_fresh_lock_is_a_build_in_progress_and_stays(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    lock.touch()
    assert not clear_stale_lock(tmp_path)
    assert lock.exists()


def test_no_lock_nothing_to_do(tmp_path: Path) -> None:
    assert not clear_stale_lock(tmp_path)
