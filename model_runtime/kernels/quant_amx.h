// The amx build's tile kernels for the K formats (Q4_K, Q6_K), beside the vector kernels of quant_linear.cpp (the
// one translation unit that includes it, in its amx build only; hence the anonymous namespace).
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx_tiles.h"
#include "quant_common.h"

namespace {

// ---- AMX (the `amx` build: the avx512 build plus -mamx-tile -mamx-int8): the K formats' sums on tiles -------------
//
// A tile product sums 64 codes of each row against 64 of each output (TDPBSUD / TDPBSSD: x's int8 codes signed,
// the weight's bytes unsigned / signed) with no place for a scale per block of 16 or 32. So the per-block multiplier
// goes into the weight's codes, one digit at a time: with sc = sum_d base^d c_d,
//     S = sum_b sc_b (q . x)_b = sum_d base^d sum_k x_k (q_k c_d(b(k)))
// where every q * c_d fits a byte (Q4_K: 15 * 7, two base-8 digits of its 6-bit scales; Q6_K: (q - 32) * c_d in
// [-96, 93], three balanced base-7 digits of its signed 8-bit scales, 32 N added back: Digits below), two codes'
// products at once by a 16-bit multiply, which carries nothing into the next byte. Each plane of a superblock is
// built once in L1 from the codes and each plane's sum over the superblock accumulates in a tile of up to 16 rows: a
// weight's bytes are decoded once whatever the row count. S is the same int32 the vector kernel sums (exact integers
// in either order), N the same dot products, and the float steps the same instructions, so these tiles give the
// avx512 build's bits row for row: the row count decides which kernel runs a call (g_amx_min_rows,
// g_amx_plane_rows), and no row can tell.

// tiles 0, 1 (Q6_K: 0..2): the planes' int32 sums (rows x 16), 5: the rows' codes (rows x 64), 6 and 7: a plane
void configure_tiles(int rows) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) { cfg.rows[t] = static_cast<uint8_t>(t < 6 ? rows : 16); cfg.colsb[t] = 64; }
  load_config(cfg);
}

// Which kernel runs a Q4_K / Q6_K call, by its rows (all give the same bits): the vector kernel below
// g_amx_min_rows, the block tiles (below) from there, the planes from g_amx_plane_rows. Building the planes costs
// 30-50% more than streaming the codes whatever the rows, the block tiles a share of the tile loads and stored sums
// and a multiply-add per row and block, so the block tiles take a verify's rows and the planes prompts and wide
// batches. Measured on Sapphire Rapids (docs/benchmarks.md, "q4 verify rows on AMX block tiles" and "The planes made
// cheaper"); SPECSERVE_Q4_AMX_MIN_ROWS overrides the first pair.
int64_t g_amx_min_rows[2] = {8, 8};
int64_t g_amx_plane_rows[2] = {33, 28};

// Q4_K: sc in [0, 63] as two base-8 digits c_d, unsigned planes q * c_d (<= 105; TDPBSUD), S = P_0 + 8 P_1.
// Q6_K: sc in [-128, 127] as three balanced base-7 digits c_d in [-3, 3] (sc + 171 in base 7, each digit less 3),
// signed planes (q - 32) * c_d (in [-96, 93]; TDPBSSD): sum_d 7^d P_d = sum_b sc_b ((q - 32) . x)_b = S - 32 N,
// as Q6_K's mn is its sc (N = sum_b sc_b psum_b), so S = P_0 + 7 P_1 + 49 P_2 + 32 N.
template <int BITS> struct Digits;
template <> struct Digits<4> { static constexpr int ND = 2; };
template <> struct Digits<6> { static constexpr int ND = 3; };

inline __m512i pair16(__m512i v) {  // each int32 lane's low 16 bits into both halves (v < 2^16)
  return _mm512_or_si512(v, _mm512_slli_epi32(v, 16));
}

inline __m512i spread_low_byte(__m512i v) {  // each int32 lane's low byte into its 4 bytes
  const __m512i pattern = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12));
  return _mm512_shuffle_epi8(v, pattern);
}

