"""The GGUF's quantized tensors as one affine code per weight, losslessly: w = D * sc * q + M * mn.

    q       unsigned code per weight (uint8; 4 bits for Q4_K, Q4_1, Q4_0, 5 for Q5_0, 6 for Q6_K, 8 for Q8_0)
    sc, mn  int8 per block of `block` weights (16 or 32)
    D, M    float32 per superblock of `superblock` weights (256 for the K formats, one block for the rest)

Every number is the GGUF's own (a float16 scale widened to float32, a 6-bit scale as an integer), so
D * sc * q + M * mn evaluated in float64 and rounded once to float32 is the value llama.cpp's dequantization
gives (tests/model_runtime/test_quant_formats.py checks every tensor of the bundled files against gguf's
`dequantize`). The kernel (kernels/quant_linear.cpp) reads this form from its packed layout (quant_pack.py).

Formats (ggml's block layouts, ggml-quants.c):
    Q4_0  32: f16 d, 16 bytes of nibbles (weight j low, j + 16 high)        w = d (q - 8)
    Q4_1  32: f16 d, f16 m, nibbles as Q4_0                                  w = d q + m
    Q5_0  32: f16 d, u32 high bits, nibbles                                  w = d (q - 16)
    Q8_0  32: f16 d, 32 int8                                                 w = d q8       (q = q8 + 128)
    Q4_K  256: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
               (chunk c of 64: weights 64c + l low nibble of byte 32c + l, 64c + 32 + l high)   w = d sc q - dmin m
    Q6_K  256: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales, f16 d     w = d sc (q - 32)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specserve_types.api import SpecServeError


class UnsupportedQuantError(SpecServeError, ValueError):
    """A GGUF tensor type the quantized kernels do not take (the model then runs bfloat16 or float32)."""


@dataclass(frozen=True)
class Affine:
    """One [N, K] tensor in the affine form (see the module docstring)."""

    q: np.ndarray  # uint8 [N, K]
    D: np.ndarray  # float32 [N, K // superblock]
    M: np.ndarray  # float32 [N, K // superblock]
    sc: np.ndarray  # int8 [N, K // block]
    mn: np.ndarray  # int8 [N, K // block]
    bits: int  # 4, 5, 6 or 8: q's width (the kernel stores 4..6 as nibbles plus bit planes)
    superblock: int
    block: int
    source: str  # the GGUF type's name

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape  # type: ignore[return-value]

    def dequantize(self) -> np.ndarray:
        """float32 [N, K]: each weight's value, rounded once from the exact float64 expression."""
        n, k = self.q.shape
        per_sb, per_b = self.superblock, self.block
        D = np.repeat(self.D.astype(np.float64), per_sb, axis=1)
        M = np.repeat(self.M.astype(np.float64), per_sb, axis=1)
        sc = np.repeat(self.sc.astype(np.float64), per_b, axis=1)
        mn = np.repeat(self.mn.astype(np.float64), per_b, axis=1)
        return (D * sc * self.q.astype(np.float64) + M * mn).astype(np.float32).reshape(n, k)

    def take_rows(self, rows: np.ndarray) -> Affine:
        """The same tensor with its output rows reordered (`rows` indexes the old ones)."""
        return Affine(self.q[rows], self.D[rows], self.M[rows], self.sc[rows], self.mn[rows], self.bits,
                      self.superblock, self.block, self.source)


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 bytes [..., 2] -> float32 [...] (exact)."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: weight j the low nibble of byte j, weight j + 16 its high nibble."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _ones(shape: tuple[int, ...]) -> np.ndarray:
    return np.ones(shape, dtype=np.int8)


def _simple(name: str, raw: np.ndarray, n: int, k: int) -> Affine:
    """Q4_0, Q4_1, Q5_0, Q8_0: blocks of 32 with one float16 scale (and Q4_1's min)."""
    blocks = raw.reshape(n, k // 32, -1)
    d = _f16(blocks[..., 0:2])
    one = _ones((n, k // 32))
    if name == "Q4_0":
        q = _nibbles_32(blocks[..., 2:18])
        return Affine(q.reshape(n, k), d, -8 * d, one, one, 4, 32, 32, name)
    if name == "Q4_1":
        m = _f16(blocks[..., 2:4])
        q = _nibbles_32(blocks[..., 4:20])
        return Affine(q.reshape(n, k), d, m, one, one, 4, 32, 32, name)
    if name == "Q5_0":
        qh = np.ascontiguousarray(blocks[..., 2:6]).view("<u4")[..., 0]  # [n, k/32]
        high = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        q = _nibbles_32(blocks[..., 6:22]) | (high << 4)
        return Affine(q.reshape(n, k), d, -16 * d, one, one, 5, 32, 32, name)
    if name == "Q8_0":
        q = (blocks[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return Affine(q.reshape(n, k), d, -128 * d, one, one, 8, 32, 32, name)
    raise AssertionError(name)


def _q4_k(raw: np.ndarray, n: int, k: int) -> Affine:
    sb = raw.reshape(n, k // 256, 144)
    d, dmin = _f16(sb[..., 0:2]), _f16(sb[..., 2:4])
    s = sb[..., 4:16].astype(np.uint8)  # 12 bytes: ggml's get_scale_min_k4
    sc = np.empty((n, k // 256, 8), dtype=np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4], mn[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    qs = sb[..., 16:144].reshape(n, k // 256, 4, 32)  # chunk c: 64 weights, low nibbles first
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
    return Affine(q, d.reshape(n, k // 256), -dmin.reshape(n, k // 256), sc.reshape(n, k // 32).astype(np.int8),
                  mn.reshape(n, k // 32).astype(np.int8), 4, 256, 32, "Q4_K")


def _q6_k(raw: np.ndarray, n: int, k: int) -> Affine:
    sb = raw.reshape(n, k // 256, 210)
    ql = sb[..., 0:128].reshape(n, k // 256, 2, 64)
    qh = sb[..., 128:192].reshape(n, k // 256, 2, 32)
    scales = sb[..., 192:208].view(np.int8)
    d = _f16(sb[..., 208:210])
    # per half of 128: weight 32t + l (t = 0..3, l < 32): ql[l + 32 (t % 2)] nibble (t // 2), qh[l] bits 2t..2t+1
    low = np.stack([ql[..., 0:32] & 0x0F, ql[..., 32:64] & 0x0F, ql[..., 0:32] >> 4, ql[..., 32:64] >> 4], axis=-2)
    high = np.stack([(qh >> (2 * t)) & 3 for t in range(4)], axis=-2)
    q = (low | (high << 4)).reshape(n, k)
    D = d.reshape(n, k // 256)
    sc = scales.reshape(n, k // 16)
    return Affine(q, D, -32 * D, sc, sc.copy(), 6, 256, 16, "Q6_K")


SUPPORTED = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K")


def to_affine(type_name: str, raw: np.ndarray, n: int, k: int) -> Affine:
    """A GGUF tensor's raw bytes ([N, bytes per row] uint8) in the affine form."""
    if type_name == "Q4_K":
        return _q4_k(raw, n, k)
    if type_name == "Q6_K":
        return _q6_k(raw, n, k)
    if type_name in SUPPORTED:
        return _simple(type_name, raw, n, k)
    raise UnsupportedQuantError(f"GGUF tensor type {type_name} has no quantized kernel (supported: "
                                f"{', '.join(SUPPORTED)})")
