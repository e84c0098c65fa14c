"""The quantized linears (kernels/quant_linear.cpp): right against a float64 reference, a row's bits the same alone
and among 1..80 rows, and the same bits on the avx512, avx2vnni and avx2 builds (every build this CPU runs)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from model_runtime import kernel_registry as registry
from model_runtime import q4_tiles, quant_kernels
from model_runtime.kernel_build import cpu_flags
from model_runtime.quant_formats import SUPPORTED, Affine, to_affine
from model_runtime.quant_pack import pack
from tests.model_runtime.test_quant_formats import raw_tensor

BY_ISA = {b.isa: b for b in quant_kernels.builds()}
BUILDS = [isa for isa, b in BY_ISA.items() if b.needs <= cpu_flags()]
NEEDS_AMX = pytest.mark.skipif(not {"amx", "avx512"} <= set(BUILDS), reason="this CPU has no AMX")


def module(isa: str):  # noqa: ANN201
    built = registry.module(BY_ISA[isa])
    assert built is not None, registry.status(BY_ISA[isa])  # this CPU has the ISA: the build must work
    return built


def run(mod, a: Affine, packed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    out = torch.full((x.shape[0], a.shape[0] + 3), float("nan"))
    mod.quant_linear_into(x.contiguous(), packed, a.shape[0], a.bits, a.superblock, a.block, out, 2)
    assert out[:, :2].isnan().all() and out[:, -1].isnan().all()  # only its columns written
    return out[:, 2:-1]


def reference(a: Affine, x: torch.Tensor) -> torch.Tensor:
    """float64: activations quantized per row and superblock as the kernel does (a = max|x| / 127, nearest even)."""
    xs = x.double().numpy().reshape(x.shape[0], -1, a.superblock)
    amax = np.abs(x.numpy().reshape(xs.shape)).max(-1, keepdims=True).astype(np.float32)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    q = np.rint((x.numpy().reshape(xs.shape) * inv).astype(np.float32))
    xq = (q * (amax / np.float32(127)).astype(np.float64)).reshape(x.shape)
    return torch.from_numpy(xq @ a.dequantize().astype(np.float64).T)


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("name", SUPPORTED)
def test_matches_the_reference_and_rows_are_invariant(isa: str, name: str) -> None:
    mod = module(isa)
    n, k = 45, 768
    a = to_affine(name, raw_tensor(name, n, k, seed=3), n, k)
    packed = torch.from_numpy(pack(a))
    x = torch.randn(80, k, generator=torch.Generator().manual_seed(0))
    x[5] = 0  # an all-zero row: scale 0, output 0
    out = run(mod, a, packed, x)
    ref = reference(a, x)
    assert torch.allclose(out.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    assert (out[5] == 0).all()
    for rows in (1, 2, 3, 4, 5, 8, 9, 17, 33):
        for start in (0, 80 - rows):
            assert torch.equal(run(mod, a, packed, x[start:start + rows]), out[start:start + rows]), (rows, start)


@pytest.mark.skipif(len(BUILDS) < 2, reason="this CPU runs one build")
@pytest.mark.parametrize("name", SUPPORTED)
def test_builds_give_the_same_bits(name: str) -> None:
    n, k = 33, 512
    a = to_affine(name, raw_tensor(name, n, k, seed=11), n, k)
    packed = torch.from_numpy(pack(a))
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(1)) * 3
    outs = [run(module(isa), a, packed, x) for isa in BUILDS]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_bad_shapes_are_refused() -> None:
    mod = module(BUILDS[0])
    a = to_affine("Q8_0", raw_tensor("Q8_0", 16, 64, seed=0), 16, 64)
    packed = torch.from_numpy(pack(a))
    with pytest.raises(RuntimeError, match="multiple of the superblock"):
        mod.quant_linear_into(torch.zeros(1, 48), packed, 16, 8, 32, 32, torch.zeros(1, 16), 0)
    with pytest.raises(RuntimeError, match="bytes, expected"):
        mod.quant_linear_into(torch.zeros(1, 64), packed[:-1], 16, 8, 32, 32, torch.zeros(1, 16), 0)


@pytest.mark.model
def test_q4_is_refused_where_the_kernels_are_turned_off(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SPECSERVE_CPU_KERNEL=onednn (the libraries' ops): no exact path for q4, so a typed refusal, not a silent
    fallback."""
    from model_runtime.model import CausalLM
    from model_runtime.precision import Q4
    from model_runtime.quant_formats import UnsupportedQuantError

    monkeypatch.setenv("SPECSERVE_CPU_KERNEL", "onednn")
    with pytest.raises(UnsupportedQuantError, match="q4"):
        CausalLM.load(smollm2_dir, dtype=Q4)


def assert_tiles_give_the_vector_kernels_bits(a: Affine, x: torch.Tensor, kernel: str, row_counts: tuple[int, ...]) -> None:
    """The amx build's block tiles or planes, forced from one row, give the avx512 build's bits at each row count."""
    amx, vnni = module("amx"), module("avx512")
    packed = torch.from_numpy(pack(a))
    expected = run(vnni, a, packed, x)
    amx.set_amx_min_rows(1, 1)
    amx.set_amx_plane_rows(*((1000, 1000) if kernel == "blocks" else (1, 1)))
    try:
        for rows in row_counts:
            assert torch.equal(run(amx, a, packed, x[:rows]), expected[:rows]), rows
    finally:
        amx.set_amx_min_rows(*q4_tiles.amx_min_rows())
        amx.set_amx_plane_rows(*q4_tiles.AMX_PLANE_ROWS)


