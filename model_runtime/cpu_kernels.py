"""Which kernels a CPU forward runs, and the portable ones (kernels/portable.cpp) built for this machine's ISA.

A forward's rows must get the same bits whatever else shares the call (greedy speculative output equals plain
decoding only then). The libraries do not promise that: they choose their kernels, and with them a row's reduction
order, by the call's shape and the CPU (on an AMD EPYC without AMX, torch's float32 attention products gave a
decoded row other bits than the same row verified among 18). So every CPU runs our own kernels, one path per kind:

    amx     bf16 linears on AMX tiles, row ops in AVX-512 (kernels/amx_linear.cpp, row_ops.cpp, layers.cpp;
            model_runtime/amx_kernel.py); float32 on the avx512 build below
    avx512  kernels/portable.cpp built with -mavx512f (AVX-512 CPUs without AMX: AMD Zen 4/5, Ice Lake servers)
    avx2    kernels/portable.cpp built with -mavx2 -mfma (every other x86-64 CPU of the last decade)
    torch   the libraries' ops (oneDNN, MKL): no own kernels; bounded, not exact (model_runtime/small_matmul.py)

`SPECSERVE_CPU_KERNEL` picks one: auto (default: the first of amx, avx512, avx2 that this CPU has and that builds),
amx, avx512, avx2 or torch (`onednn` is torch's old name). A path this CPU cannot run is refused (ValueError). The
portable builds give the same bits as each other (16-lane vectors, lane for lane the same arithmetic), so a
capped path stands in for a smaller CPU in the tests. `python -m model_runtime.cpu_kernels` builds every path this
CPU has and prints which kernel each op takes.

Owner of `_MODULES`: this module; each ISA's build is loaded once per process, then only read.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from model_runtime.kernel_build import build_extension, cpu_flags
from model_runtime.kernel_choice import CHOICES, PATHS, requested

__all__ = ["CHOICES", "PATHS", "Kernels", "active", "available", "cpu_has", "for_dtype", "portable", "requested"]
log = logging.getLogger(__name__)

KERNELS = Path(__file__).parent / "kernels"
PORTABLE = KERNELS / "portable.cpp"
ISA_FLAGS = {  # compiler flags and the /proc/cpuinfo flags they need
    "avx512": (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
               ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma")),
    "avx2": (["-mavx2", "-mfma", "-mf16c"], ("avx2", "fma", "f16c")),
}
_MODULES: dict[str, tuple[ModuleType | None, str]] = {}


def cpu_has(path: str) -> bool:
    """Whether this CPU has the instructions of a path (torch: any)."""
    if path == "torch":
        return True
    if path == "amx":
        from model_runtime.amx_kernel import cpu_has_amx

        return cpu_has_amx()
    return all(flag in cpu_flags() for flag in ISA_FLAGS[path][1])


def _load_portable(isa: str) -> tuple[ModuleType | None, str]:
    if not cpu_has(isa):
        return None, f"off: this CPU lacks {isa} ({', '.join(ISA_FLAGS[isa][1])})"
    return build_extension(isa, f"specserve_{isa}", [PORTABLE],
                           ["-O3", "-ffp-contract=fast", *ISA_FLAGS[isa][0], "-fopenmp"], isa, isa,
                           (KERNELS / "portable_ops.h", KERNELS / "head_blocks.h"))


def portable(isa: str) -> ModuleType | None:
    """The portable kernels built for `isa` (avx512 or avx2), or None where they cannot run (`portable_status`)."""
    if isa not in _MODULES:
        _MODULES[isa] = _load_portable(isa)
    return _MODULES[isa][0]


def portable_status(isa: str) -> str:
    portable(isa)
    return _MODULES[isa][1]


def _amx() -> ModuleType | None:
    from model_runtime.amx_kernel import kernel

    return kernel()


def _runs(path: str) -> bool:
    if path == "torch":
        return True
    if not cpu_has(path):
        return False
    return (_amx() is not None and portable("avx512") is not None) if path == "amx" else portable(path) is not None


def active() -> str:
    """The path a forward built now takes (see the module's docstring)."""
    name = requested()
    if name == "auto":
        return next((p for p in PATHS if _runs(p)), "torch")
    if not cpu_has(name):
        raise ValueError(f"SPECSERVE_CPU_KERNEL={name}: this CPU cannot run it (it has {', '.join(available())})")
    if not _runs(name):
        why = portable_status("avx512") if name == "amx" and _amx() is not None else (
            _amx_status() if name == "amx" else portable_status(name))
        raise ValueError(f"SPECSERVE_CPU_KERNEL={name}: {why}")
    return name


def _amx_status() -> str:
    from model_runtime.amx_kernel import status

    return status()


def available() -> list[str]:
    """Every path this CPU has the instructions for, fastest first, torch last."""
    return [p for p in PATHS if cpu_has(p)] + ["torch"]


@dataclass(frozen=True)
class Kernels:
    """What one model's forward calls: resolved once when the model is built (CausalLM.kernels).

    path: amx | avx512 | avx2 | torch. rows: the module of the row ops (rms_norm, silu_mul,
    paged_attention_group) for the model's dtype, None for torch's formulas. linear: the portable module that takes
    plain [N, K] weights (None: the libraries; AMX-packed weights call their own kernel first: small_matmul.linear)."""

    path: str
    rows: ModuleType | None
    linear: ModuleType | None

    @property
    def exact(self) -> bool:
        """Whether a row's bits are independent of the call (every path but torch's libraries)."""
        return self.path != "torch"


def for_dtype(dtype: torch.dtype, device: torch.device | str = "cpu") -> Kernels:
    """The kernels of a model in `dtype` on `device`."""
    if torch.device(device).type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return Kernels("torch", None, None)
    path = active()
    if path == "torch":
        return Kernels("torch", None, None)
    isa = "avx512" if path == "amx" else path
    module = portable(isa)
    if path == "amx" and dtype == torch.bfloat16:
        return Kernels(path, _amx(), module)
    return Kernels(isa if dtype == torch.float32 and path == "amx" else path, module, module)


def describe() -> list[str]:
    """Lines saying which kernel each op takes on this machine, per path it can run."""
    lines = [f"CPU flags: {' '.join(f for f in ('amx_tile', 'amx_bf16', 'avx512f', 'avx512_bf16', 'avx2', 'fma') if f in cpu_flags())}"]
    try:
        chosen = active()
    except ValueError as exc:
        chosen = f"refused ({exc})"
    lines.append(f"SPECSERVE_CPU_KERNEL={os.environ.get('SPECSERVE_CPU_KERNEL', 'auto')}: this process runs {chosen}")
    for path in available():
        if path == "torch":
            lines.append("  torch:  linear oneDNN / MKL, norm / activation / attention torch ops (bounded, not exact)")
            continue
        if not _runs(path):
            lines.append(f"  {path}: off: {_amx_status() if path == 'amx' else portable_status(path)}")
            continue
        if path == "amx":
            lines.append("  amx:    bf16 linear amx_linear (AMX tiles), int8 draft amx_linear_i8, norm / activation / "
                         "attention row_ops.cpp (AVX-512), layer loop layers.cpp; float32 on the avx512 build")
        else:
            lines.append(f"  {path}: bf16 and float32 linear, norm, activation, attention: portable.cpp ({path} build)")
    from model_runtime.quant_kernels import describe as quant_describe

    lines.append(quant_describe())
    from model_runtime.heap import describe as heap_describe
    from model_runtime.huge_pages import describe as pages_describe

    lines.append(pages_describe())
    lines.append(heap_describe())
    return lines


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for line in describe():
        print(line)
