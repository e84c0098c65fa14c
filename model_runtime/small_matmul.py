"""Linear layers for the few-row products of decoding (1 row per sequence) and verification (k+1 rows).

On CPU the matmul library's [M, K] x [K, N] kernels are slow for small M. Measured with torch 2.13 on this
project's 2-core CPU, Qwen-1.5B's gate_up weight [17920, 1536] (110 MB fp32): F.linear takes 5.3 ms at
M=1, 17.3 ms at M=3, 10.5 ms at M=4; `W @ x^T` over a block of four columns takes 2.8 ms, streaming the
weight once at memory speed. Which block width is fastest depends on the weight's shape and the row count
(the [1536, 8960] down projection is fastest at two columns for one row, at four for three or four rows),
so each shape's cost per width is measured once per process (`calibrate`) and every row count gets the
width with the lowest total time. Rows go through in zero-padded blocks of that width; the values of the
other rows in a product never change a row's result (bitwise).

Owner of `_WIDTHS`: this module; it only grows (shape -> width per row count) and is read by `linear`.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

SMALL_ROWS = 8  # above this many rows F.linear's kernels are efficient enough
_CANDIDATES = (1, 2, 4)
_WIDTHS: dict[tuple[tuple[int, int], torch.dtype, int], tuple[int, ...]] = {}  # [rows - 1] -> width


def _key(weight: torch.Tensor) -> tuple[tuple[int, int], torch.dtype, int]:
    return (tuple(weight.shape), weight.dtype, torch.get_num_threads())  # type: ignore[return-value]


def _median_ms(weight: torch.Tensor, width: int, repeats: int) -> float:
    xt = torch.randn(width, weight.shape[1], dtype=weight.dtype).T
    torch.mm(weight, xt)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(weight, xt)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def calibrate(weight: torch.Tensor, repeats: int = 5) -> tuple[int, ...]:
    """Measure this weight shape's block widths (once per shape, dtype and thread count)."""
    key = _key(weight)
    if key not in _WIDTHS:
        cost = {w: _median_ms(weight, w, repeats) for w in _CANDIDATES}
        _WIDTHS[key] = tuple(
            min(_CANDIDATES, key=lambda w, m=m: -(-m // w) * cost[w]) for m in range(1, SMALL_ROWS + 1)
        )
    return _WIDTHS[key]


@torch.inference_mode()
def calibrate_all(weights: list[torch.Tensor]) -> dict[tuple[int, int], tuple[int, ...]]:
    return {tuple(w.shape): calibrate(w) for w in weights if w.device.type == "cpu"}  # type: ignore[misc]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.shape[0]
    if x.device.type != "cpu" or rows > SMALL_ROWS or rows == 0:
        return F.linear(x, weight, bias)
    width = (_WIDTHS.get(_key(weight)) or calibrate(weight))[rows - 1]
    padded = -(-rows // width) * width
    xt = (torch.cat([x, x.new_zeros(padded - rows, x.shape[1])]) if padded != rows else x).T
    blocks = [torch.mm(weight, xt[:, i:i + width]) for i in range(0, padded, width)]
    out = (blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)).T[:rows].contiguous()
    return out + bias if bias is not None else out