// the plane sums of one 64-code chunk for a tile of rows: a product per plane, the B operand alternating between
// tiles 6 and 7 (Q4_K's planes unsigned, Q6_K's signed)
template <int BITS>
inline void chunk_products(const int8_t* a, int64_t lda, const uint8_t* planes) {
  _tile_loadd(5, a, lda);
  _tile_loadd(6, planes, 64);
  if constexpr (BITS == 4) _tile_dpbsud(0, 5, 6); else _tile_dpbssd(0, 5, 6);
  _tile_loadd(7, planes + 1024, 64);
  if constexpr (BITS == 4) _tile_dpbsud(1, 5, 7); else _tile_dpbssd(1, 5, 7);
  if constexpr (BITS == 6) {
    _tile_loadd(6, planes + 2048, 64);
    _tile_dpbssd(2, 5, 6);
  }
}

template <int P>
inline void store_sums(int32_t* c) {
  _tile_stored(0, c, 64);
  _tile_stored(1, c + 256, 64);
  if constexpr (P > 2) _tile_stored(2, c + 512, 64);
}

inline __m512i div7(__m512i t) {  // floor(t / 7) for 0 <= t < 13110 in each int32 lane: (t * 9363) >> 16
  return _mm512_mulhi_epu16(t, _mm512_set1_epi32(9363));
}

// a superblock's planes (sb = 256): [chunk of 64 codes][plane][16 x 64 bytes], from its metadata and codes at p
template <int BITS, int B>
inline void build_planes(const uint8_t* p, int64_t nb, uint8_t* planes, const uint8_t* pf, int64_t step) {
  constexpr int G = B / 4, P = Digits<BITS>::ND;
  constexpr int64_t CODE_BYTES = B * TILE * BITS / 8;
  const uint8_t* codes = p + meta_bytes(nb);
  const int8_t* sc = reinterpret_cast<const int8_t*>(p + 128);
  const int64_t share = lines_per_block(step, nb);
  for (int64_t bb = 0; bb < nb; ++bb) {  // block bb: chunk bb * B / 64, from row (bb * B % 64) / 4
    prefetch_lines(pf, bb * share, (bb + 1) * share, step);
    const __m512i scv = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + bb * TILE)));
    uint8_t* dst = planes + (bb * B / 64) * P * 1024 + (bb * B % 64) / 4 * 64;
    if constexpr (BITS == 4) {  // q * digit by a 16-bit multiply of two codes at once (q c < 256: no carry)
      const __m512i dig[2] = {  // per output j, each 16-bit half of bytes 4j..4j+3: sc & 7, then sc >> 3
          pair16(_mm512_and_si512(scv, _mm512_set1_epi32(7))), pair16(_mm512_srli_epi32(scv, 3))};
      const uint8_t* src = codes + bb * CODE_BYTES;
      const __m512i low4 = _mm512_set1_epi8(0x0F);
      for (int g = 0; g < G / 2; ++g) {  // a vector of nibbles: group g low, group g + G / 2 high
        const __m512i v = _mm512_loadu_si512(src + g * 64);
        const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        for (int d = 0; d < 2; ++d) {
          _mm512_store_si512(dst + d * 1024 + g * 64, _mm512_mullo_epi16(lo, dig[d]));
          _mm512_store_si512(dst + d * 1024 + (g + G / 2) * 64, _mm512_mullo_epi16(hi, dig[d]));
        }
      }
    } else {  // (q - 32) * c: q |c| by a 16-bit multiply (<= 189: no carry), less 32 |c|, negated where c < 0
      const __m512i t = _mm512_add_epi32(scv, _mm512_set1_epi32(171));  // in [43, 298]
      const __m512i t1 = div7(t), e2 = div7(t1);
      const __m512i e[3] = {_mm512_sub_epi32(t, _mm512_sub_epi32(_mm512_slli_epi32(t1, 3), t1)),
                            _mm512_sub_epi32(t1, _mm512_sub_epi32(_mm512_slli_epi32(e2, 3), e2)), e2};
      __m512i mul[3], off[3];
      __mmask64 neg[3];
      for (int d = 0; d < 3; ++d) {
        const __m512i c = _mm512_sub_epi32(e[d], _mm512_set1_epi32(3));
        const __m512i mag = _mm512_abs_epi32(c);
        mul[d] = pair16(mag);
        off[d] = spread_low_byte(_mm512_slli_epi32(mag, 5));
        neg[d] = _mm512_movepi8_mask(_mm512_srai_epi32(c, 31));  // every byte of a lane where c < 0
      }
      VI q[G];
      load_codes<BITS, B>(codes + bb * CODE_BYTES, 0, q);
      for (int g = 0; g < G; ++g) {
        for (int d = 0; d < 3; ++d) {
          const __m512i u = _mm512_mullo_epi16(q[g], mul[d]);
          const __m512i w = _mm512_mask_sub_epi8(_mm512_sub_epi8(u, off[d]), neg[d], off[d], u);
          _mm512_store_si512(dst + d * 1024 + g * 64, w);
        }
      }
    }
  }
}

