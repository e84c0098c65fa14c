"""A tensor in the affine form (quant_formats.py) packed into the kernel's layout, and back. kernels/quant_linear.cpp
describes the layout: tiles of 16 outputs, each tile its superblocks in order, each superblock its scales then its
codes (4 output-interleaved bytes per output per group of 4 weights; 4..6-bit codes as nibbles plus a bit plane
(5 bits) or a vector of the four groups' 2-bit crumbs (6 bits))."""

from __future__ import annotations

import numpy as np

from model_runtime.quant_formats import Affine, UnsupportedQuantError

TILE = 16


def _pad64(n: int) -> int:
    return (n + 63) // 64 * 64


def meta_bytes(nb: int) -> int:
    return 64 if nb == 1 else 128 + _pad64(2 * nb * TILE)


def superblock_bytes(bits: int, superblock: int, block: int) -> int:
    return meta_bytes(superblock // block) + superblock * TILE * bits // 8


def packed_bytes(n: int, k: int, bits: int, superblock: int, block: int) -> int:
    return -(-n // TILE) * (k // superblock) * superblock_bytes(bits, superblock, block)


def _exact_f16(x: np.ndarray, what: str) -> np.ndarray:
    half = x.astype(np.float16)
    if not np.array_equal(half.astype(np.float32), x):
        raise UnsupportedQuantError(f"{what}: a scale is not a float16 value (the one-block formats store them so)")
    return half


def pack(a: Affine) -> np.ndarray:
    """uint8 [packed_bytes] of `a`."""
    n, k = a.shape
    sbk, bk = a.superblock, a.block
    nb, nsb, g = sbk // bk, k // sbk, bk // 4
    tiles = -(-n // TILE)
    pad = tiles * TILE - n

    def rows(x: np.ndarray) -> np.ndarray:
        return np.concatenate([x, np.zeros((pad, *x.shape[1:]), dtype=x.dtype)]) if pad else x

    def per_sb(x: np.ndarray, dtype: str) -> np.ndarray:  # [n, nsb] -> [t, s, 16 values as bytes]
        return np.ascontiguousarray(rows(x).reshape(tiles, TILE, nsb).transpose(0, 2, 1), dtype=dtype).view(np.uint8)

    if nb == 1:
        if not ((a.sc == 1).all() and (a.mn == 1).all()):
            raise UnsupportedQuantError(f"{a.source}: one-block superblocks carry their scales in D and M")
        meta = np.concatenate([per_sb(_exact_f16(a.D, a.source), "<f2"), per_sb(_exact_f16(a.M, a.source), "<f2")],
                              axis=-1)
    else:
        sc = rows(a.sc).reshape(tiles, TILE, nsb, nb).transpose(0, 2, 3, 1).reshape(tiles, nsb, nb * TILE)
        mn = rows(a.mn).reshape(tiles, TILE, nsb, nb).transpose(0, 2, 3, 1).reshape(tiles, nsb, nb * TILE)
        meta = np.zeros((tiles, nsb, meta_bytes(nb)), dtype=np.uint8)
        meta[..., 0:64] = per_sb(a.D, "<f4")
        meta[..., 64:128] = per_sb(a.M, "<f4")
        meta[..., 128:128 + nb * TILE] = sc.view(np.uint8)
        meta[..., 128 + nb * TILE:128 + 2 * nb * TILE] = mn.view(np.uint8)
    # codes [t, j, s, b, group, p] -> [t, s, b, group, j, p]: a group's 64 bytes, byte 4j + p
    q = np.ascontiguousarray(rows(a.q).reshape(tiles, TILE, nsb, nb, g, 4).transpose(0, 2, 3, 4, 1, 5))
    q = q.reshape(tiles, nsb, nb, g, 64)
    if a.bits == 8:
        codes = q.reshape(tiles, nsb, nb, -1)
    else:
        low = q & 0x0F
        parts = [(low[:, :, :, : g // 2] | (low[:, :, :, g // 2:] << 4)).reshape(tiles, nsb, nb, -1)]
        if a.bits == 6:  # one vector: byte i = hi(0) << 4 | hi(1) << 2 | hi(2) | hi(3) << 6 of the groups' byte i
            if g != 4:
                raise UnsupportedQuantError(f"{a.source}: 6-bit codes in blocks of {bk}; the kernels take 16")
            hi = q >> 4
            parts.append(((hi[:, :, :, 0] << 4) | (hi[:, :, :, 1] << 2) | hi[:, :, :, 2] | (hi[:, :, :, 3] << 6))
                         .reshape(tiles, nsb, nb, -1))
        if a.bits == 5:  # one plane of bit 4: 64 bits per group, bit i = byte i's
            parts.append(np.packbits((q >> 4) & 1, axis=-1, bitorder="little").reshape(tiles, nsb, nb, -1))
        codes = np.concatenate(parts, axis=-1)
    out = np.concatenate([meta, codes.reshape(tiles, nsb, -1)], axis=-1).reshape(-1)
    assert out.size == packed_bytes(n, k, a.bits, sbk, bk), (out.size, n, k)
    return out


def unpack(packed: np.ndarray, n: int, k: int, bits: int, superblock: int, block: int, source: str = "") -> Affine:
    """The inverse of `pack` (tests, and QuantLinear.unpack)."""
    nb, nsb, g = superblock // block, k // superblock, block // 4
    tiles = -(-n // TILE)
    sb = packed.reshape(tiles, nsb, superblock_bytes(bits, superblock, block))

    def per_row(raw: np.ndarray, dtype: str) -> np.ndarray:  # [t, s, bytes] -> [n, nsb] float32
        return np.ascontiguousarray(raw).view(dtype).transpose(0, 2, 1).reshape(tiles * TILE, nsb)[:n].astype(np.float32)

    if nb == 1:
        D, M = per_row(sb[..., 0:32], "<f2"), per_row(sb[..., 32:64], "<f2")
        sc = mn = np.ones((n, nsb), dtype=np.int8)
    else:
        D, M = per_row(sb[..., 0:64], "<f4"), per_row(sb[..., 64:128], "<f4")

        def per_block(raw: np.ndarray) -> np.ndarray:
            return np.ascontiguousarray(raw).view(np.int8).reshape(tiles, nsb, nb, TILE).transpose(0, 3, 1, 2) \
                .reshape(tiles * TILE, nsb * nb)[:n]

        sc, mn = per_block(sb[..., 128:128 + nb * TILE]), per_block(sb[..., 128 + nb * TILE:128 + 2 * nb * TILE])
    codes = sb[..., meta_bytes(nb):].reshape(tiles, nsb, nb, -1)
    if bits == 8:
        q = codes.reshape(tiles, nsb, nb, g, 64)
    else:
        nib = codes[..., : g // 2 * 64].reshape(tiles, nsb, nb, g // 2, 64)
        q = np.concatenate([nib & 0x0F, nib >> 4], axis=3)
        if bits == 6:
            u = codes[..., g // 2 * 64:g // 2 * 64 + 64].reshape(tiles, nsb, nb, 1, 64)
            q = q | (np.concatenate([(u >> 4) & 3, (u >> 2) & 3, u & 3, (u >> 6) & 3], axis=3) << 4)
        if bits == 5:
            plane = codes[..., g // 2 * 64:g // 2 * 64 + g * 8].reshape(tiles, nsb, nb, g, 8)
            q = q | (np.unpackbits(plane, axis=-1, bitorder="little") << 4)
    q = q.reshape(tiles, nsb, nb, g, TILE, 4).transpose(0, 4, 1, 2, 3, 5).reshape(tiles * TILE, k)[:n]
    return Affine(np.ascontiguousarray(q), D, M, np.ascontiguousarray(sc), np.ascontiguousarray(mn), bits, superblock,
                  block, source)
