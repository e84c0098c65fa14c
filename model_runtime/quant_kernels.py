"""The quantized linears' kernels (kernels/quant_linear.cpp), built once per machine for its ISA:

    amx     the avx512 build plus -mamx-tile -mamx-int8: the K formats' (Q4_K, Q6_K) integer sums of
            a call of 8 rows or more on AMX tiles (a verify's rows a tile product per block, a prompt's on
            planes with the blocks' scales in the codes), each weight decoded once per 16 rows; fewer rows take the
            avx512 kernel in the same build (Intel Sapphire Rapids and later)
    avx512  -mavx512f/bw/vl -mavx512vnni: integer dot products on VNNI (AMD Zen 4/5, Intel Ice Lake and later)
    avx2vnni  -mavx2 -mfma -mf16c -mavxvnni: the same dot products on 256-bit vectors (AVX2 CPUs with AVX-VNNI:
            Intel Alder Lake and later clients)
    avx2    -mavx2 -mfma -mf16c: the same sums through vpmaddubsw's 16-bit pair sums, added in 16-bit lanes through
            a block where they cannot overflow (codes of 6 bits or fewer; Q8_0's on their signed values), widened
            once (every other x86-64 CPU of the last decade)

All give the same bits (the integer sums are exact and the float steps the same instructions lane for lane), so a
capped path stands in for a smaller CPU in the tests. `SPECSERVE_CPU_KERNEL` caps the ISA as for the other kernels
(avx2 -> the avx2 builds, avx2vnni where the CPU has it; torch -> none: the quantized dtype is then refused).

Owner of `_MODULES`: this module; each ISA's build is loaded once per process, then only read.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import ModuleType

from model_runtime.kernel_build import build_extension, cpu_flags
from model_runtime.kernel_choice import requested

log = logging.getLogger(__name__)
KERNELS = Path(__file__).parent / "kernels"
SOURCES = [KERNELS / "quant_linear.cpp", KERNELS / "q4_layers.cpp"]  # the linears; a q4 model's layer loop
HEADERS = (KERNELS / "quant_ops.h", KERNELS / "quant_simd.h", KERNELS / "quant_common.h", KERNELS / "quant_amx.h",
           KERNELS / "amx_tiles.h", KERNELS / "portable_ops.h", KERNELS / "layer_loop.h")
ISAS = {  # compiler flags and the /proc/cpuinfo flags they need, fastest first
    "amx": (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-mamx-tile", "-mamx-int8"],
            ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma", "amx_tile", "amx_int8")),
    "avx512": (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma"],
               ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma")),
    "avx2vnni": (["-mavx2", "-mfma", "-mf16c", "-mavxvnni"], ("avx2", "fma", "f16c", "avx_vnni")),
    "avx2": (["-mavx2", "-mfma", "-mf16c"], ("avx2", "fma", "f16c")),
}
_MODULES: dict[str, tuple[ModuleType | None, str]] = {}
# Q4_K, Q6_K: the fewest rows the amx build's tiles take (block tiles), and where its planes take over (prompts, wide
# batches); measured on Sapphire Rapids (docs/forward.md, "q4 verify rows on AMX block tiles", "The planes made
# cheaper")
AMX_MIN_ROWS = (8, 8)
AMX_PLANE_ROWS = (33, 28)


def cpu_has(isa: str) -> bool:
    return all(flag in cpu_flags() for flag in ISAS[isa][1])


def _load(isa: str) -> tuple[ModuleType | None, str]:
    if not cpu_has(isa):
        return None, f"off: this CPU lacks {isa} ({', '.join(ISAS[isa][1])})"
    module, why = build_extension(f"quantized {isa}", f"specserve_quant_{isa}", SOURCES,
                                  ["-O3", *ISAS[isa][0], "-fopenmp"], f"quant-{isa}", isa, HEADERS)
    if module is not None and isa == "amx":
        if not module.amx_enable():
            return None, "off: Linux refused this process the AMX tile state (arch_prctl)"
        module.set_amx_min_rows(*amx_min_rows())
        module.set_amx_plane_rows(*AMX_PLANE_ROWS)
    return module, why


def amx_min_rows() -> tuple[int, int]:
    """The fewest rows a call must have for the amx build to run Q4_K and Q6_K on its tiles (fewer take its vector
    kernel: the same bits). `SPECSERVE_Q4_AMX_MIN_ROWS=Q4K,Q6K` overrides the measured defaults."""
    raw = os.environ.get("SPECSERVE_Q4_AMX_MIN_ROWS", "").strip()
    if not raw:
        return AMX_MIN_ROWS
    try:
        q4k, q6k = (int(v) for v in raw.split(","))
    except ValueError:
        raise ValueError(f"SPECSERVE_Q4_AMX_MIN_ROWS={raw!r}: two row counts, Q4_K then Q6_K, e.g. 9,48") from None
    if q4k < 1 or q6k < 1:
        raise ValueError(f"SPECSERVE_Q4_AMX_MIN_ROWS={raw!r}: row counts are at least 1")
    return q4k, q6k


def build(isa: str) -> ModuleType | None:
    """The kernels built for `isa`, or None where they cannot run (`status(isa)` says why)."""
    if isa not in _MODULES:
        _MODULES[isa] = _load(isa)
    return _MODULES[isa][0]


def status(isa: str) -> str:
    build(isa)
    return _MODULES[isa][1]


def allowed() -> list[str]:
    """The ISAs `SPECSERVE_CPU_KERNEL` lets a forward use, fastest first (amx and auto: all; avx512: not amx)."""
    name = requested()
    if name == "torch":
        return []
    if name == "avx2":
        return [isa for isa in ISAS if isa.startswith("avx2")]
    return [isa for isa in ISAS if isa != "amx"] if name == "avx512" else list(ISAS)


def active() -> ModuleType | None:
    """The fastest build this CPU runs and the kernel choice allows; None: no quantized kernels here."""
    for isa in allowed():
        if (module := build(isa)) is not None:
            return module
    return None


def describe() -> str:
    """One line: which quantized kernel this process runs, and why not the others."""
    module = active()
    chosen = module.isa() if module is not None else "none"
    why = "; ".join(f"{isa}: {'built' if status(isa) == isa else status(isa)}" for isa in ISAS)
    tiles = ""
    if chosen == "amx":
        (q4k, q6k), (p4k, p6k) = amx_min_rows(), AMX_PLANE_ROWS
        tiles = f"; Q4_K / Q6_K on AMX block tiles from {q4k} / {q6k} rows, on planes from {p4k} / {p6k}"
    return f"quantized linears (--dtype q4): {chosen} ({why}{tiles})"