// Per output tile, superblock by superblock, 16 rows at a time: the tile products of one step (a superblock's
// planes against 16 rows) are issued, then (at a superblock's first step) the planes of the next superblock are built
// (two plane buffers) and the sums the last step stored are scaled into their rows' float accumulators, and only then
// this step's sums are stored (two sum buffers): no vector load waits on a tile just stored and the tile unit works
// while the vectors scale (the scaling is ~40% of a 128-row Q4_K pass; this order took ~5% off it). The planes'
// builder prefetches the codes PREFETCH_AHEAD down the stream as the vector kernel does (12-16 rows of Q4_K ~18%
// faster, docs/benchmarks.md "q4 decode: the weight stream prefetched").
template <int BITS, int B>
void amx_tiles(const uint8_t* w, int64_t tiles, int64_t n_out, int64_t nsb, int64_t sb, const Quantized& xq,
               int64_t M, float* out, int64_t ldo) {
  constexpr int P = Digits<BITS>::ND;
  const int64_t K = xq.q.size(1), nb = sb / B, step = superblock_bytes(BITS, sb, B);
  const int64_t chunks = sb / 64, tile_bytes = nsb * step, nblocks = K / B;
  const int rows = static_cast<int>(std::min<int64_t>(16, M));
  const int8_t* xs = xq.q.data_ptr<int8_t>();
  const float* as = xq.a.data_ptr<float>();
  const int16_t* ps = xq.psum.data_ptr<int16_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    configure_tiles(rows);
    alignas(64) uint8_t planes[2][4 * P * 1024];
    alignas(64) int32_t sums[2][P * 256];
    std::vector<__m512> acc(M);
    const uint8_t* end = w + t1 * tile_bytes;
    auto ahead = [&](const uint8_t* at) { return at + PREFETCH_AHEAD < end ? at + PREFETCH_AHEAD : nullptr; };
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* tile = w + t * tile_bytes;
      std::fill(acc.begin(), acc.end(), _mm512_setzero_ps());
      // the sums of step (s, r0), stored in sums[buf], into rows r0.. of acc
      auto scale = [&](int64_t s, int64_t r0, int buf) {
        const uint8_t* p = tile + s * step;
        const int8_t* mn = reinterpret_cast<const int8_t*>(p + 128) + nb * TILE;
        VI mn16[8];  // per pair of blocks: int16 pairs (mn_b0[j], mn_b1[j]) in lane j, as the vector kernel
        for (int64_t bb = 0; bb < nb; bb += 2) mn16[bb / 2] = min_pair(mn + bb * TILE);
        const VF Dv = vf32(p), Mv = vf32(p + 64);
        const int32_t* sm = sums[buf];
        for (int64_t i = 0; i < std::min<int64_t>(16, M - r0); ++i) {
          VI N = vzero();
          const int16_t* pr = ps + (r0 + i) * nblocks + s * nb;
          for (int64_t bb = 0; bb < nb; bb += 2) N = add_min_pair(N, mn16[bb / 2], pr + bb);
          const VI P0 = _mm512_load_si512(sm + i * 16), P1 = _mm512_load_si512(sm + 256 + i * 16);
          VI S;
          if constexpr (BITS == 4) {  // P_0 + 8 P_1
            S = _mm512_add_epi32(P0, _mm512_slli_epi32(P1, 3));
          } else {  // P_0 + 7 P_1 + 49 P_2 + 32 N
            const VI P2 = _mm512_load_si512(sm + 512 + i * 16);
            S = _mm512_add_epi32(P0, _mm512_sub_epi32(_mm512_slli_epi32(P1, 3), P1));
            const VI P2x49 = _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(P2, 6), _mm512_slli_epi32(P2, 4)), P2);
            S = _mm512_add_epi32(S, P2x49);
            S = _mm512_add_epi32(S, _mm512_slli_epi32(N, 5));
          }
          const VF ai = vfset(as[(r0 + i) * nsb + s]);
          acc[r0 + i] = vfma(vfmul(Dv, ai), vcvt(S), acc[r0 + i]);
          acc[r0 + i] = vfma(vfmul(Mv, ai), vcvt(N), acc[r0 + i]);
        }
      };
      build_planes<BITS, B>(tile, nb, planes[0], ahead(tile), step);
      int64_t last_s = -1, last_r0 = 0;  // the step whose sums wait in sums[buf ^ 1]
      int buf = 0;
      for (int64_t s = 0; s < nsb; ++s) {
        const uint8_t* p = tile + s * step;
        for (int64_t r0 = 0; r0 < M; r0 += 16) {
          _tile_zero(0); _tile_zero(1);
          if constexpr (P > 2) _tile_zero(2);
          for (int64_t c = 0; c < chunks; ++c)
            chunk_products<BITS>(xs + r0 * K + s * sb + c * 64, K, planes[s % 2] + c * P * 1024);
          if (r0 == 0 && s + 1 < nsb)
            build_planes<BITS, B>(p + step, nb, planes[(s + 1) % 2], ahead(p + step), step);
          if (last_s >= 0) scale(last_s, last_r0, buf ^ 1);
          store_sums<P>(sums[buf]);
          last_s = s; last_r0 = r0; buf ^= 1;
        }
      }
      scale(last_s, last_r0, buf ^ 1);
      const int64_t cols = std::min<int64_t>(TILE, n_out - t * TILE);
      for (int64_t i = 0; i < M; ++i) vstore(out + i * ldo + t * TILE, acc[i], cols);
    }
    _tile_release();
  });
}

