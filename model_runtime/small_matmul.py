"""Linear layers for the few-row products of decoding (1 row per sequence) and verification (k+1 rows).

On CPU the matmul library's [M, K] x [K, N] kernels are slow for small M. Measured with torch 2.13 on this
project's 2-core CPU, Qwen-1.5B's gate_up weight [17920, 1536] (110 MB fp32): F.linear takes 5.3 ms at
M=1, 17.3 ms at M=3, 10.5 ms at M=4; `W @ x^T` over a block of four columns takes 2.8 ms, streaming the
weight once at memory speed. Which block width is fastest depends on the weight's shape (the [1536, 8960]
down projection: 1.9 ms for one or two columns, 2.2 ms for three, 3.4 ms for four), so each shape's time per
width is measured once per process (`calibrate`) and every row count gets the split into blocks with the
lowest total time (three rows of the down projection: one block of three). Rows go through in zero-padded
blocks; the values of the other rows in a product never change a row's result (bitwise).

The number of rows does change a row's last bits: one row goes through MKL's matrix-vector kernel, 2-4 rows
through block products, more than SMALL_ROWS through F.linear, and each rounds differently. Measured bound
(fp32, 2 threads, n <= 80 rows; tests/model_runtime/test_small_matmul.py): a row among n rows differs from the
same row alone by <= 5.6e-7 of the largest output (tested at 2e-6); SmolLM2 logits between plain decoding and
a 40-row verify differed by <= 1.05e-4 against a smallest top-two margin of 2e-3 over 32 prompts x 16 tokens,
and greedy output at batch 8 x k=4 is token-identical to decoding each request alone (tests/cluster/engine/
test_engine_models.py). Removing the difference (no width-1 kernel, blocks up to 80 rows) measured 1.8x slower
single-row forwards on SmolLM2 (33 -> 60 ms) and still left attention rows differing (they no longer do:
model_runtime/attention.py), so for float32 it is bounded instead.

bfloat16 is different, and batch-invariant by construction. Where the AMX kernel runs, weights come packed
(model_runtime/packed_weight.py, packed at load by weights.pack_weights) and `linear` hands them to it (kernels/amx_linear.cpp: any row count,
same bits, ~1.5-2x oneDNN's speed). Elsewhere `bf16_linear`: oneDNN's bf16 products give a
row the same bits for any 2..32 rows in the call, but not for 1 row (Qwen-1.5B's down projection, K = 8960)
nor above 32 (another kernel). So bf16 rows go through F.linear in pieces of 2..32 rows (one row is padded
to two, which costs nothing measurable: the weight is streamed either way), and a row's result never depends
on how many rows share the call (tests/model_runtime/test_small_matmul.py checks 1..80 rows on the real
shapes). Prefill pays: 256 rows of Qwen-1.5B's gate_up take ~42 ms in pieces of 32 against ~24 ms at once.

Owner of `_PLANS`: this module; it only grows (shape -> block widths per row count) and is read by `linear`.
"""

from __future__ import annotations

import time
from types import ModuleType

import torch
import torch.nn.functional as F

from model_runtime.packed_weight import PackedBF16, PackedInt8
from model_runtime.quant_weights import QuantLinear

SMALL_ROWS = 8  # above this many rows F.linear's kernels are efficient enough
_CANDIDATES = (1, 2, 3, 4)
Plan = tuple[tuple[int, ...], ...]  # [rows - 1] -> block widths, e.g. 5 rows -> (3, 2)
_PLANS: dict[tuple[tuple[int, int], torch.dtype, int], Plan] = {}


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


def best_splits(cost: dict[int, float], max_rows: int) -> Plan:
    """For 1..max_rows rows, the blocks (widths from `cost`) with the lowest total time; a block may be
    wider than the rows left (zero-padded)."""
    best: list[tuple[float, tuple[int, ...]]] = [(0.0, ())]
    for rows in range(1, max_rows + 1):
        best.append(min((best[max(0, rows - w)][0] + c, best[max(0, rows - w)][1] + (w,)) for w, c in cost.items()))
    return tuple(blocks for _, blocks in best[1:])


def calibrate(weight: torch.Tensor, repeats: int = 5) -> Plan:
    """Measure this weight shape's time per block width (once per shape, dtype and thread count)."""
    key = _key(weight)
    if key not in _PLANS:
        _PLANS[key] = best_splits({w: _median_ms(weight, w, repeats) for w in _CANDIDATES}, SMALL_ROWS)
    return _PLANS[key]


@torch.inference_mode()
def calibrate_all(weights: list[torch.Tensor | PackedBF16 | PackedInt8]) -> dict[tuple[int, int], Plan]:
    return {tuple(w.shape): calibrate(w) for w in weights  # type: ignore[misc]
            if isinstance(w, torch.Tensor) and w.device.type == "cpu" and w.dtype != torch.bfloat16}


INVARIANT_ROWS = 32  # bf16: every piece of 2..INVARIANT_ROWS rows gives a row the same bits


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear in pieces of 2..INVARIANT_ROWS rows: a row's bits do not depend on the rows around it."""
    rows = x.shape[0]
    if rows == 1:
        return F.linear(torch.cat([x, x.new_zeros(1, x.shape[1])]), weight, bias)[:1]
    if rows <= INVARIANT_ROWS:
        return F.linear(x, weight, bias)
    pieces = [x[i:i + INVARIANT_ROWS] for i in range(0, rows, INVARIANT_ROWS)]
    return torch.cat([bf16_linear(piece, weight, bias) for piece in pieces])


def linear(x: torch.Tensor, weight: torch.Tensor | PackedBF16 | PackedInt8 | QuantLinear,
           bias: torch.Tensor | None = None, kernel: ModuleType | None = None) -> torch.Tensor:
    """`kernel`: the model's portable kernels (model_runtime/cpu_kernels.py: batch-invariant for any row count) for
    plain weights of x's dtype; None: the libraries, as below."""
    if isinstance(weight, PackedBF16 | PackedInt8 | QuantLinear):
        return weight(x, bias)  # the AMX kernels (packed_weight.py) or q4's (quant_weights.py): any row count
    if kernel is not None and weight.dtype == x.dtype and x.device.type == "cpu":
        return kernel.linear(x, weight, bias, False)
    rows = x.shape[0]
    if x.device.type != "cpu" or rows == 0:
        return F.linear(x, weight, bias)
    if weight.dtype == torch.bfloat16:
        return bf16_linear(x, weight, bias)
    if rows > SMALL_ROWS:
        if weight.dtype == torch.float16:
            # This CPU has no float16 GEMM: F.linear runs one row at a time (Qwen-0.5B's gate_up, 200 rows:
            # 65 ms; float32 20 ms; bfloat16 4.5 ms), which made a float16 draft's prompt prefill 3.3x slower
            # than float32. Many-row products (prefill) go through bfloat16 instead.
            bf16_bias = bias.bfloat16() if bias is not None else None
            return F.linear(x.bfloat16(), weight.bfloat16(), bf16_bias).to(torch.float16)
        return F.linear(x, weight, bias)
    blocks = (_PLANS.get(_key(weight)) or calibrate(weight))[rows - 1]
    padded = sum(blocks)
    xt = (torch.cat([x, x.new_zeros(padded - rows, x.shape[1])]) if padded != rows else x).T
    starts = [sum(blocks[:i]) for i in range(len(blocks))]
    parts = [torch.mm(weight, xt[:, s:s + w]) for s, w in zip(starts, blocks, strict=True)]
    out = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).T[:rows].contiguous()
    return out + bias if bias is not None else out
