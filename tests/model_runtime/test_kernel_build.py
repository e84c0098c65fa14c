"""A build killed mid-way does not hang every later process (the build lock); the CPU flags a run treats as absent
(model_runtime/kernel_build.py)."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from model_runtime.kernel_build import FLAGS_OFF, build_lock, cpu_flags


def test_a_torch_lock_found_under_the_build_lock_is_a_dead_builds_and_goes(tmp_path: Path) -> None:
    (tmp_path / "lock").touch()  # torch's lock, as a build killed mid-way leaves it
    with build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_a_killed_builder_releases_the_build_lock(tmp_path: Path) -> None:
    """A process holding the lock (a build) is SIGKILLed: the next one takes the lock at once, where torch's own lock
    file would have kept it waiting for ever."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from model_runtime.kernel_build import build_lock\n"
        "with build_lock(Path(sys.argv[1])):\n"
        "    (Path(sys.argv[1]) / 'lock').touch(); print('held', flush=True); time.sleep(600)"), str(tmp_path)],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        waiter = threading.Thread(target=lambda: build_lock(tmp_path).__enter__())
        waiter.start()
        waiter.join(1.0)
        assert waiter.is_alive()  # a live builder holds it
        holder.kill()
        holder.wait(30)
        waiter.join(30)
        assert not waiter.is_alive() and not (tmp_path / "lock").exists()
    finally:
        holder.kill()


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