// ---- AMX, a tile product per block (Q4_K, Q6_K; a verify's rows): no planes ----
// Each block (Q4_K: 32 codes, Q6_K: 16) x 16 outputs is one TDPBSUD of K = B whose B tile is the block's codes as
// bytes in B / 4 rows (Q4_K: its 4 vectors of nibbles split, low nibbles rows 0..3, high 4..7; Q6_K: decode6's 4
// vectors; both the VNNI layout the codes are stored in), giving the block's dot products (q . x)_b as int32 for up
// to 16 rows at once; each row's S then takes sc_b * (q . x)_b on vectors (vpmulld: exact), the same int32 the
// vector kernel sums, so the bits are the vector kernel's. Per block this costs the split, four tile instructions
// and a multiply-add per row, where the vector kernel spends a dot product per 64 codes per row and the planes
// several stores per 64 codes. Stages of 4 blocks run as a pipeline: the products of stage h are issued, then the
// codes of h + 1 are split and the sums of h - 1 (stored one stage ago) are scaled, then h's sums are stored, so no
// tile load waits on the stores just written and no vector load on the tile just stored (measured: without the
// pipeline a 2-row call of the 1.5B's Q4_K gate_up took 1.28x its 1-row time, with it 1.11x).
// Tiles 0, 1: the rows' codes (R x 32), 2, 3: a block's codes (8 x 64), 4..7: four blocks' sums (R x 16 int32).
void configure_block_tiles(int rows, int block) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(t == 2 || t == 3 ? block / 4 : rows);
    cfg.colsb[t] = static_cast<uint16_t>(t < 2 ? block : 64);
  }
  load_config(cfg);
}

template <int BITS>
inline void split_block(const uint8_t* src, uint8_t* dst) {  // a block's codes -> B / 4 rows of bytes, as decoded
  constexpr int B = BITS == 4 ? 32 : 16;
  VI w[B / 4];
  load_codes<BITS, B>(src, 0, w);
  for (int g = 0; g < B / 4; ++g) _mm512_store_si512(dst + g * 64, w[g]);
}

// one block's product into sums tile C (the tile intrinsics take their tile numbers as literal tokens)
#define BLOCK_PRODUCT(A, B, C, a, lda, b) \
  do {                                    \
    _tile_loadd(A, a, lda);               \
    _tile_loadd(B, b, 64);                \
    _tile_zero(C);                        \
    _tile_dpbsud(C, A, B);                \
  } while (0)

struct BlockScratch {  // per thread: two stages' split codes, and their sums per chunk of 16 rows
  alignas(64) uint8_t codes[2][4][512];
  alignas(64) int32_t sums[2][2][4][16 * 16];
};

