"""The quantized linears' kernels (kernels/quant_linear.cpp) a `--dtype q4` model runs: the registry's q4 build
for this CPU (model_runtime/kernel_registry.py: amx with AMX tiles, avx512 with VNNI, avx2vnni, avx2; all give the
same bits, so a capped path stands in for a smaller CPU in the tests), or none (the quantized dtype is then
refused: SPECSERVE_CPU_KERNEL=torch, or no build loads)."""

from __future__ import annotations

from types import ModuleType

from model_runtime import kernel_registry as registry
from model_runtime import q4_tiles


def active() -> ModuleType | None:
    """The fastest q4 build this CPU runs and SPECSERVE_CPU_KERNEL allows; None: no quantized kernels here."""
    found = registry.resolve(registry.Q4_LINEAR)
    return found[1] if found else None


def builds() -> list[registry.Build]:
    """Every q4 build of the table, fastest first."""
    return [p.ops[registry.Q4_LINEAR] for p in registry.PATHS if registry.Q4_LINEAR in p.ops]


def describe() -> str:
    """One line: which quantized kernel this process runs, and why not the others."""
    module = active()
    chosen = module.isa() if module is not None else "none"
    why = "; ".join(f"{b.isa}: {registry.status(b)}" for b in builds())
    tiles = f"; {q4_tiles.describe()}" if module is not None and hasattr(module, "set_amx_min_rows") else ""
    return f"quantized linears (--dtype q4): {chosen} ({why}{tiles})"
