"""The GGUF's quantized formats in the affine form are lossless (every weight gguf's own dequantized value), and the
kernel's packed layout holds exactly that form (pack / unpack)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize, quantize

from model_runtime.quant_formats import SUPPORTED, UnsupportedQuantError, to_affine
from model_runtime.quant_pack import pack, packed_bytes, unpack

K_BYTES = {"Q4_K": 144, "Q6_K": 210}  # bytes per superblock of 256


def raw_tensor(name: str, n: int, k: int, seed: int) -> np.ndarray:
    """[n, bytes per row] of a valid GGUF tensor: quantized by gguf where it can, else random superblocks with sane
    float16 scales (any bit pattern of the codes and 6-bit scales is a valid K-format block)."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[name]
    if name not in K_BYTES:
        return quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    raw = rng.integers(0, 256, size=(n, k // 256, K_BYTES[name]), dtype=np.uint8)
    scales = (rng.random((n, k // 256, 2)) * 0.01 + 1e-4).astype(np.float16).view(np.uint8).reshape(n, k // 256, 4)
    if name == "Q4_K":
        raw[..., 0:4] = scales  # d, dmin
    else:
        raw[..., 208:210] = scales[..., 0:2]  # d (last)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("name", SUPPORTED)
def test_affine_form_is_each_weight_exactly(name: str) -> None:
    n, k = 37, 512
    raw = raw_tensor(name, n, k, seed=SUPPORTED.index(name))
    a = to_affine(name, raw, n, k)
    want = dequantize(raw, gguf.GGMLQuantizationType[name]).reshape(n, k)
    assert np.array_equal(a.dequantize(), want)  # bitwise
    assert a.q.max() < 2 ** a.bits
    if a.superblock == a.block:  # the kernel's contract for one-block superblocks: D and M carry the scales
        assert (a.sc == 1).all() and (a.mn == 1).all()


@pytest.mark.parametrize("name", SUPPORTED)
def test_pack_then_unpack_gives_the_same_form(name: str) -> None:
    n, k = 37, 512  # 37 outputs: the last tile of 16 is zero-padded
    a = to_affine(name, raw_tensor(name, n, k, seed=7), n, k)
    packed = pack(a)
    assert packed.dtype == np.uint8 and packed.size == packed_bytes(n, k, a.bits, a.superblock, a.block)
    b = unpack(packed, n, k, a.bits, a.superblock, a.block)
    for field in ("q", "D", "M", "sc", "mn"):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field


def test_an_unsupported_type_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedQuantError, match="Q2_K"):
        to_affine("Q2_K", np.zeros((1, 84), dtype=np.uint8), 1, 256)
