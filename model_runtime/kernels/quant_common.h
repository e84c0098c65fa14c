// What the quantized builds' vector kernels (quant_linear.cpp) and tile kernels (quant_amx.h) share: the packed
// weight's layout, the activations quantized per row, a block's codes decoded into vectors, the weight stream's
// prefetch. quant_linear.cpp is the one translation unit of each build that includes it, hence the anonymous
// namespace. model_runtime/kernel_registry.py hashes the headers into the builds' flags.
#pragma once
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "quant_simd.h"

namespace {

constexpr int64_t TILE = 16;

inline int64_t pad64(int64_t n) { return (n + 63) / 64 * 64; }
inline int64_t meta_bytes(int64_t nb) { return nb == 1 ? 64 : 128 + pad64(2 * nb * TILE); }
inline int64_t superblock_bytes(int64_t bits, int64_t sb, int64_t b) {
  return meta_bytes(sb / b) + sb * TILE * bits / 8;
}

// ---- activations: per row, per superblock of `sb`: int8 codes, a scale, and per block of `b` the codes' sum ----
struct Quantized {
  torch::Tensor q;     // int8 [M, K]
  torch::Tensor a;     // float [M, K / sb]
  torch::Tensor psum;  // int16 [M, K / b] (|.| <= 32 * 127): two blocks' sums read as one int32 (add_min_pair)
};

// The same instructions in both builds (AVX2 + FMA, 8 lanes): a row's codes and scales do not depend on the build.
// max |x| is exact in any order; x * (127 / max) rounds to nearest even (cvtps's default mode, as nearbyint); the
// codes (|.| <= 127) narrow to bytes exactly and each block's sum of them is exact in an int16 (|.| <= 32 * 127).
// Vectorized end to end, every superblock's max first (independent chains): the scalar narrowing and sums with one
// max chain per superblock took ~40 us of an 8-row call at K = 8960 (the 1.5B's down projection) on one thread before
// the tiles' parallel loop, this ~10 us.
// codes, scales and sums: M rows, and zero rows up to `rows` (the tiles read whole chunks of rows)
inline int32_t hsum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

Quantized quantize_rows(const torch::Tensor& x, int64_t sb, int64_t b, int64_t rows) {
  const int64_t M = x.size(0), K = x.size(1);
  Quantized r{rows > M ? torch::zeros({rows, K}, torch::kInt8) : torch::empty({M, K}, torch::kInt8),
              rows > M ? torch::zeros({rows, K / sb}, torch::kFloat) : torch::empty({M, K / sb}, torch::kFloat),
              rows > M ? torch::zeros({rows, K / b}, torch::kShort) : torch::empty({M, K / b}, torch::kShort)};
  const float* xs = x.data_ptr<float>();
  int8_t* qs = r.q.data_ptr<int8_t>();
  float* as = r.a.data_ptr<float>();
  int16_t* ps = r.psum.data_ptr<int16_t>();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t m = 0; m < M; ++m) {
    // first every superblock's max |x| (independent chains: no superblock waits for the one before), then the codes
    for (int64_t s = 0; s < K / sb; ++s) {
      const float* xr = xs + m * K + s * sb;
      __m256 m0 = _mm256_setzero_ps(), m1 = m0;  // two chains in registers (sb is a multiple of 16)
      for (int64_t i = 0; i < sb; i += 16) {
        m0 = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xr + i)), m0);
        m1 = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xr + i + 8)), m1);
      }
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(_mm256_max_ps(m0, m1)), _mm256_extractf128_ps(_mm256_max_ps(m0, m1), 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      as[m * (K / sb) + s] = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));  // max |x| for now
    }
    for (int64_t s = 0; s < K / sb; ++s) {
      const float* xr = xs + m * K + s * sb;
      int8_t* qr = qs + m * K + s * sb;
      int16_t* pr = ps + m * (K / b) + s * (sb / b);
      const float amax = as[m * (K / sb) + s];
      as[m * (K / sb) + s] = amax / 127.0f;
      const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      for (int64_t j = 0; j < sb / b; ++j) {  // b is a multiple of 16: two vectors of 8 codes at a time
        __m256i sum = _mm256_setzero_si256();
        for (int64_t i = j * b; i < (j + 1) * b; i += 16) {
          const __m256i c0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + i), inv));
          const __m256i c1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + i + 8), inv));
          sum = _mm256_add_epi32(sum, _mm256_add_epi32(c0, c1));
          const __m128i w0 = _mm_packs_epi32(_mm256_castsi256_si128(c0), _mm256_extracti128_si256(c0, 1));
          const __m128i w1 = _mm_packs_epi32(_mm256_castsi256_si128(c1), _mm256_extracti128_si256(c1, 1));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + i), _mm_packs_epi16(w0, w1));  // codes i..i+15 in order
        }
        pr[j] = static_cast<int16_t>(hsum8(sum));
      }
    }
  }
  return r;
}

