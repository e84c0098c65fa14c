// SIMD helpers shared by the kernels' sources (amx_linear.cpp, row_ops.cpp): bf16 <-> float32 in 16 lanes, tail
// masks, exp. model_runtime/amx_kernel.py hashes the headers into the build flags, so editing one rebuilds.
#pragma once
#include <immintrin.h>
#include <cstdint>

inline __m512 widen_bf16(const uint16_t* p, __mmask16 m) {  // 16 bf16 -> 16 float32 (exact)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline void store_bf16(uint16_t* p, __mmask16 m, __m512 v) {  // round to nearest even
  _mm256_mask_storeu_epi16(p, m, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}
inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1u);
}

// exp(x) in float32 (Cephes' expf: range reduction by ln 2, degree-5 polynomial; ~1 ulp); below -87.3 it
// gives exp(-87.3) (~1e-38), above ~88.7 infinity (as expf: silu(g) of a very negative g is then -0, as torch's)
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(89.0f)), _mm512_set1_ps(-87.3365447504f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
