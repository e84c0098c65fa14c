"""What the kernels' builds share: this CPU's flags (the one reader of /proc/cpuinfo's flags) and one build folder
per extension (model_runtime/kernel_registry.py; drafter_service/suffix_native.py)."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import sys
import time
from collections.abc import Iterator
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


BUILD_LOCK = "build.flock"  # beside torch's own `lock` in a build folder


@contextlib.contextmanager
def build_lock(folder: Path) -> Iterator[None]:
    """Hold an exclusive flock on `folder/build.flock` for one build or load of an extension there. The kernel drops
    it when its holder exits or is killed, so a killed build never hangs the next process; torch's own lock file
    (`folder/lock`, which torch's loader waits on for as long as it exists) is left behind by a killed build, and
    whoever holds the flock is the folder's only builder, so a torch lock found then is a dead build's: removed."""
    with open(folder / BUILD_LOCK, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = folder / "lock"
            if stale.exists():
                log.warning("removing a build lock a killed build left: %s", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_extension(name: str, sources: list[Path], cflags: list[str], folder: Path) -> ModuleType:
    """torch's C++ extension loader (ninja on PATH) building `sources` into `folder`, under the folder's build lock
    (`build_lock`: one builder at a time, none waiting on a killed one); raises what the build raises."""
    import ninja  # type: ignore[import-untyped]
    from torch.utils.cpp_extension import load

    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    with build_lock(folder):
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
