// Linears on the GGUF's own quantized weights (model_runtime/quant_weights.py converts them losslessly), for any
// row count at one pass over the weight. model_runtime/kernel_registry.py builds this file per ISA:
// `-mavx512f -mavx512bw -mavx512vl -mavx512vnni` into specserve_quant_avx512 (integer dot products on VNNI),
// `-mavx2 -mfma -mf16c -mavxvnni` into specserve_quant_avx2vnni (AVX2 CPUs with AVX-VNNI: the 256-bit dot products)
// and `-mavx2 -mfma -mf16c` into specserve_quant_avx2 (the same sums through vpmaddubsw: sums16, signed8).
//
// Every weight format is one affine code per weight:  w = D * sc_b * q + M * mn_b   where
//   q      an unsigned code of BITS bits (4: Q4_K, Q4_1, Q4_0; 5: Q5_0; 6: Q6_K; 8: Q8_0),
//   sc_b   a signed 8-bit multiplier per block of B weights (16 or 32), mn_b likewise,
//   D, M   per superblock of SB weights, per output: float32 for the K formats (SB = 256); for the one-block
//          formats (SB = B = 32) float16, with sc = mn = 1 (the GGUF's own float16 scales: exact).
// (Q4_K: D = d, sc = the 6-bit scale, M = -dmin, mn = the 6-bit min; Q6_K: D = d, sc = the 8-bit scale,
// M = -32 d, mn = sc; Q8_0: D = d, sc = 1, q = q8 + 128, M = -128 d, mn = 1; ...: every value exactly the GGUF's.)
//
// Activations are quantized per row to int8 per superblock (scale a = max|x| / 127, round to nearest even), as
// llama.cpp does, and each (row, output) is
//     sum over superblocks s of  (D_s a_s) * float(S_s) + (M_s a_s) * float(N_s),
//     S_s = sum_b sc_b * (q . x)_b,   N_s = sum_b mn_b * (sum of x's codes in b)
// with S_s, N_s exact in int32 and the float sum over s in order. Nothing in it depends on other rows, on how the
// outputs are split among threads, or on the ISA (the integer sums are exact; the float steps are the same
// instructions lane for lane), so a row's bits are the same alone, among 80, and on either build.
//
// Layout of a part's weight: tiles of 16 outputs (the last zero-padded), each tile its superblocks in order, each
// superblock:  nb > 1: D[16] f32 | M[16] f32 | sc[nb][16] i8 | mn[nb][16] i8 | zero pad to 64 bytes | codes
//              nb = 1: D[16] f16 | M[16] f16 | codes
//   codes, per block, in groups g of 4 weights (64 bytes: byte 4j+p is output j's weight 4g+p):
//     8 bits: B/4 vectors of 64 bytes, the codes;
//     4..6 bits: B/8 vectors of nibbles, vector g byte 4j+p = low4(j, 4g+p) | low4(j, 4(g + B/8) + p) << 4, then
//                5 bits: one 64-bit plane per group, bit 4j+p = bit 4 of (j, 4g+p);
//                6 bits (B = 16, groups 0..3): one vector of crumbs, byte 4j+p = hi(0) << 4 | hi(1) << 2 | hi(2) |
//                hi(3) << 6 with hi(g) = bits 4-5 of (j, 4g+p): each group's crumb reaches bits 4-5 by one 16-bit
//                shift or none and joins its nibble by a mask (decode6: 13 vector operations for the block, where
//                bit planes took 30; the same 6 bits a weight).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "quant_common.h"
#include "quant_ops.h"
#ifdef __AMX_INT8__
#include "quant_amx.h"  // the amx build's tile kernels
#endif

