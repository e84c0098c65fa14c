"""What the kernels' builds share: this CPU's flags (the one reader of /proc/cpuinfo's flags) and one build folder
per extension (model_runtime/kernel_registry.py; drafter_service/suffix_native.py)."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)


FLAGS_OFF = "SPECSERVE_CPU_FLAGS_OFF"  # /proc/cpuinfo flags the kernels' choice treats as absent (a smaller CPU)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's flags (/proc/cpuinfo), less those SPECSERVE_CPU_FLAGS_OFF names (comma-separated): a smaller CPU
    stood in for, as `SPECSERVE_CPU_KERNEL` caps a path (e.g. `avx_vnni` off with `SPECSERVE_CPU_KERNEL=avx2`: the
    avx2 build of the quantized kernels, as on a CPU without VNNI, where the avx2vnni build would run). Read once."""
    off = frozenset(flag.strip() for flag in os.environ.get(FLAGS_OFF, "").split(",") if flag.strip())
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split()) - off
    except OSError:
        pass
    return frozenset()


def build_dir(isa: str | None = None) -> Path:
    """One folder per build (torch's loader keeps one build.ninja and object per source in it): `isa`'s (a folder
    name: model_runtime/kernel_registry.py's builds), or with None the folder of this torch and Python."""
    configured = os.environ.get("SPECSERVE_CACHE")
    root = Path(configured).expanduser() if configured else Path.home() / ".cache" / "specserve"
    path = root / "kernels" / f"torch-{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}"
    if isa is not None:
        path = path / isa
    path.mkdir(parents=True, exist_ok=True)
    return path


STALE_LOCK_S = 600.0  # a build takes about a minute; a lock this old was left by a process killed mid-build


def clear_stale_lock(folder: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove torch's build lock (`folder/lock`) when it is older than `max_age_s`: a process killed while it built
    leaves the lock behind, and torch's loader then waits for it forever in every later process. True if removed."""
    lock = folder / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < max_age_s:
        return False
    log.warning("removing a build lock left %.0f s ago by a build that never finished: %s", age, lock)
    lock.unlink(missing_ok=True)
    return True


def load_extension(name: str, sources: list[Path], cflags: list[str], folder: Path) -> ModuleType:
    """torch's C++ extension loader (ninja on PATH) building `sources` into `folder`, after clearing a build lock
    a killed build left there; raises what the build raises."""
    import ninja  # type: ignore[import-untyped]
    from torch.utils.cpp_extension import load

    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    clear_stale_lock(folder)
    return load(name=name, sources=[str(s) for s in sources], extra_cflags=cflags, build_directory=str(folder),
                verbose=False)


def build_extension(what: str, name: str, sources: list[Path], cflags: list[str], folder: str,
                    isa: str, headers: tuple[Path, ...] = ()) -> tuple[ModuleType | None, str]:
    """Build (or load the cached build of) C++ `sources` as torch extension `name`: (module, isa), or (None, why).
    The hash of the sources and of the `headers` they include is in the flags, so an edit of either rebuilds."""
    try:
        start = time.perf_counter()
        log.info("loading the %s kernels (the first build on a machine takes about a minute)", what)
        digest = hashlib.sha256(b"".join(p.read_bytes() for p in (*sources, *headers))).hexdigest()[:16]
        module = load_extension(name, sources, [*cflags, f"-DSPECSERVE_SOURCE={digest}"], build_dir(folder))
    except Exception as exc:  # a missing compiler or a failed build: say so
        return None, f"off: the {what} kernels did not build ({type(exc).__name__}: {str(exc).strip()[:200]})"
    assert module.isa() == isa, (module.isa(), isa)
    log.info("%s kernels ready in %.1f s", what, time.perf_counter() - start)
    return module, isa
