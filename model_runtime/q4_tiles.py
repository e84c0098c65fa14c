"""Where the amx build of the quantized kernels (kernels/quant_amx.h) takes a Q4_K / Q6_K call to its tiles: the
fewest rows for its block tiles, and where its planes take over (prompts, wide batches). Every kernel gives the
same bits; the row counts only decide the speed. Measured on Sapphire Rapids (docs/forward.md, "q4 verify rows on
AMX block tiles", "The planes made cheaper"); `SPECSERVE_Q4_AMX_MIN_ROWS=Q4K,Q6K` overrides the first pair."""

from __future__ import annotations

import os
from types import ModuleType

AMX_MIN_ROWS = (8, 8)
AMX_PLANE_ROWS = (33, 28)


def amx_min_rows() -> tuple[int, int]:
    """The fewest rows a call must have for the tiles to run Q4_K and Q6_K (fewer take the vector kernel of the same
    build: the same bits): `SPECSERVE_Q4_AMX_MIN_ROWS`, else the measured defaults."""
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


def configure(module: ModuleType) -> None:
    """Set a freshly loaded amx build's row counts (model_runtime/kernel_registry.py calls it once per process)."""
    module.set_amx_min_rows(*amx_min_rows())
    module.set_amx_plane_rows(*AMX_PLANE_ROWS)


def describe() -> str:
    """Where the amx build takes Q4_K / Q6_K calls to its tiles, in words."""
    (q4k, q6k), (p4k, p6k) = amx_min_rows(), AMX_PLANE_ROWS
    return f"Q4_K / Q6_K on AMX block tiles from {q4k} / {q6k} rows, on planes from {p4k} / {p6k}"
