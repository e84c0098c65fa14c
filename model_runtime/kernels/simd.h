// AVX-512 helpers of the AMX linears (amx_linear.cpp): bf16 <-> float32 in 16 lanes, tail masks.
// model_runtime/kernel_registry.py hashes the headers into the build flags, so editing one rebuilds.
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