namespace {

// One block's sums for NR rows: per output, sum over the block of q * x, row i's codes at xb + i * ldx. Groups
// outer, rows inner: a code vector is decoded once and used by every row as it comes, and each row keeps two
// independent chains of half the block's groups each, so NR rows give 2 NR dot-product chains in flight. The
// integer sums are exact: the order does not change a bit.
// Sixteen-bit chains: true where the build sums a chain in 16-bit lanes (the avx2 build without VNNI: a vpmaddubsw
// and a 16-bit add a group, widened once at the block's end, where each group costs a vpmaddubsw, a vpmaddwd and a
// 32-bit add otherwise). Exact while a chain's G / 2 groups cannot pass 32767: each adds at most
// 2 * (2^BITS - 1) * 127 in a lane (|x| <= 127, codes below 2^BITS; vpmaddubsw saturates only beyond 32767).
template <int BITS, int B>
constexpr bool sums16() { return SUM16 && BITS <= 6 && (B / 8) * 2 * ((1 << BITS) - 1) * 127 < 32768; }
// The same build's 8-bit codes: sums of q8 x (vdot_s8_at), 128 psum short of q x (block_dots and dot_row add it
// from the block's activation sum, so every caller gets q x)
template <int BITS>
constexpr bool signed8() { return SUM16 && BITS == 8; }

// WIDEN false: where sums16, the chains are left in 16-bit lanes (the caller widens them, times the block's scale)
template <int BITS, int B, int NR, bool WIDEN = true>
inline void block_chains(const uint8_t* codes, int h, const int8_t* xb, int64_t ldx, VI (&c0)[NR], VI (&c1)[NR]) {
  constexpr int G = B / 4;
  constexpr int HB = 64 / HALVES;  // bytes of a group vector per half
  static_assert(BITS != 6 || G == 4, "decode6 decodes a block of 16 codes");
  for (int i = 0; i < NR; ++i) { c0[i] = vzero_idiom(); c1[i] = vzero_idiom(); }
  auto rows = [&](VI w, int g, VI(&c)[NR]) {
    for (int i = 0; i < NR; ++i) {
      if constexpr (sums16<BITS, B>()) c[i] = vsum16_at(c[i], w, xb + i * ldx + 4 * g);
      else c[i] = vdot_at(c[i], w, xb + i * ldx + 4 * g);
    }
  };
  if constexpr (signed8<BITS>()) {
    auto rows8 = [&](VI w, int g, VI(&c)[NR]) {
      const VI q8 = vsigned8(w);
      for (int i = 0; i < NR; ++i) c[i] = vdot_s8_at(c[i], q8, xb + i * ldx + 4 * g);
    };
    for (int g = 0; g < G; g += 2) {
      rows8(vload(codes + g * 64 + HB * h), g, c0);
      rows8(vload(codes + (g + 1) * 64 + HB * h), g + 1, c1);
    }
  } else if constexpr (BITS == 8) {
    for (int g = 0; g < G; g += 2) {
      rows(vload(codes + g * 64 + HB * h), g, c0);
      rows(vload(codes + (g + 1) * 64 + HB * h), g + 1, c1);
    }
  } else if constexpr (BITS == 6) {
    VI w[4];
    decode6(codes, h, w);
    rows(w[0], 0, c0);
    rows(w[2], 2, c1);
    rows(w[1], 1, c0);
    rows(w[3], 3, c1);
  } else {
    const VI low4 = vbytes(0x0F);
    const uint8_t* planes = codes + G / 2 * 64;
    for (int g = 0; g < G / 2; ++g) {  // a vector of nibbles: group g low, group g + G / 2 high
      const VI v = vload(codes + g * 64 + HB * h);
      VI lo = vand(v, low4), hi = vand(vsrl4(v), low4);
      for (int bit = 4; bit < BITS; ++bit) {  // per high bit, one 64-bit plane per group
        const uint8_t* plane = planes + (bit - 4) * G * 8 + (8 / HALVES) * h;
        lo = vor(lo, vhigh(plane + g * 8, static_cast<uint8_t>(1u << bit)));
        hi = vor(hi, vhigh(plane + (g + G / 2) * 8, static_cast<uint8_t>(1u << bit)));
      }
      rows(lo, g, c0);
      rows(hi, g + G / 2, c1);
    }
  }
  if constexpr (sums16<BITS, B>() && WIDEN) {
    for (int i = 0; i < NR; ++i) { c0[i] = vwiden16(c0[i]); c1[i] = vwiden16(c1[i]); }
  }
}

// The sum of a block's two chains per row (ps: row i's activation sum of the block at ps[i * lds])
template <int BITS, int B, int NR>
inline void block_dots(const uint8_t* codes, int h, const int8_t* xb, int64_t ldx, const int16_t* ps, int64_t lds,
                       VI (&dot)[NR]) {
  VI c0[NR], c1[NR];
  block_chains<BITS, B, NR>(codes, h, xb, ldx, c0, c1);
  for (int i = 0; i < NR; ++i) dot[i] = vadd(c0[i], c1[i]);
  if constexpr (signed8<BITS>()) {
    for (int i = 0; i < NR; ++i) dot[i] = vadd(dot[i], vset(128 * ps[i * lds]));
  }
}

// One row's two chains of a block in 16-bit lanes (sums16: G / 2 groups a chain, as block_chains')
template <int B>
inline void row_chains16(const VI (&w)[B / 4], const int8_t* xr, VI& even, VI& odd) {
  even = odd = vzero();
  for (int g = 0; g < B / 4; g += 2) {
    even = vsum16_at(even, w[g], xr + 4 * g);
    odd = vsum16_at(odd, w[g + 1], xr + 4 * g + 4);
  }
}

template <int BITS, int B>  // per output: sum over the block of q * x (psum: the row's activation sum of the block)
inline VI dot_row(const VI (&w)[B / 4], const int8_t* xr, int32_t psum) {
  constexpr int G = B / 4;
  VI even = vzero(), odd = vzero();  // two chains: the dot product's latency
  if constexpr (sums16<BITS, B>()) {
    row_chains16<B>(w, xr, even, odd);
    return vadd(vwiden16(even), vwiden16(odd));
  }
  if constexpr (signed8<BITS>()) {
    for (int g = 0; g < G; g += 2) {
      even = vdot_s8_at(even, vsigned8(w[g]), xr + 4 * g);
      odd = vdot_s8_at(odd, vsigned8(w[g + 1]), xr + 4 * g + 4);
    }
    return vadd(vadd(even, odd), vset(128 * psum));
  }
  for (int g = 0; g < G; g += 2) {
    int32_t q0, q1;
    std::memcpy(&q0, xr + 4 * g, 4);
    std::memcpy(&q1, xr + 4 * g + 4, 4);
    even = vdot(even, w[g], q0);
    odd = vdot(odd, w[g + 1], q1);
  }
  return vadd(even, odd);
}

// A block's sums for one row times its scale (`scale_pair` = vpair16 of the scale): where sums16, each 16-bit chain
// widened and scaled in one vpmaddwd; else the 32-bit sums times the scale (the same int32 either way)
template <int BITS, int B>
inline VI dot_row_times(const VI (&w)[B / 4], const int8_t* xr, int32_t psum, VI scale, VI scale_pair) {
  if constexpr (sums16<BITS, B>()) {
    VI even, odd;
    row_chains16<B>(w, xr, even, odd);
    return vadd(vmadd16(even, scale_pair), vmadd16(odd, scale_pair));
  }
  return vmul(dot_row<BITS, B>(w, xr, psum), scale);
}

// One row through one tile (a decode step, bandwidth-bound): each block's codes decoded into registers first, then
// two chains of the dot product. Kept apart from tile_rows, whose groups-outer order measured 3-9% slower for Q6_K
// at one row (docs/benchmarks.md, "q4 verify rows"). Its loops over NR are the earlier kernel's, at NR = 1.
template <int BITS, int B>
void tile_row(const uint8_t* tile, int64_t nsb, int64_t sb, const Rows& x, float* out, int64_t ldo, int64_t cols,
              const uint8_t* ahead) {
  constexpr int NR = 1;
  constexpr int G = B / 4;
  constexpr int64_t CODE_BYTES = B * TILE * BITS / 8;
  const int64_t nb = sb / B, codes_at = meta_bytes(nb), step = superblock_bytes(BITS, sb, B);
  const int64_t share = lines_per_block(step, nb);
  for (int h = 0; h < HALVES; ++h) {
    VF acc[NR];
    for (int i = 0; i < NR; ++i) acc[i] = vfzero();
    for (int64_t s = 0; s < nsb; ++s) {
      const uint8_t* p = tile + s * step;
      const uint8_t* codes = p + codes_at;
      const uint8_t* pf = h == 0 && ahead != nullptr ? ahead + s * step : nullptr;
      const int64_t blk0 = s * nb;
      VF ai[NR];
      for (int i = 0; i < NR; ++i) ai[i] = vfset(x.a[i * x.nsb + s]);
      if (nb == 1) {  // sc = mn = 1; D and M float16 (Q4_0, Q4_1, Q5_0, Q8_0)
        prefetch_lines(pf, 0, share, step);
        const VF Dv = vf16(p + 2 * LANES * h), Mv = vf16(p + 32 + 2 * LANES * h);
        VI w[G];
        load_codes<BITS, B>(codes, h, w);
        for (int i = 0; i < NR; ++i) {
          const VI dot = dot_row<BITS, B>(w, x.q + i * x.K + blk0 * B, x.psum[i * x.nblocks + blk0]);
          acc[i] = vfma(vfmul(Dv, ai[i]), vcvt(dot), acc[i]);
          acc[i] = vfma(vfmul(Mv, ai[i]), vcvt(vset(x.psum[i * x.nblocks + blk0])), acc[i]);
        }
        continue;
      }
      const VF Dv = vf32(p + 4 * LANES * h), Mv = vf32(p + 64 + 4 * LANES * h);
      const int8_t* sc = reinterpret_cast<const int8_t*>(p + 128);
      const int8_t* mn = sc + nb * TILE;
      VI S[NR], N[NR];
      for (int i = 0; i < NR; ++i) S[i] = N[i] = vzero();
      for (int64_t bb = 0; bb < nb; bb += 2) {  // nb is even in the K formats
        // the mins: N += mn_b * psum_b for the two blocks
#ifdef __AVX512VNNI__
        const VI mn16 = min_pair(mn + bb * TILE);
        for (int i = 0; i < NR; ++i) N[i] = add_min_pair(N[i], mn16, x.psum + i * x.nblocks + blk0 + bb);
#else
        for (int e = 0; e < 2; ++e) {
          const VI mnv = vi8(mn + (bb + e) * TILE + LANES * h);
          for (int i = 0; i < NR; ++i) N[i] = vadd(N[i], vmul(mnv, vset(x.psum[i * x.nblocks + blk0 + bb + e])));
        }
#endif
        prefetch_lines(pf, bb * share, (bb + 2) * share, step);
        for (int e = 0; e < 2; ++e) {
          const VI scv = vi8(sc + (bb + e) * TILE + LANES * h);
          VI w[G];
          load_codes<BITS, B>(codes + (bb + e) * CODE_BYTES, h, w);
          const int8_t* xb = x.q + (blk0 + bb + e) * B;
          VI scp = scv;  // dot_row_times' scale pair, where it takes one
          if constexpr (sums16<BITS, B>()) scp = vpair16(scv);
          for (int i = 0; i < NR; ++i)
            S[i] = vadd(S[i], dot_row_times<BITS, B>(w, xb + i * x.K, x.psum[i * x.nblocks + blk0 + bb + e], scv, scp));
        }
      }
      for (int i = 0; i < NR; ++i) {
        acc[i] = vfma(vfmul(Dv, ai[i]), vcvt(S[i]), acc[i]);
        acc[i] = vfma(vfmul(Mv, ai[i]), vcvt(N[i]), acc[i]);
      }
    }
    for (int i = 0; i < NR; ++i) vstore(out + i * ldo + LANES * h, acc[i], cols - LANES * h);
  }
}

// rows whose sums are in registers at once: 32 vector registers hold 8 rows' chains and sums, 16 hold 4
constexpr int ROW_BLOCK = HALVES == 1 ? 8 : 4;

// NR rows through one tile: per half, superblock by superblock, each block's codes decoded in registers and used by
// every row (a tile's bytes stay in L1/L2 for the next NR rows)
template <int BITS, int B, int NR>
void tile_rows(const uint8_t* tile, int64_t nsb, int64_t sb, const Rows& x, float* out, int64_t ldo, int64_t cols,
               const uint8_t* ahead) {
  constexpr int64_t CODE_BYTES = B * TILE * BITS / 8;
  const int64_t nb = sb / B, codes_at = meta_bytes(nb), step = superblock_bytes(BITS, sb, B);
  const int64_t share = lines_per_block(step, nb);
  for (int h = 0; h < HALVES; ++h) {
    VF acc[NR];
    for (int i = 0; i < NR; ++i) acc[i] = vfzero();
    for (int64_t s = 0; s < nsb; ++s) {
      const uint8_t* p = tile + s * step;
      const uint8_t* codes = p + codes_at;
      const uint8_t* pf = h == 0 && ahead != nullptr ? ahead + s * step : nullptr;
      const int64_t blk0 = s * nb;
      if (nb == 1) {  // sc = mn = 1; D and M float16 (Q4_0, Q4_1, Q5_0, Q8_0)
        prefetch_lines(pf, 0, share, step);
        const VF Dv = vf16(p + 2 * LANES * h), Mv = vf16(p + 32 + 2 * LANES * h);
        VI dot[NR];
        block_dots<BITS, B, NR>(codes, h, x.q + blk0 * B, x.K, x.psum + blk0, x.nblocks, dot);
        for (int i = 0; i < NR; ++i) {
          const VF ai = vfset(x.a[i * x.nsb + s]);
          acc[i] = vfma(vfmul(Dv, ai), vcvt(dot[i]), acc[i]);
          acc[i] = vfma(vfmul(Mv, ai), vcvt(vset(x.psum[i * x.nblocks + blk0])), acc[i]);
        }
        continue;
      }
      const int8_t* sc = reinterpret_cast<const int8_t*>(p + 128);
      const int8_t* mn = sc + nb * TILE;
      VI S[NR];
      for (int i = 0; i < NR; ++i) S[i] = vzero();
      for (int64_t bb = 0; bb < nb; ++bb) {
        prefetch_lines(pf, bb * share, (bb + 1) * share, step);
        const VI scv = vi8(sc + bb * TILE + LANES * h);
#ifdef __AVX512VNNI__
        if constexpr (BITS == 4) {  // each chain sums 16 codes < 16 times |x| <= 127: an int16, so one pair product
          VI c0[NR], c1[NR];       // adds sc * (c0 + c1) to S (exact, the same int32)
          block_chains<BITS, B, NR>(codes + bb * CODE_BYTES, h, x.q + (blk0 + bb) * B, x.K, c0, c1);
          const VI sc_pair = _mm512_or_si512(_mm512_and_si512(scv, vset(0xFFFF)), _mm512_slli_epi32(scv, 16));
          for (int i = 0; i < NR; ++i)
            S[i] = _mm512_dpwssd_epi32(S[i], _mm512_mask_blend_epi16(0xAAAAAAAA, c0[i], _mm512_slli_epi32(c1[i], 16)),
                                       sc_pair);
          continue;
        }
#endif
        if constexpr (sums16<BITS, B>()) {  // the 16-bit chains widened times the scale (vpair16, dot_row_times)
          VI c0[NR], c1[NR];
          block_chains<BITS, B, NR, false>(codes + bb * CODE_BYTES, h, x.q + (blk0 + bb) * B, x.K, c0, c1);
          const VI scp = vpair16(scv);
          for (int i = 0; i < NR; ++i) S[i] = vadd(S[i], vadd(vmadd16(c0[i], scp), vmadd16(c1[i], scp)));
          continue;
        }
        VI dot[NR];
        block_dots<BITS, B, NR>(codes + bb * CODE_BYTES, h, x.q + (blk0 + bb) * B, x.K, x.psum + blk0 + bb, x.nblocks,
                                dot);
        for (int i = 0; i < NR; ++i) S[i] = vadd(S[i], vmul(dot[i], scv));
      }
      // the mins: N = sum_b mn_b * psum_b, then the superblock's two terms into each row's float sum, in order
      const VF Dv = vf32(p + 4 * LANES * h), Mv = vf32(p + 64 + 4 * LANES * h);
#ifdef __AVX512VNNI__
      VI mn16[8];  // per pair of blocks: int16 pairs (mn_b0[j], mn_b1[j]) in lane j
      for (int64_t bb = 0; bb < nb; bb += 2) mn16[bb / 2] = min_pair(mn + bb * TILE);  // nb even, at most 16
#endif
      for (int i = 0; i < NR; ++i) {
        const int16_t* ps = x.psum + i * x.nblocks + blk0;
        VI N = vzero();
        for (int64_t bb = 0; bb < nb; bb += 2) {
#ifdef __AVX512VNNI__
          N = add_min_pair(N, mn16[bb / 2], ps + bb);
#else
          N = vadd(N, vmul(vi8(mn + bb * TILE + LANES * h), vset(ps[bb])));
          N = vadd(N, vmul(vi8(mn + (bb + 1) * TILE + LANES * h), vset(ps[bb + 1])));
#endif
        }
        const VF ai = vfset(x.a[i * x.nsb + s]);
        acc[i] = vfma(vfmul(Dv, ai), vcvt(S[i]), acc[i]);
        acc[i] = vfma(vfmul(Mv, ai), vcvt(N), acc[i]);
      }
    }
    for (int i = 0; i < NR; ++i) vstore(out + i * ldo + LANES * h, acc[i], cols - LANES * h);
  }
}

template <int BITS, int B>
void run_tiles(const uint8_t* w, int64_t tiles, int64_t n_out, int64_t nsb, int64_t sb, const Quantized& xq,
               float* out, int64_t ldo) {
  const int64_t M = xq.q.size(0), K = xq.q.size(1);
  const int64_t tile_bytes = nsb * superblock_bytes(BITS, sb, B);
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* tile = w + t * tile_bytes;
      const int64_t cols = std::min<int64_t>(TILE, n_out - t * TILE);
      for (int64_t r = 0; r < M; r += ROW_BLOCK) {
        const Rows x{xq.q.data_ptr<int8_t>() + r * K, xq.a.data_ptr<float>() + r * nsb,
                     xq.psum.data_ptr<int16_t>() + r * (K / B), K, nsb, K / B};
        float* o = out + r * ldo + t * TILE;
        // the first row block streams the weight (later ones find the tile in cache): it prefetches ahead
        const uint8_t* ahead = r == 0 && tile + PREFETCH_AHEAD < w + t1 * tile_bytes ? tile + PREFETCH_AHEAD : nullptr;
        switch (std::min<int64_t>(ROW_BLOCK, M - r)) {
          case 8: if constexpr (ROW_BLOCK >= 8) tile_rows<BITS, B, 8>(tile, nsb, sb, x, o, ldo, cols, ahead); break;
          case 7: if constexpr (ROW_BLOCK >= 7) tile_rows<BITS, B, 7>(tile, nsb, sb, x, o, ldo, cols, ahead); break;
          case 6: if constexpr (ROW_BLOCK >= 6) tile_rows<BITS, B, 6>(tile, nsb, sb, x, o, ldo, cols, ahead); break;
          case 5: if constexpr (ROW_BLOCK >= 5) tile_rows<BITS, B, 5>(tile, nsb, sb, x, o, ldo, cols, ahead); break;
          case 4: tile_rows<BITS, B, 4>(tile, nsb, sb, x, o, ldo, cols, ahead); break;
          case 3: tile_rows<BITS, B, 3>(tile, nsb, sb, x, o, ldo, cols, ahead); break;
          case 2: tile_rows<BITS, B, 2>(tile, nsb, sb, x, o, ldo, cols, ahead); break;
          default: tile_row<BITS, B>(tile, nsb, sb, x, o, ldo, cols, ahead); break;
        }
      }
    }
  });
}

}  // namespace

