"""Reused memory for the forward's large activations: glibc's malloc serves an allocation of 128 KiB or more (its
dynamic threshold grows to 32 MiB with use, but not for torch's 2 MB-aligned ones) from a fresh `mmap`, and frees
it with `munmap`. A verify of many rows allocates its float32 logits that way every step (16 rows of Qwen's 151,936
ids: 9.7 MB, 32 rows: 19.4 MB), and the kernel zeroes every page of it again at first touch: in `perf` 6-7% of a
16- or 32-row forward of the 1.5B q4 was `clear_page_erms`. `keep_large_allocations()` raises the mmap threshold to
its maximum (32 MiB) and the trim threshold above it, so such blocks come from the heap and return to it, their
pages kept: a 32-row forward 173-181 -> 142-157 ms (docs/forward.md, "q4 verify rows on AMX block tiles").
Larger allocations (the weights, the KV pool) keep their own mappings. The package's `__init__` calls it, so every
process that loads a model (the CLI, the Ray workers) has it. The values computed are the same (allocation only).

Owner of `_STATE`: this module (written once per process by `keep_large_allocations`).
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 256 << 20  # free memory at the heap's top kept before it is returned
_STATE: dict[str, str] = {}


def keep_large_allocations() -> str:
    """Set glibc's thresholds once per process; returns what happened (also where malloc is not glibc's)."""
    if "result" in _STATE:
        return _STATE["result"]
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own symbols: libc's where it is glibc
    except (OSError, AttributeError):
        _STATE["result"] = "unchanged: no glibc mallopt here"
        return _STATE["result"]
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    _STATE["result"] = (f"mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold {TRIM_THRESHOLD >> 20} MiB" if ok
                        else "unchanged: mallopt refused")
    return _STATE["result"]


def describe() -> str:
    """One line for `specserve kernels`."""
    return f"large activations: {_STATE.get('result', 'glibc defaults (keep_large_allocations not called)')}"