@NEEDS_AMX
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("kernel", ["blocks", "planes"])
def test_amx_tiles_give_the_vector_kernels_bits_at_every_row_count(name: str, kernel: str) -> None:
    """The tiles run from 1 row here (by default only calls of 8 rows and more take them): every row count, ragged
    16-row chunks included, gives the avx512 build's bits, on the block tiles (a verify's rows; past 16 rows they
    run 16 at a time) and on the planes (prompts)."""
    n, k = 40, 1024
    a = to_affine(name, raw_tensor(name, n, k, seed=5), n, k)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(2)) * 2
    x[7] = 0
    assert_tiles_give_the_vector_kernels_bits(a, x, kernel, (1, 2, 3, 8, 9, 15, 16, 17, 31, 32, 33, 50, 64, 70))
    amx = module("amx")
    assert amx.amx_min_rows() == q4_tiles.AMX_MIN_ROWS
    assert amx.amx_plane_rows() == q4_tiles.AMX_PLANE_ROWS


@NEEDS_AMX
@pytest.mark.parametrize("kernel", ["blocks", "planes"])
def test_amx_tiles_at_the_largest_sums(kernel: str) -> None:
    """The integer sums at their bounds: Q4_K codes all 0 or all 15 and every scale and min at 63, against
    activations whose codes are all +-127 (constant rows), so each block's sum reaches 32 * 127 * 15 and each
    superblock's 63 times that. The tiles still give the vector kernel's bits (no sum narrowed or saturated)."""
    n, k = 48, 512
    raw = raw_tensor("Q4_K", n, k, seed=7).reshape(n, k // 256, 144)
    raw[..., 4:16] = 0xFF  # every 6-bit scale and min 63
    raw[0::3, :, 16:] = 0x00  # codes 0
    raw[1::3, :, 16:] = 0xFF  # codes 15
    raw[2::3, :, 16:] = 0xF0  # low nibbles 0, high 15
    a = to_affine("Q4_K", raw.reshape(n, -1), n, k)
    x = torch.ones(20, k)
    x[1::2] = -1.0
    x[4, : k // 2] = -3.0  # a row whose superblocks differ
    assert_tiles_give_the_vector_kernels_bits(a, x, kernel, (1, 2, 8, 16, 17, 20))


@NEEDS_AMX
@pytest.mark.parametrize("kernel", ["blocks", "planes"])
def test_amx_q6_k_tiles_at_every_scale_and_the_largest_sums(kernel: str) -> None:
    """Q6_K's planes take each signed 8-bit scale as three balanced base-7 digits and the codes less 32: every scale
    from -128 to 127 (each of the 256 values in some block), codes all 0, all 63 or mixed, against activations whose
    codes are all +-127, still give the vector kernel's bits (no digit wrong, no sum narrowed or saturated)."""
    n, k = 48, 1024
    raw = raw_tensor("Q6_K", n, k, seed=9).reshape(n, k // 256, 210)
    scales = np.arange(n * (k // 256) * 16) % 256  # every int8 value, in some block of some output
    raw[..., 192:208] = scales.reshape(n, k // 256, 16).astype(np.uint8)
    raw[0::4, :, :192] = 0x00  # codes 0
    raw[1::4, :, :192] = 0xFF  # codes 63
    a = to_affine("Q6_K", raw.reshape(n, -1), n, k)
    x = torch.ones(20, k)
    x[1::2] = -1.0
    x[4, : k // 2] = -3.0
    x[6] = torch.randn(k, generator=torch.Generator().manual_seed(4))
    assert_tiles_give_the_vector_kernels_bits(a, x, kernel, (1, 2, 8, 16, 17, 20))


def test_amx_min_rows_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_Q4_AMX_MIN_ROWS", "4, 9")
    assert q4_tiles.amx_min_rows() == (4, 9)
    for bad in ("4", "a,b", "0,3"):
        monkeypatch.setenv("SPECSERVE_Q4_AMX_MIN_ROWS", bad)
        with pytest.raises(ValueError, match="SPECSERVE_Q4_AMX_MIN_ROWS"):
            q4_tiles.amx_min_rows()
    monkeypatch.delenv("SPECSERVE_Q4_AMX_MIN_ROWS")
    assert q4_tiles.amx_min_rows() == q4_tiles.AMX_MIN_ROWS


@pytest.mark.skipif("amx" not in BUILDS, reason="this CPU has no AMX")
def test_describe_says_where_the_tiles_take_over(monkeypatch: pytest.MonkeyPatch) -> None:
    if quant_kernels.active() is None or quant_kernels.active().isa() != "amx":
        pytest.skip(quant_kernels.describe())
    line = quant_kernels.describe()
    assert "block tiles from 8 / 8 rows, on planes from 33 / 28" in line
    monkeypatch.setenv("SPECSERVE_Q4_AMX_MIN_ROWS", "4,5")
    assert "block tiles from 4 / 5 rows" in quant_kernels.describe()
