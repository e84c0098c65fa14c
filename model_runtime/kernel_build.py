"""What the kernels' builds share: this CPU's flags and one build folder per extension and ISA (cpu_kernels.py,
quant_kernels.py)."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def build_dir(isa: str) -> Path:
    """One folder per build (torch's loader keeps one build.ninja and object per source in it)."""
    configured = os.environ.get("SPECSERVE_CACHE")
    root = Path(configured).expanduser() if configured else Path.home() / ".cache" / "specserve"
    path = root / "kernels" / f"torch-{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}" / isa
    path.mkdir(parents=True, exist_ok=True)
    return path