// x [M, K] float32 -> out[:, col : col + n_out] (float32, written in place; out's rows `ldo` apart)
void quant_linear_into(torch::Tensor x, torch::Tensor w, int64_t n_out, int64_t bits, int64_t sb, int64_t b,
                       torch::Tensor out, int64_t col) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == torch::kFloat && out.stride(1) == 1, "out: float32 rows");
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "w: a packed uint8 weight");
  TORCH_CHECK((b == 32 && (bits == 4 || bits == 5 || bits == 8)) || (b == 16 && bits == 6),
              "format: bits 4, 5 or 8 in blocks of 32, or 6 in blocks of 16 (", bits, ", ", b, ")");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % sb == 0 && sb % b == 0, "K ", K, " is not a multiple of the superblock ", sb);
  TORCH_CHECK(sb <= 256 && sb % 16 == 0 && (sb == b || (sb / b) % 2 == 0), "superblock ", sb, " of blocks ", b,
              ": at most 256, one block or an even number of them");
  TORCH_CHECK(out.size(0) == M && col + n_out <= out.size(1), "out too small");
  const int64_t tiles = (n_out + TILE - 1) / TILE, nsb = K / sb;
  TORCH_CHECK(w.numel() == tiles * nsb * superblock_bytes(bits, sb, b), "w: ", w.numel(), " bytes, expected ",
              tiles * nsb * superblock_bytes(bits, sb, b));
  if (M == 0) return;
  float* o = out.data_ptr<float>() + col;
  const uint8_t* wp = w.data_ptr<uint8_t>();
