"""`SPECSERVE_CPU_KERNEL`: which kernel path a CPU forward takes (model_runtime/cpu_kernels.py explains the paths;
model_runtime/amx_kernel.py stays off unless it names auto or amx)."""

from __future__ import annotations

import os

PATHS = ("amx", "avx512", "avx2")  # fastest first
CHOICES = ("auto", *PATHS, "torch", "onednn")


def requested() -> str:
    """`SPECSERVE_CPU_KERNEL`, checked (ValueError on another name); `onednn` reads as torch."""
    name = os.environ.get("SPECSERVE_CPU_KERNEL", "auto").strip().lower() or "auto"
    if name not in CHOICES:
        raise ValueError(f"SPECSERVE_CPU_KERNEL={name!r}: choose one of {', '.join(CHOICES)}")
    return "torch" if name == "onednn" else name
