"""The kernel's row-wise bf16 helpers (model_runtime/kernels/row_ops.cpp): RMSNorm and silu(gate) * up in one
pass each, against the torch formulas they replace (model_runtime/model.py), and a row alone against the same row
among others (batch invariance). Skipped where the kernel cannot run (the model then uses the torch formulas)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_runtime.amx_kernel import kernel, status

pytestmark = pytest.mark.skipif(kernel() is None, reason=f"AMX kernel {status()}")


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _within_one_bf16_ulp(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal almost everywhere; where not (float32 sums in another order, ~1-ulp exp), one bf16 rounding apart."""
    equal = (ours == ref).double().mean().item()
    assert equal > 0.999, equal
    assert ((ours.float() - ref.float()).abs() <= ref.float().abs() * 2.0 ** -7 + 1e-30).all()


@pytest.mark.parametrize(("rows", "width"), [(1, 1536), (8, 8960), (80, 896), (3, 37)])
def test_rms_norm_matches_the_torch_formula(rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, width, generator=gen) * 3).bfloat16()
    weight = torch.randn(width, generator=gen).bfloat16()
    _within_one_bf16_ulp(kernel().rms_norm(x, weight, 1e-6), _torch_rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize(("rows", "width"), [(1, 8960), (8, 8960), (80, 4864), (3, 37)])
def test_silu_mul_matches_torch(rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * width, generator=gen) * 4).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    _within_one_bf16_ulp(kernel().silu_mul(gate_up), F.silu(gate) * up)


def test_silu_mul_at_the_extremes() -> None:
    """Very negative gates give silu -> -0 (exp overflows to inf, as in torch), large ones the gate itself."""
    gate = torch.tensor([-1e4, -100.0, -88.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 100.0, 1e4])
    gate_up = torch.cat([gate, torch.full_like(gate, 3.0)])[None].bfloat16()
    ref = F.silu(gate_up[:, :10]) * gate_up[:, 10:]
    assert torch.equal(kernel().silu_mul(gate_up), ref)


def test_a_row_is_the_same_alone_or_among_others() -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(80, 1536, generator=gen).bfloat16()
    weight = torch.randn(1536, generator=gen).bfloat16()
    gate_up = torch.randn(80, 2 * 8960, generator=gen).bfloat16()
    norms, acts = kernel().rms_norm(x, weight, 1e-6), kernel().silu_mul(gate_up)
    for i in (0, 17, 79):
        assert torch.equal(kernel().rms_norm(x[i:i + 1], weight, 1e-6), norms[i:i + 1])
        assert torch.equal(kernel().silu_mul(gate_up[i:i + 1]), acts[i:i + 1])
