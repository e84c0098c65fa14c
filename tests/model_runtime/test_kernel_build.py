"""A build lock left by a killed build does not hang every later process; the CPU flags a run treats as absent
(model_runtime/kernel_build.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from model_runtime.kernel_build import FLAGS_OFF, STALE_LOCK_S, clear_stale_lock, cpu_flags


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


def test_flags_named_off_are_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    """SPECSERVE_CPU_FLAGS_OFF stands in for a smaller CPU: the kernels' choice no longer sees those flags."""
    cpu_flags.cache_clear()
    monkeypatch.delenv(FLAGS_OFF, raising=False)
    every = cpu_flags()
    if not every:
        pytest.skip("no /proc/cpuinfo flags here")
    some = sorted(every)[:2]
    cpu_flags.cache_clear()
    monkeypatch.setenv(FLAGS_OFF, f" {some[0]},{some[-1]} ,")
    try:
        assert cpu_flags() == every - set(some)
    finally:
        cpu_flags.cache_clear()  # the next caller reads this process's own environment again


def test_every_reader_of_the_cpu_flags_honours_the_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """AMX and bf16 detection read the same flags as the kernels' choice: with them named off, neither is seen."""
    from model_runtime import kernel_registry, precision

    cpu_flags.cache_clear()
    monkeypatch.delenv(FLAGS_OFF, raising=False)
    try:
        every = cpu_flags()
        assert kernel_registry.cpu_has("amx") == ({"amx_bf16", "amx_int8", "amx_tile", "avx512_bf16"} <= every)
        assert precision.cpu_has_bf16() == bool({"avx512_bf16", "amx_bf16"} & every)
        cpu_flags.cache_clear()
        monkeypatch.setenv(FLAGS_OFF, "amx_tile,avx512_bf16,amx_bf16")
        assert not kernel_registry.cpu_has("amx") and not precision.cpu_has_bf16() and not precision.cpu_packs_bf16()
    finally:
        cpu_flags.cache_clear()


def test_with_avx_vnni_off_the_avx2_build_is_the_quantized_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the full suite runs under SPECSERVE_CPU_FLAGS_OFF=avx_vnni SPECSERVE_CPU_KERNEL=avx2 (docs/exactness.md)."""
    from model_runtime import kernel_registry as registry

    cpu_flags.cache_clear()
    monkeypatch.delenv(FLAGS_OFF, raising=False)
    if not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("this CPU has no AVX2")
    cpu_flags.cache_clear()
    monkeypatch.setenv(FLAGS_OFF, "avx_vnni")
    monkeypatch.setenv("SPECSERVE_CPU_KERNEL", "avx2")
    try:
        assert not registry.cpu_has("avx2vnni") and registry.cpu_has("avx2")
        q4 = [p.name for p in registry.chain(registry.requested()) if registry.Q4_LINEAR in p.ops
              and registry.cpu_has(p.name) and p.ops[registry.Q4_LINEAR].needs <= cpu_flags()]
        assert q4 == ["avx2"]
    finally:
        cpu_flags.cache_clear()