// Rows r0 .. r0 + NR (NR <= 32) through one output tile, in one or two chunks of CS rows (the tiles' rows; rows
// past the call's are quantize_rows' zero rows, their sums never stored: `real` rows are). A stage is 4 blocks: half a
// Q4_K superblock, a quarter of a Q6_K one; each stage's codes are split once for both chunks.
template <int BITS, int NR, int CS>
void tile_blocks(const uint8_t* tile, int64_t nsb, const Quantized& xq, int64_t r0, int64_t real, float* out,
                 int64_t ldo, int64_t cols, const uint8_t* end, BlockScratch& scr) {
  static_assert(NR >= 1 && CS <= 16 && NR <= 2 * CS, "one or two chunks of at most 16 rows");
  constexpr int B = BITS == 4 ? 32 : 16, nb = 256 / B, STAGES = nb / 4, CHUNKS = (NR + CS - 1) / CS;
  constexpr int64_t CODE_BYTES = B * TILE * BITS / 8;
  const int64_t K = xq.q.size(1), step = superblock_bytes(BITS, 256, B), nblocks = K / B;
  const int64_t codes_at = meta_bytes(nb), share = lines_per_block(step, nb);
  const int8_t* xs = xq.q.data_ptr<int8_t>() + r0 * K;
  const float* as = xq.a.data_ptr<float>() + r0 * nsb;
  const int16_t* ps = xq.psum.data_ptr<int16_t>() + r0 * nblocks;
  const int64_t stages = STAGES * nsb;
  auto split = [&](int64_t hh) {  // stage hh: superblock hh / STAGES, blocks 4 (hh % STAGES) .. + 3
    const uint8_t* p = tile + (hh / STAGES) * step;
    const int64_t part = hh % STAGES;
    const uint8_t* pf = p + PREFETCH_AHEAD < end ? p + PREFETCH_AHEAD : nullptr;
    for (int j = 0; j < 4; ++j) {  // each block's share of the lines before its split, not the stage's at once
      prefetch_lines(pf, (part * 4 + j) * share, (part * 4 + j + 1) * share, step);
      split_block<BITS>(p + codes_at + (part * 4 + j) * CODE_BYTES, scr.codes[hh % 2][j]);
    }
  };
  auto products = [&](int64_t hh, int c) {  // stage hh's products for chunk c (its codes split one stage ago)
    const int8_t* xb = xs + c * CS * K + hh * 4 * B;
    uint8_t(*cd)[512] = scr.codes[hh % 2];
    BLOCK_PRODUCT(0, 2, 4, xb, K, cd[0]);
    BLOCK_PRODUCT(1, 3, 5, xb + B, K, cd[1]);
    BLOCK_PRODUCT(0, 2, 6, xb + 2 * B, K, cd[2]);
    BLOCK_PRODUCT(1, 3, 7, xb + 3 * B, K, cd[3]);
  };
  auto store = [&](int64_t hh, int c) {
    _tile_stored(4, scr.sums[hh % 2][c][0], 64);
    _tile_stored(5, scr.sums[hh % 2][c][1], 64);
    _tile_stored(6, scr.sums[hh % 2][c][2], 64);
    _tile_stored(7, scr.sums[hh % 2][c][3], 64);
  };
  VF acc[NR];
  VI S[NR];
  for (int i = 0; i < NR; ++i) { acc[i] = vfzero(); S[i] = vzero(); }
  // stage h1's sums (stored one stage ago) into chunk C's S; at a superblock's end, S and N into its float sums
  auto scale = [&](int64_t h1, auto chunk) {
    constexpr int C = decltype(chunk)::value, LO = CS * C, HI = NR < CS * (C + 1) ? NR : CS * (C + 1);
    const int64_t s = h1 / STAGES;
    const uint8_t* p = tile + s * step;
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + 128);
    for (int j = 0; j < 4; ++j) {
      const VI scv = vi8(sc + ((h1 % STAGES) * 4 + j) * TILE);
      const int32_t* sums = scr.sums[h1 % 2][C][j];
      for (int i = LO; i < HI; ++i) S[i] = vadd(S[i], vmul(_mm512_load_si512(sums + (i - LO) * 16), scv));
    }
    if (h1 % STAGES != STAGES - 1) return;
    const int8_t* mn = sc + nb * TILE;  // as tile_rows: N = sum_b mn_b * psum_b, then the two terms in order
    VI mn16[nb / 2];
    for (int64_t bb = 0; bb < nb; bb += 2) mn16[bb / 2] = min_pair(mn + bb * TILE);
    const VF Dv = vf32(p), Mv = vf32(p + 64);
    for (int i = LO; i < HI; ++i) {
      const int16_t* pr = ps + i * nblocks + s * nb;
      VI N = vzero();
      for (int64_t bb = 0; bb < nb; bb += 2) N = add_min_pair(N, mn16[bb / 2], pr + bb);
      const VF ai = vfset(as[i * nsb + s]);
      acc[i] = vfma(vfmul(Dv, ai), vcvt(S[i]), acc[i]);
      acc[i] = vfma(vfmul(Mv, ai), vcvt(N), acc[i]);
      S[i] = vzero();
    }
  };
  split(0);
  for (int64_t hh = 0; hh <= stages; ++hh) {  // each chunk: products, then the last stage's scaling, then the store
    if (hh < stages) {
      products(hh, 0);
      if (hh + 1 < stages) split(hh + 1);
    }
    if (hh >= 1) scale(hh - 1, std::integral_constant<int, 0>{});
    if (hh < stages) store(hh, 0);
    if constexpr (CHUNKS == 2) {
      if (hh < stages) products(hh, 1);
      if (hh >= 1) scale(hh - 1, std::integral_constant<int, 1>{});
      if (hh < stages) store(hh, 1);
    }
  }
  for (int i = 0; i < NR; ++i)
    if (i < real) vstore(out + (r0 + i) * ldo, acc[i], cols);
}