#ifdef __AMX_INT8__
  const int kf = bits == 4 && b == 32 ? 0 : bits == 6 && b == 16 ? 1 : -1;  // Q4_K, Q6_K
  if (sb == 256 && kf >= 0 && M >= g_amx_min_rows[kf]) {
    const bool blocks = M < g_amx_plane_rows[kf];
    const Quantized xq = quantize_rows(x, sb, b, blocks ? block_padded_rows(M) : M > 16 ? (M + 15) / 16 * 16 : M);
    if (blocks) {
      if (kf == 0) block_tiles<4>(wp, tiles, n_out, nsb, xq, M, o, out.stride(0));
      else block_tiles<6>(wp, tiles, n_out, nsb, xq, M, o, out.stride(0));
    } else if (kf == 0) {
      amx_tiles<4, 32>(wp, tiles, n_out, nsb, sb, xq, M, o, out.stride(0));
    } else {
      amx_tiles<6, 16>(wp, tiles, n_out, nsb, sb, xq, M, o, out.stride(0));
    }
    return;
  }
#endif
  const Quantized xq = quantize_rows(x, sb, b, M);
  if (bits == 4) run_tiles<4, 32>(wp, tiles, n_out, nsb, sb, xq, o, out.stride(0));
  else if (bits == 5) run_tiles<5, 32>(wp, tiles, n_out, nsb, sb, xq, o, out.stride(0));
  else if (bits == 6) run_tiles<6, 16>(wp, tiles, n_out, nsb, sb, xq, o, out.stride(0));
  else run_tiles<8, 32>(wp, tiles, n_out, nsb, sb, xq, o, out.stride(0));
}

