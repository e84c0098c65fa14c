// The q4 kernels' vector operations per build (VI / VF and their operations, one definition per ISA), over which
// quant_linear.cpp writes its kernels once. quant_linear.cpp is the one translation unit of each build that
// includes it (through quant_common.h), hence the anonymous namespace.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {

#ifdef __AVX512VNNI__
// ---- AVX-512 VNNI: 16 outputs in one vector ----
typedef __m512i VI;
typedef __m512 VF;
constexpr int HALVES = 1, LANES = 16;
inline VI vload(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline VI vand(VI a, VI b) { return _mm512_and_si512(a, b); }
inline VI vor(VI a, VI b) { return _mm512_or_si512(a, b); }
inline VI vsrl4(VI a) { return _mm512_srli_epi16(a, 4); }
inline VI vsrl2(VI a) { return _mm512_srli_epi16(a, 2); }
inline VI vsll2(VI a) { return _mm512_slli_epi16(a, 2); }
inline VI vsll4(VI a) { return _mm512_slli_epi16(a, 4); }
inline VI vbytes(uint8_t b) { return _mm512_set1_epi8(static_cast<char>(b)); }
inline VI vhigh(const uint8_t* plane, uint8_t bit) {  // the 64 bits of a plane as bytes 0 / bit
  uint64_t m;
  std::memcpy(&m, plane, 8);
  return _mm512_maskz_mov_epi8(_cvtu64_mask64(m), vbytes(bit));
}
inline VI vdot(VI acc, VI w, int32_t quad) { return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(quad)); }
inline VI vzero_idiom() {  // a zero the renamer makes (xor with itself), not a copy of a zero register
  VI z;
  __asm__ volatile("vpxord %0, %0, %0" : "=v"(z));
  return z;
}
inline VI vdot_at(VI acc, VI w, const int8_t* x) {  // x's 4 bytes broadcast by the dot product's own load
  __asm__("vpdpbusd %[x]%{1to16%}, %[w], %[acc]" : [acc] "+v"(acc) : [w] "v"(w), [x] "m"(*reinterpret_cast<const int32_t*>(x)));
  return acc;
}
// VNNI sums in 32-bit lanes: the avx2 build's 16-bit sums (sums16, signed8) are off, and their helpers only
// declared here (the shared templates name them in branches this build discards)
constexpr bool SUM16 = false;
VI vsum16_at(VI acc16, VI w, const int8_t* x);
VI vwiden16(VI acc16);
VI vmadd16(VI a, VI b);
VI vpair16(VI v);
VI vsigned8(VI w);
VI vdot_s8_at(VI acc, VI q8, const int8_t* x);
inline VI pair_index() {  // 16-bit lanes 2j, 2j+1 <- j, 16 + j
  return _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                          23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
}
// the mins of blocks b, b + 1 (at mn, TILE apart) as int16 pairs (mn_b[j], mn_b+1[j]) in lane j
inline VI min_pair(const int8_t* mn) {
  return _mm512_permutexvar_epi16(pair_index(),
                                  _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mn))));
}
// N + mn_b * psum_b + mn_b+1 * psum_b+1 for one row (ps: its int16 sums of codes of blocks b, b + 1, |psum| <= 32 *
// 127): one pair product, the pair broadcast from memory as one int32
inline VI add_min_pair(VI N, VI pair_of_mins, const int16_t* ps) {
  int32_t pair;
  std::memcpy(&pair, ps, sizeof(pair));
  return _mm512_dpwssd_epi32(N, pair_of_mins, _mm512_set1_epi32(pair));
}
inline VI vadd(VI a, VI b) { return _mm512_add_epi32(a, b); }
inline VI vmul(VI a, VI b) { return _mm512_mullo_epi32(a, b); }
inline VI vset(int32_t x) { return _mm512_set1_epi32(x); }
inline VI vzero() { return _mm512_setzero_si512(); }
inline VI vi8(const int8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline VF vf32(const uint8_t* p) { return _mm512_loadu_ps(p); }
inline VF vf16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline VF vfset(float x) { return _mm512_set1_ps(x); }
inline VF vfzero() { return _mm512_setzero_ps(); }
inline VF vfmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF vfma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline VF vcvt(VI a) { return _mm512_cvtepi32_ps(a); }
inline void vstore(float* out, VF v, int64_t n) {
  _mm512_mask_storeu_ps(out, n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1u), v);
}
#ifdef __AMX_INT8__
constexpr const char* ISA = "amx";
#else
constexpr const char* ISA = "avx512";
#endif
#else
// ---- AVX2: 16 outputs as two halves of 8; u8 x s8 products through 16-bit multiply-adds (exact) ----
typedef __m256i VI;
typedef __m256 VF;
constexpr int HALVES = 2, LANES = 8;
inline VI vload(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline VI vand(VI a, VI b) { return _mm256_and_si256(a, b); }
inline VI vor(VI a, VI b) { return _mm256_or_si256(a, b); }
inline VI vsrl4(VI a) { return _mm256_srli_epi16(a, 4); }
inline VI vsrl2(VI a) { return _mm256_srli_epi16(a, 2); }
inline VI vsll2(VI a) { return _mm256_slli_epi16(a, 2); }
inline VI vsll4(VI a) { return _mm256_slli_epi16(a, 4); }
inline VI vbytes(uint8_t b) { return _mm256_set1_epi8(static_cast<char>(b)); }
inline VI vhigh(const uint8_t* plane, uint8_t bit) {  // 32 bits (this half's) of a plane as bytes 0 / bit
  uint32_t m;
  std::memcpy(&m, plane, 4);
  const VI spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(m)),
                                        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                         2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const VI select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select), vbytes(bit));
}
#ifdef __AVXVNNI__
inline VI vdot(VI acc, VI w, int32_t quad) {  // per int32 lane j: acc + sum_p w[4j+p] * x[p], u8 x s8, exact
  return _mm256_dpbusd_avx_epi32(acc, w, _mm256_set1_epi32(quad));
}
#else
inline VI vdot(VI acc, VI w, int32_t quad) {  // per int32 lane j: acc + sum_p w[4j+p] * x[p] (any 8-bit codes;
  // the formats' own codes take vsum16_at or vdot_s8_at in this build)
  const __m256i xq = _mm256_set1_epi32(quad);
  const __m256i w_even = _mm256_and_si256(w, _mm256_set1_epi16(0x00FF)), w_odd = _mm256_srli_epi16(w, 8);
  const __m256i x_even = _mm256_srai_epi16(_mm256_slli_epi16(xq, 8), 8), x_odd = _mm256_srai_epi16(xq, 8);
  return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(w_even, x_even), _mm256_madd_epi16(w_odd, x_odd)));
}
#endif
inline VI vzero_idiom() { return _mm256_setzero_si256(); }
inline VI vdot_at(VI acc, VI w, const int8_t* x) {
  int32_t quad;
  std::memcpy(&quad, x, 4);
  return vdot(acc, w, quad);
}
#ifdef __AVXVNNI__
constexpr bool SUM16 = false;
#else
constexpr bool SUM16 = true;  // a chain's pair products summed in 16-bit lanes where they fit (block_chains)
#endif
inline VI vsum16_at(VI acc16, VI w, const int8_t* x) {  // per 16-bit lane j: acc + w[2j] x[2j % 4] + w[2j+1] x[..]
  int32_t quad;
  std::memcpy(&quad, x, 4);
  return _mm256_add_epi16(acc16, _mm256_maddubs_epi16(w, _mm256_set1_epi32(quad)));
}
inline VI vwiden16(VI acc16) { return _mm256_madd_epi16(acc16, _mm256_set1_epi16(1)); }  // pairs to 32-bit lanes
inline VI vmadd16(VI a, VI b) { return _mm256_madd_epi16(a, b); }  // per 32-bit lane: a.lo b.lo + a.hi b.hi
// an int32 lane's value (|v| < 32768) in both its 16-bit halves: vmadd16(chain16, vpair16(scale)) = scale * the
// lane's pair sum, the widening and the block scale's multiply in one instruction
inline VI vpair16(VI v) { return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v, 16)); }
// Q8_0's codes q = q8 + 128 reach 255, too large for vpmaddubsw's 16-bit pair sums; their signed q8 (vsigned8) are
// not: |q8| <= 128 times x carrying q8's sign (vpsignb; |x| <= 127) sums a pair within 2 * 128 * 127 < 32768.
// The sums are then of q8 x, and the caller adds 128 times the block's activation sum (signed8)
inline VI vsigned8(VI w) { return _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80))); }
inline VI vdot_s8_at(VI acc, VI q8, const int8_t* x) {  // per int32 lane j: acc + sum_p q8[4j+p] * x[p]
  int32_t quad;
  std::memcpy(&quad, x, 4);
  const VI xs = _mm256_sign_epi8(_mm256_set1_epi32(quad), q8);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q8), xs), _mm256_set1_epi16(1)));
}
inline VI vadd(VI a, VI b) { return _mm256_add_epi32(a, b); }
inline VI vmul(VI a, VI b) { return _mm256_mullo_epi32(a, b); }
inline VI vset(int32_t x) { return _mm256_set1_epi32(x); }
inline VI vzero() { return _mm256_setzero_si256(); }
inline VI vi8(const int8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline VF vf32(const uint8_t* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p)); }
inline VF vf16(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline VF vfset(float x) { return _mm256_set1_ps(x); }
inline VF vfzero() { return _mm256_setzero_ps(); }
inline VF vfmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF vfma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline VF vcvt(VI a) { return _mm256_cvtepi32_ps(a); }
inline void vstore(float* out, VF v, int64_t n) {
  float buf[8];
  _mm256_storeu_ps(buf, v);
  std::memcpy(out, buf, std::clamp<int64_t>(n, 0, 8) * sizeof(float));
}
#ifdef __AVXVNNI__
constexpr const char* ISA = "avx2vnni";
#else
constexpr const char* ISA = "avx2";
#endif
#endif

}  // namespace