// A K-format call on block tiles, per output tile: up to 32 rows in one pass as two chunks of (M + 1) / 2 rows; more
// 32 at a time as chunks of 16 (the tile's codes in L2 after the first pass). Every call's tiles have one shape.
int64_t block_chunk_rows(int64_t M) { return M <= 16 ? M : M <= 32 ? (M + 1) / 2 : 16; }
int64_t block_padded_rows(int64_t M) { return M <= 16 ? M : (M + block_chunk_rows(M) - 1) / block_chunk_rows(M) * block_chunk_rows(M); }

template <int BITS>
void block_tiles(const uint8_t* w, int64_t tiles, int64_t n_out, int64_t nsb, const Quantized& xq, int64_t M,
                 float* out, int64_t ldo) {
  constexpr int B = BITS == 4 ? 32 : 16;
  const int64_t tile_bytes = nsb * superblock_bytes(BITS, 256, B), cs = block_chunk_rows(M);
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    configure_block_tiles(static_cast<int>(cs), B);
    BlockScratch scr;
    const uint8_t* end = w + t1 * tile_bytes;
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* tile = w + t * tile_bytes;
      const int64_t cols = std::min<int64_t>(TILE, n_out - t * TILE);
      float* o = out + t * TILE;
      if (M > 32) {  // 32 rows a pass (the last one's padding rows zero)
        for (int64_t r0 = 0; r0 < M; r0 += 32) {
          const int64_t real = std::min<int64_t>(32, M - r0);
          if (real > 16) tile_blocks<BITS, 32, 16>(tile, nsb, xq, r0, real, o, ldo, cols, end, scr);
          else tile_blocks<BITS, 16, 16>(tile, nsb, xq, r0, real, o, ldo, cols, end, scr);
        }
        continue;
      }
      switch (M) {
#define CASE(n) case n: tile_blocks<BITS, n, (n <= 16 ? n : (n + 1) / 2)>(tile, nsb, xq, 0, n, o, ldo, cols, end, scr); break;
        CASE(32) CASE(31) CASE(30) CASE(29) CASE(28) CASE(27) CASE(26) CASE(25) CASE(24) CASE(23) CASE(22)
        CASE(21) CASE(20) CASE(19) CASE(18) CASE(17) CASE(16) CASE(15) CASE(14) CASE(13) CASE(12) CASE(11)
        CASE(10) CASE(9) CASE(8) CASE(7) CASE(6) CASE(5) CASE(4) CASE(3) CASE(2)
#undef CASE
        default: tile_blocks<BITS, 1, 1>(tile, nsb, xq, 0, 1, o, ldo, cols, end, scr); break;
      }
    }
    _tile_release();
  });
}

}  // namespace