namespace {

int64_t packed_bytes(int64_t n_out, int64_t k, int64_t bits, int64_t sb, int64_t b) {
  return (n_out + TILE - 1) / TILE * (k / sb) * superblock_bytes(bits, sb, b);
}

std::string isa() { return ISA; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_linear_into", &quant_linear_into, py::call_guard<py::gil_scoped_release>());
  m.def("packed_bytes", &packed_bytes);
  m.def("isa", &isa);
  bind_q4_layers(m);
#ifdef __AMX_INT8__
  m.def("amx_enable", &amx_enable);
  m.def("set_amx_min_rows", [](int64_t q4_k, int64_t q6_k) {
    g_amx_min_rows[0] = std::max<int64_t>(1, q4_k);
    g_amx_min_rows[1] = std::max<int64_t>(1, q6_k);
  });
  m.def("set_amx_plane_rows", [](int64_t q4_k, int64_t q6_k) {
    g_amx_plane_rows[0] = std::max<int64_t>(1, q4_k);
    g_amx_plane_rows[1] = std::max<int64_t>(1, q6_k);
  });
  m.def("amx_plane_rows", []() { return std::make_pair(g_amx_plane_rows[0], g_amx_plane_rows[1]); });
  m.def("amx_min_rows", []() { return std::make_pair(g_amx_min_rows[0], g_amx_min_rows[1]); });
#endif
}
