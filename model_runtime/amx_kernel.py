"""The AMX linear kernels (model_runtime/kernels/amx_linear.cpp) and the row-wise bf16 ops beside them
(kernels/row_ops.cpp: RMSNorm, SiLU-and-multiply, paged attention), and the decoder layers' loop over them
(kernels/layers.cpp: `LayerStack`, model_runtime/model.py): built once per machine, loaded once per process, or
absent with a stated reason. `amx_linear`: bfloat16, batch-invariant (the target); `amx_linear_i8`:
int8 weights x per-row int8 activations at twice bf16's speed (the draft, `--draft-dtype int8`: a draft's
precision changes only how often its tokens are accepted, never the output).

Why our own kernel: on this project's 2-core Sapphire Rapids CPU, oneDNN's bf16 F.linear streams Qwen-1.5B's
[8960, 1536] weight at ~15-19 GB/s and gives one row different bits than 2..32 rows, while this kernel streams
it at ~27-29 GB/s (fp32 MKL's rate) for 1..16 rows alike and gives a row the same bits for any row count
(`python -m model_runtime.amx_kernel` builds it and prints its status; the design in docs/precision.md, figures
in docs/forward.md).

The build uses torch's C++ extension loader (a C++ compiler and ninja; the ninja wheel is a dependency) into
`$SPECSERVE_CACHE/kernels` (default ~/.cache/specserve/kernels); torch's lock lets concurrent processes wait for
one build (a lock older than ten minutes, left by a build that was killed, is removed:
kernel_build.load_extension). `SPECSERVE_CPU_KERNEL` naming another path (avx512, avx2, torch) turns it off:
model_runtime/cpu_kernels.py chooses which kernels a forward runs. Without AMX (`amx_bf16`, `amx_int8`, `amx_tile`
in /proc/cpuinfo), a compiler, or the kernel's permission from Linux, `kernel()` returns None and `status()` says
why.

Owner of `_STATE`: this module; set once per process by the first `kernel()` call, then only read.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

KERNELS = Path(__file__).parent / "kernels"
SOURCES = [KERNELS / "amx_linear.cpp", KERNELS / "row_ops.cpp", KERNELS / "layers.cpp"]
# torch's loader rebuilds when a source or a flag changes: the headers' hash is a flag
HEADERS = [KERNELS / "ops.h", KERNELS / "simd.h", KERNELS / "amx_tiles.h", KERNELS / "layer_loop.h",
           KERNELS / "portable_ops.h", KERNELS / "head_blocks.h"]
CFLAGS = ["-O3", "-mamx-tile", "-mamx-bf16", "-mamx-int8", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16",
          "-fopenmp"]
_STATE: dict[str, object] = {}


def cpu_has_amx() -> bool:
    """AMX (tile, bf16, int8) and avx512_bf16 in this CPU's flags as the kernels' choice reads them
    (kernel_build.cpu_flags: SPECSERVE_CPU_FLAGS_OFF=amx_tile stands in for a CPU without AMX)."""
    from model_runtime.kernel_build import cpu_flags

    return {"amx_bf16", "amx_int8", "amx_tile", "avx512_bf16"} <= cpu_flags()


def turned_off() -> bool:
    """SPECSERVE_CPU_KERNEL names another path than the AMX one (model_runtime/cpu_kernels.py)."""
    from model_runtime.kernel_choice import requested

    return requested() not in ("auto", "amx")


def _load() -> tuple[ModuleType | None, str]:
    if turned_off():
        return None, f"off: SPECSERVE_CPU_KERNEL={os.environ.get('SPECSERVE_CPU_KERNEL')}"
    if not cpu_has_amx():
        return None, "off: this CPU has no AMX (amx_bf16, amx_int8, amx_tile)"
    try:
        from model_runtime.kernel_build import build_dir, load_extension

        start = time.perf_counter()
        log.info("loading the AMX kernels (the first build on a machine takes about a minute)")
        header = hashlib.sha256(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:16]
        module = load_extension("specserve_amx", SOURCES, [*CFLAGS, f"-DSPECSERVE_HEADERS={header}"], build_dir())
    except Exception as exc:  # a missing compiler or a failed build: fall back, and say so
        return None, f"off: the kernel did not build ({type(exc).__name__}: {str(exc).strip()[:200]})"
    if not module.amx_enable():
        return None, "off: Linux refused this process the AMX tile state (arch_prctl)"
    log.info("AMX kernels ready in %.1f s", time.perf_counter() - start)
    return module, "amx"


def kernel() -> ModuleType | None:
    """The loaded extension (amx_linear, amx_linear_i8, amx_enable), or None where it cannot run here."""
    if "module" not in _STATE:
        _STATE["module"], _STATE["status"] = _load()
    return _STATE["module"]  # type: ignore[return-value]


def status() -> str:
    """"amx" when the kernel runs here, else "off: <why>"."""
    kernel()
    return str(_STATE["status"])


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"AMX kernels: {status()}")