struct Rows {  // NR rows' quantized activations, from row r0
  const int8_t* q;
  const float* a;
  const int16_t* psum;
  int64_t K, nsb, nblocks;
};

// A 6-bit block's four groups (B = 16) for this half of the tile: each crumb moved to bits 4-5 and masked in
inline void decode6(const uint8_t* codes, int h, VI (&w)[4]) {
  constexpr int HB = 64 / HALVES;  // bytes of a group vector per half
  const VI low4 = vbytes(0x0F), crumb = vbytes(0x30);
  const VI v0 = vload(codes + HB * h), v1 = vload(codes + 64 + HB * h), u = vload(codes + 128 + HB * h);
  w[0] = vor(vand(v0, low4), vand(u, crumb));
  w[1] = vor(vand(v1, low4), vand(vsll2(u), crumb));
  w[2] = vor(vand(vsrl4(v0), low4), vand(vsll4(u), crumb));
  w[3] = vor(vand(vsrl4(v1), low4), vand(vsrl2(u), crumb));
}

// One block's codes for this half of the tile: G vectors of LANES outputs x 4 weights
template <int BITS, int B>
inline void load_codes(const uint8_t* codes, int h, VI (&w)[B / 4]) {
  constexpr int G = B / 4;
  constexpr int HB = 64 / HALVES;  // bytes of a group vector per half
  if constexpr (BITS == 8) {
    for (int g = 0; g < G; ++g) w[g] = vload(codes + g * 64 + HB * h);
  } else if constexpr (BITS == 6) {
    static_assert(B == 16, "6-bit codes come in blocks of 16");
    decode6(codes, h, w);
  } else {
    const VI low4 = vbytes(0x0F);
    for (int g = 0; g < G / 2; ++g) {
      const VI v = vload(codes + g * 64 + HB * h);
      w[g] = vand(v, low4);
      w[g + G / 2] = vand(vsrl4(v), low4);
    }
    const uint8_t* planes = codes + G / 2 * 64;
    for (int bit = 4; bit < BITS; ++bit, planes += G * 8)
      for (int g = 0; g < G; ++g) w[g] = vor(w[g], vhigh(planes + g * 8 + (8 / HALVES) * h, static_cast<uint8_t>(1u << bit)));
  }
}


// The weight's bytes PREFETCH_AHEAD down this thread's stream of tiles into L2, a block's share of lines at a time
// as the block computes (lines [from, to) of the superblock there): an even trickle keeps the memory busy while
// the rows compute, where the hardware's prefetch alone leaves it idle, and a burst per superblock stalls the
// loads behind it. 3 KB (48 lines, the L2's queue of misses) measured best of 1-8 KB at 1 and 8 rows
// (docs/benchmarks.md, "q4 decode: the weight stream prefetched").
constexpr int64_t PREFETCH_AHEAD = 3072;
inline int64_t lines_per_block(int64_t step, int64_t nb) { return (step + 63) / 64 / nb + 1; }  // once per call
inline void prefetch_lines(const uint8_t* ahead, int64_t from, int64_t to, int64_t step) {
  if (ahead == nullptr) return;
  for (int64_t at = from * 64; at < std::min(to * 64, step); at += 64)
    _mm_prefetch(reinterpret_cast<const char*>(ahead + at), _MM_HINT_T1);
}


}  // namespace
