"""Which kernels a model's forward calls on the CPU, resolved once when the model is built (CausalLM.kernels),
from the kernel registry (model_runtime/kernel_registry.py: the paths, their builds and ops, and why our own)."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from model_runtime import kernel_registry as registry


@dataclass(frozen=True)
class Kernels:
    """What one model's forward calls.

    path: the registry path whose build runs the model's linears (torch: the libraries). rows: the module of the
    row ops (rms_norm, silu_mul, paged_attention_group, and `ops()` for the C++ layer loops), None for torch's
    formulas. linear: the module that takes plain [N, K] weights (None: the libraries). packed: where the model is
    bfloat16 and a path packs its weights once at load (bf16 and int8 linears, their C++ layer loop), that module,
    else None (`packed_why` says why, in words)."""

    path: str
    rows: ModuleType | None
    linear: ModuleType | None
    packed: ModuleType | None = None
    packed_why: str = ""

    @property
    def exact(self) -> bool:
        """Whether a row's bits are independent of the call (every path but torch's libraries)."""
        return self.path != "torch"


TORCH = Kernels("torch", None, None, None, "the libraries' path: no kernel of ours")


def active() -> str:
    """The registry path a forward built now takes (ValueError where SPECSERVE_CPU_KERNEL names one this CPU cannot
    run)."""
    return registry.active()


def for_dtype(dtype: torch.dtype, device: torch.device | str = "cpu") -> Kernels:
    """The kernels of a model in `dtype` on `device`."""
    if torch.device(device).type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return TORCH
    start = registry.active()
    linear, rows = registry.resolve(registry.LINEAR, start), registry.resolve(registry.RMS_NORM, start)
    if linear is None or rows is None:
        return TORCH
    packed = registry.resolve(registry.PACKED_LINEAR, start) if dtype == torch.bfloat16 else None
    if packed is not None:
        return Kernels(packed[0], rows[1], linear[1], packed[1])
    why = "float32 weights stay unpacked" if dtype == torch.float32 else _why_unpacked()
    return Kernels(linear[0], rows[1], linear[1], None, why)


def _why_unpacked() -> str:
    """Why no path of the chain SPECSERVE_CPU_KERNEL starts packs bf16 weights here, in words."""
    start = registry.requested()
    paths = [p for p in registry.chain(start) if registry.PACKED_LINEAR in p.ops]
    if not paths:
        return f"SPECSERVE_CPU_KERNEL={start}: no path from it packs weights"
    return "; ".join(f"{p.name}: {registry.status(p.ops[registry.PACKED_LINEAR])}" for p in paths)


def packed_module() -> ModuleType | None:
    """The module that packs and runs bf16 / int8 weights here (None: none does)."""
    found = registry.resolve(registry.PACKED_LINEAR)
    return found[1] if found else None
