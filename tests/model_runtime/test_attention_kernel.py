"""The kernels' paged attention (kernels/portable.cpp, the rows module the kernel registry resolves for bf16 here,
used by model_runtime/attention.py): within bf16 rounding of the float32 products it replaces, on decodes, verifies,
prefills, batches with padded groups and tree masks; masked keys are skipped. (Its rows' bitwise invariance, and a
tree row against the chain of its ancestors, are tests/model_runtime/test_cpu_kernels.py's, on every path.)

Skipped where no kernel of ours runs (SPECSERVE_CPU_KERNEL=torch)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

import model_runtime.attention as attention
from model_runtime.attention import paged_attention, plan_attention
from model_runtime.cpu_kernels import for_dtype

pytestmark = pytest.mark.skipif(for_dtype(torch.bfloat16).rows is None, reason="no kernel of ours runs here")


@contextmanager
def products_path() -> Iterator[None]:
    """attention.py's torch products (the float32 path, here on bf16 inputs)."""
    saved = attention._row_kernel
    attention._row_kernel = lambda q, rows: None
    try:
        yield
    finally:
        attention._row_kernel = saved


def causal(past: int, n: int) -> torch.Tensor:
    return torch.cat([torch.ones(n, past, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], dim=1)


@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(12, 2, 128), (14, 2, 64), (9, 3, 64), (4, 4, 32)])
def test_matches_the_float32_products_within_bf16_rounding(heads: int, kv_heads: int, d: int) -> None:
    g = torch.Generator().manual_seed(d + heads)
    shapes = [(0, 1), (40, 1), (100, 5), (10, 9), (0, 70), (63, 1), (700, 9), (62, 3)]
    total = sum(p + n for p, n in shapes)
    k = torch.randn(total + 5, kv_heads, d, generator=g).bfloat16()
    v = torch.randn(total + 5, kv_heads, d, generator=g).bfloat16()
    slots = torch.randperm(total + 5, generator=g)
    seqs, start, offset = [], 0, 0
    for past, n in shapes:
        seqs.append((offset, slots[start:start + past + n], causal(past, n)))
        start, offset = start + past + n, offset + n
    q = torch.randn(offset, heads, d, generator=g).bfloat16()
    groups = plan_attention(seqs)
    assert any(not grp.all_real for grp in groups)  # padding entries are skipped, not written
    ours = paged_attention(q, k, v, groups)
    with products_path():
        ref = paged_attention(q, k, v, groups)
    # both sum in float32 and round once to bf16: at most one bf16 ulp of the output apart (2^-7 relative) plus
    # the float32 sums' order
    bound = ref.float().abs() * 2.0 ** -7 + 1e-3
    assert ((ours.float() - ref.float()).abs() <= bound).all()
