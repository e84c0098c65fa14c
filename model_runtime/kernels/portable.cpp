// Batch-invariant kernels for any x86-64 CPU with AVX2 and FMA (model_runtime/kernel_registry.py builds this file
// twice: `-mavx512f ...` into specserve_avx512 and `-mavx2 -mfma` into specserve_avx2). The linear, RMSNorm, SiLU * up
// and paged attention of the forward, for bfloat16 and float32 rows: the only source of each of these ops (the AMX
// and quantized builds' layer loops call them by address, portable_ops.h).
//
// Why our own: the libraries pick their kernel (and with it a row's reduction order) by the call's shape and by
// the CPU. On an AMD EPYC (AVX-512 with bf16, no AMX) torch's float32 attention products gave a decoded row other
// bits than the same row verified among 18, which flipped greedy tokens (the exactness issue). Here every output
// element is one float32 sum in a fixed order that depends only on the reduction length (K, head_dim, the row's own
// keys), never on how many rows, sequences or threads share the call:
//   - a dot product of length K is a 16-lane vector accumulator over K in steps of 16 (fused multiply-add, lanes
//     independent), then its 16 lanes added by one fixed tree (hsum);
//   - the vectors are GCC vector extensions of 16 floats: one zmm op under AVX-512, two ymm ops under AVX2, lane
//     for lane the same arithmetic, so both builds give the same bits too (tests/model_runtime/test_cpu_kernels.py).
// bf16 <-> float32: widening is exact; narrowing rounds to nearest even (NaN -> quiet NaN), as torch does.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "head_blocks.h"
#include "portable_ops.h"

namespace {

typedef float vf __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
constexpr int L = 16;  // lanes

#ifdef __AVX512F__
constexpr int ROW_BLOCK = 4, OUT_BLOCK = 4;  // accumulators in registers: 16 zmm
#else
constexpr int ROW_BLOCK = 2, OUT_BLOCK = 3;  // accumulators: 2 x 3 x 2 halves = 12 ymm
#endif

inline vf splat(float x) { return vf{} + x; }
inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline vf load(const uint16_t* p) {  // 16 bf16 -> float32 (exact)
  vh h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<vf>(__builtin_convertvector(h, vu) << 16);
}
template <typename T> inline vf load_tail(const T* p, int64_t n) {  // n < 16 elements, the rest zero
  T buf[L] = {};
  std::memcpy(buf, p, n * sizeof(T));
  return load(buf);
}
template <typename T> inline vf load_n(const T* p, int64_t n) { return n >= L ? load(p) : load_tail(p, n); }

inline vh narrow(vf v) {  // float32 -> bf16, round to nearest even, NaN -> 0x7fc0
  const vu u = reinterpret_cast<vu>(v);
  const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const vu nan = reinterpret_cast<vu>((u & 0x7fffffffu) > 0x7f800000u);  // all ones where NaN
  return __builtin_convertvector((rounded & ~nan) | (0x7fc0u & nan), vh);
}
inline void store_n(float* p, vf v, int64_t n) { std::memcpy(p, &v, std::min<int64_t>(n, L) * sizeof(float)); }
inline void store_n(uint16_t* p, vf v, int64_t n) {
  const vh h = narrow(v);
  std::memcpy(p, &h, std::min<int64_t>(n, L) * sizeof(uint16_t));
}
inline vf round_bf16(vf v) {  // float32 -> the nearest bf16, back in float32
  return reinterpret_cast<vf>(__builtin_convertvector(narrow(v), vu) << 16);
}

inline float hsum(vf v) {  // the 16 lanes by one fixed tree: halves, then halves of those
  const vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return ((b[0] + b[2]) + (b[1] + b[3]));
}

// exp(x) in float32 (Cephes' expf: range reduction by ln 2, degree-5 polynomial; ~1 ulp); below -87.3 it gives
// ~1e-38, above ~88.7 infinity (as expf)
inline vf vexp(vf x) {
  x = x < 89.0f ? x : splat(89.0f);
  x = x > -87.3365447504f ? x : splat(-87.3365447504f);
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding and subtracting rounds to the nearest integer
  const vf n = (x * 1.44269504088896341f + magic) - magic;
  vf r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + (r + 1.0f);
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;  // 2^n (n = 128 gives infinity)
  return p * reinterpret_cast<vf>(e);
}

template <typename T> T* ptr(torch::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }
template <typename T> const T* cptr(const torch::Tensor& t) { return reinterpret_cast<const T*>(t.data_ptr()); }

// Runs `body.template operator()<T>()` with T = uint16_t for bf16, float for float32.
template <typename F> void by_dtype(const torch::Tensor& t, F&& body) {
  if (t.scalar_type() == torch::kBFloat16) body(uint16_t{});
  else if (t.scalar_type() == torch::kFloat) body(float{});
  else TORCH_CHECK(false, "the portable kernels take bfloat16 or float32, not ", t.scalar_type());
}

// The linear's inner loop in the build's own register width: P lanes a physical vector (16 under AVX-512, 8 under
// AVX2), PARTS of them per 16-lane logical accumulator. Lane l of a logical accumulator is lane l % P of part l / P,
// with the same arithmetic, so both builds give the same bits; GCC keeps these in registers where it spills the
// 16-lane type's halves under AVX2 (3.8 -> 1.x ms for one row of an [8960, 1536] bf16 weight).
#ifdef __AVX512F__
typedef vf pv;
typedef vh ph;
#else
typedef vf8 pv;
typedef uint16_t ph __attribute__((vector_size(16)));
typedef uint32_t pu __attribute__((vector_size(32)));
#endif
constexpr int P = sizeof(pv) / sizeof(float), PARTS = L / P;
inline pv pload(const float* p) { pv v; std::memcpy(&v, p, sizeof v); return v; }
inline pv pload(const uint16_t* p) {
  ph h;
  std::memcpy(&h, p, sizeof h);
#ifdef __AVX512F__
  return reinterpret_cast<pv>(__builtin_convertvector(h, vu) << 16);
#else
  return reinterpret_cast<pv>(__builtin_convertvector(h, pu) << 16);
#endif
}
inline void split(vf v, pv* parts) { std::memcpy(parts, &v, sizeof v); }
inline vf join(const pv* parts) { vf v; std::memcpy(&v, parts, sizeof v); return v; }

// NR rows (NR <= ROW_BLOCK) of xf times OUT_BLOCK weight rows: one accumulator per (row, output), over K in order
template <int NR, typename T>
inline void dot_block(const float* const* xr, const T* const* wr, int64_t K, vf (&out)[ROW_BLOCK][OUT_BLOCK]) {
  const int64_t K16 = K / L * L;
  pv acc[NR][OUT_BLOCK][PARTS] = {};
  int64_t k = 0;
  for (; k < K16; k += L) {
    for (int q = 0; q < PARTS; ++q) {
      pv wv[OUT_BLOCK];
      for (int j = 0; j < OUT_BLOCK; ++j) wv[j] = pload(wr[j] + k + q * P);
      for (int i = 0; i < NR; ++i) {
        const pv xv = pload(xr[i] + k + q * P);
        for (int j = 0; j < OUT_BLOCK; ++j) acc[i][j][q] = xv * wv[j] + acc[i][j][q];
      }
    }
  }
  if (k < K) {
    for (int j = 0; j < OUT_BLOCK; ++j) {
      pv wv[PARTS];
      split(load_tail(wr[j] + k, K - k), wv);
      for (int i = 0; i < NR; ++i)
        for (int q = 0; q < PARTS; ++q) acc[i][j][q] = pload(xr[i] + k + q * P) * wv[q] + acc[i][j][q];  // x: zeros
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < OUT_BLOCK; ++j) out[i][j] = join(acc[i][j]);
}

// x [R, K] (float32, rows padded to Kp = K rounded up to 16, zeros) . w [N, K] (T) -> out [R, N]. Threads take
// blocks of OUT_BLOCK outputs. Rows go in chunks whose float32 copy fits in L2 (ROW_CHUNK_BYTES); within a chunk
// each output block goes over the chunk's rows, ROW_BLOCK at a time, its weight rows staying in L1. The chunking
// only orders the work: every output is still dot_block's sum over K of its own row and weight row.
constexpr int64_t ROW_CHUNK_BYTES = 512 * 1024;
template <typename T, typename O>
void linear_rows(const float* xf, int64_t R, int64_t Kp, const T* w, int64_t N, int64_t K, const float* bias,
                 O* out) {
  const int64_t chunk = std::max<int64_t>(ROW_BLOCK, ROW_CHUNK_BYTES / (Kp * 4) / ROW_BLOCK * ROW_BLOCK);
  at::parallel_for(0, (N + OUT_BLOCK - 1) / OUT_BLOCK, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t c0 = 0; c0 < R; c0 += chunk) {
      const int64_t c1 = std::min<int64_t>(R, c0 + chunk);
      for (int64_t nb = b0; nb < b1; ++nb) {
        const int64_t n0 = nb * OUT_BLOCK, nn = std::min<int64_t>(OUT_BLOCK, N - n0);
        const T* wr[OUT_BLOCK];
        for (int j = 0; j < OUT_BLOCK; ++j) wr[j] = w + (n0 + std::min<int64_t>(j, nn - 1)) * K;
        for (int64_t r0 = c0; r0 < c1; r0 += ROW_BLOCK) {
          const int64_t nr = std::min<int64_t>(ROW_BLOCK, c1 - r0);
          const float* xr[ROW_BLOCK];
          for (int i = 0; i < ROW_BLOCK; ++i) xr[i] = xf + (r0 + std::min<int64_t>(i, nr - 1)) * Kp;
          vf acc[ROW_BLOCK][OUT_BLOCK] = {};
          switch (nr) {
            case 1: dot_block<1>(xr, wr, K, acc); break;
            case 2: dot_block<2>(xr, wr, K, acc); break;
            case 3: dot_block<3 <= ROW_BLOCK ? 3 : 1>(xr, wr, K, acc); break;
            default: dot_block<ROW_BLOCK>(xr, wr, K, acc); break;
          }
          for (int64_t i = 0; i < nr; ++i) {
            for (int64_t j = 0; j < nn; ++j) {
              float s = hsum(acc[i][j]);
              if (bias) s += bias[n0 + j];
              out[(r0 + i) * N + n0 + j] = static_cast<O>(s);
            }
          }
        }
      }
    }
  });
}

inline uint16_t to_bf16(float s) {  // the scalar of narrow()
  uint32_t u;
  std::memcpy(&u, &s, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
struct Bf16Out { uint16_t bits; explicit Bf16Out(float s) : bits(to_bf16(s)) {} Bf16Out() : bits(0) {} };

// Rows widened to float32 once per call, padded to a multiple of 16 (exact).
template <typename T> std::vector<float> widen_rows(const T* x, int64_t R, int64_t K, int64_t Kp) {
  std::vector<float> xf(R * Kp, 0.0f);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t k = 0; k < K; k += L) store_n(&xf[r * Kp + k], load_n(x + r * K + k, K - k), K - k);
  return xf;
}

}  // namespace

// y = x @ w^T + bias: x [R, K] and w [N, K] of one dtype (bf16 or float32), bias [N] float32 or x's dtype. Out in
// x's dtype (bf16: rounded once from the float32 sum plus the bias), or float32 when out_fp32.
torch::Tensor linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, bool out_fp32) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear: x [R, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "linear: x and w of one dtype");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t R = x.size(0), K = x.size(1), N = w.size(0), Kp = (K + L - 1) / L * L;
  torch::Tensor b32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N);
    b32 = bias->to(torch::kFloat).contiguous();
  }
  const float* bp = bias.has_value() ? b32.data_ptr<float>() : nullptr;
  const bool bf16_out = x.scalar_type() == torch::kBFloat16 && !out_fp32;
  auto out = torch::empty({R, N}, x.options().dtype(bf16_out ? torch::kBFloat16 : torch::kFloat));
  if (R == 0) return out;
  by_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    const std::vector<float> xf = widen_rows(cptr<T>(x), R, K, Kp);
    if (bf16_out) linear_rows(xf.data(), R, Kp, cptr<T>(w), N, K, bp, ptr<Bf16Out>(out));
    else linear_rows(xf.data(), R, Kp, cptr<T>(w), N, K, bp, ptr<float>(out));
  });
  return out;
}

// MLP activation: gate_up [R, 2I] (gate | up) -> [R, I] in its dtype: bf16 out = bf16(bf16(silu(gate)) * up) (the
// roundings of `F.silu(gate) * up` in bf16); float32 out = silu(gate) * up. silu(g) = g / (1 + exp(-g)).
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0);
  gate_up = gate_up.contiguous();
  const int64_t R = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({R, I}, gate_up.options());
  by_dtype(gate_up, [&](auto tag) {
    using T = decltype(tag);
    constexpr bool bf16 = std::is_same_v<T, uint16_t>;
    const T* src = cptr<T>(gate_up);
    T* dst = ptr<T>(out);
    at::parallel_for(0, R, std::max<int64_t>(1, 65536 / std::max<int64_t>(I, 1)), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T* g = src + r * 2 * I;
        const T* u = g + I;
        for (int64_t i = 0; i < I; i += L) {
          const vf gv = load_n(g + i, I - i);
          vf silu = gv / (1.0f + vexp(-gv));
          if constexpr (bf16) silu = round_bf16(silu);
          store_n(dst + r * I + i, silu * load_n(u + i, I - i), I - i);
        }
      }
    });
  });
  return out;
}

// RMSNorm of rows: bf16 out = bf16(w * bf16(x * (1 / sqrt(mean(x^2) + eps)))) (the model's torch formula's
// roundings); float32 out = w * (x * inv). Sums in float32: 16 lanes in order, then hsum.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(1));
  x = x.contiguous();
  weight = weight.contiguous();
  const int64_t R = x.size(0), D = x.size(1);
  auto out = torch::empty({R, D}, x.options());
  by_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    constexpr bool bf16 = std::is_same_v<T, uint16_t>;
    const T* src = cptr<T>(x);
    const T* w = cptr<T>(weight);
    T* dst = ptr<T>(out);
    at::parallel_for(0, R, std::max<int64_t>(1, 65536 / std::max<int64_t>(D, 1)), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T* row = src + r * D;
        vf acc{};
        for (int64_t i = 0; i < D; i += L) {
          const vf v = load_n(row + i, D - i);
          acc = v * v + acc;
        }
        const float inv = 1.0f / std::sqrt(hsum(acc) / static_cast<float>(D) + static_cast<float>(eps));
        for (int64_t i = 0; i < D; i += L) {
          vf normed = load_n(row + i, D - i) * inv;
          if constexpr (bf16) normed = round_bf16(normed);
          store_n(dst + r * D + i, load_n(w + i, D - i) * normed, D - i);
        }
      }
    });
  });
  return out;
}

namespace {
// lane i = hsum(acc[i]) for 16 vectors at once, by hsum's own tree for every i (lanes l + l+8, then l + l+4, then
// (0 + 2) + (1 + 3)): a key's score has the bits it has alone, whichever keys share its group of 16
inline vf hsum16(const vf* acc) {
  vf t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)  // t[i] lanes 0-7: the 8 pair sums of acc[2i], lanes 8-15: of acc[2i + 1]
    t[i] = __builtin_shufflevector(acc[2 * i], acc[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(acc[2 * i], acc[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                   30, 31);
  for (int i = 0; i < 4; ++i)  // u[i] lanes 4m..4m+3: b of key 4i + m
    u[i] = __builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(t[2 * i], t[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // w[i] lanes 2m, 2m+1: b0 + b2 and b1 + b3 of key 8i + m
    w[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(u[2 * i], u[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// A (row, head)'s nk scores -> softmax numerators exp(s - max) in place (summed in 16 lanes in key order, then
// hsum); returns 1 / their sum (no keys: 1 / 0, as before). max is exact in any order: 16 lanes, then across them.
inline float softmax_numerators(float* sq, int64_t nk) {
  vf mxv = splat(-INFINITY);
  for (int64_t i = 0; i + L <= nk; i += L) {
    const vf x = load(sq + i);
    mxv = mxv < x ? x : mxv;
  }
  float mx = -INFINITY;
  for (int l = 0; l < L; ++l) mx = std::max(mx, mxv[l]);
  for (int64_t i = nk / L * L; i < nk; ++i) mx = std::max(mx, sq[i]);
  vf sum{};
  for (int64_t i = 0; i < nk; i += L) {
    vf p = vexp(load_n(sq + i, nk - i) - mx);
    if (nk - i < L) for (int64_t l = nk - i; l < L; ++l) p[l] = 0.0f;
    store_n(sq + i, p, nk - i);
    sum += p;
  }
  return 1.0f / hsum(sum);
}

// NH heads' sums of p_i v_i over keys a..e-1 of a chunk, D16C vectors a head: sq the first head's scores (the next
// head's `stride` further), acc the first head's float32 sums (carried from chunk to chunk, the next head's d
// further), vrow(i) key i's V row. Each head's sums are the same chain of multiply-adds in key order as alone.
template <int64_t NH, int64_t D16C, class Rows>
inline void pv_heads(const float* sq, int64_t stride, float* acc_out, int64_t a, int64_t e, Rows vrow) {
  vf acc[NH][D16C];
  for (int64_t g = 0; g < NH; ++g)
    for (int64_t c = 0; c < D16C; ++c) acc[g][c] = load(acc_out + (g * D16C + c) * L);
  for (int64_t i = a; i < e; ++i) {
    const float* row = vrow(i);
    vf v[D16C];
    for (int64_t c = 0; c < D16C; ++c) v[c] = load(row + L * c);
    for (int64_t g = 0; g < NH; ++g) {
      const float pi = sq[g * stride + i];
      for (int64_t c = 0; c < D16C; ++c) acc[g][c] = pi * v[c] + acc[g][c];
    }
  }
  for (int64_t g = 0; g < NH; ++g)
    for (int64_t c = 0; c < D16C; ++c) store_n(acc_out + (g * D16C + c) * L, acc[g][c], L);
}

// One work item of paged_attention_group: sequence s, kv head h, its rows r0..r1 (D16 = head_dim / 16 known at
// compile time for 64 and 128, so the query and the sums stay in registers)
template <typename T, int D16C>
void attention_item(const T* qp, const T* kp, const T* vp, T* op, const int64_t* slot_p, const int64_t* row_p,
                    const bool* hid_p, const bool* real_p, int64_t s, int64_t h, int64_t r0, int64_t r1, int64_t n,
                    int64_t W, int64_t H, int64_t KVH, int64_t G, int64_t d16, int64_t q_stride, float sc) {
  constexpr int64_t CHUNK = 32;  // key positions whose K (then V) rows stay in L1 while every query of the item uses them
  const int64_t D16 = D16C > 0 ? D16C : d16, d = D16 * L, nr = r1 - r0, nq = nr * G;
  const int64_t W16 = (W + L - 1) / L * L;
  // per-thread buffers, grown and kept across calls; the loops below use plain pointers to them (a thread_local
  // read inside a loop of a shared library is a __tls_get_addr call each time)
  static thread_local std::vector<float> qbuf_, scores_, accs_, chunk_, inv_;
  static thread_local std::vector<int64_t> keys_, starts_, at_;
  std::vector<int64_t>& keys = keys_;
  if (static_cast<int64_t>(keys.size()) < nr * W) keys.resize(nr * W);
  std::vector<int64_t>& starts_v = starts_;
  starts_v.assign(nr + 1, 0);
  int64_t* starts = starts_v.data();
  int64_t* listed = keys.data();
  int64_t count = 0;
  for (int64_t ri = 0; ri < nr; ++ri) {  // each row's visible positions, in order (compacted: index i of its keys)
    const bool* hid = hid_p + (s * n + r0 + ri) * W;
    if (real_p[s * n + r0 + ri])
      for (int64_t j = 0; j < W; ++j) {  // written always, kept where visible
        listed[count] = j;
        count += !hid[j];
      }
    starts[ri + 1] = count;
  }
  auto grown = [](std::vector<float>& v, int64_t size) {
    if (static_cast<int64_t>(v.size()) < size) v.resize(size);
    return v.data();
  };
  float* qbuf = grown(qbuf_, nq * d);
  float* scores = grown(scores_, nq * W16);
  float* accs = grown(accs_, nq * d);
  float* chunk = grown(chunk_, CHUNK * d);
  float* inv = grown(inv_, nq);
  std::vector<int64_t>& at_v = at_;
  at_v.assign(nr, 0);
  int64_t* at = at_v.data();
  const int64_t* key = keys.data();
  for (int64_t ri = 0; ri < nr; ++ri)  // the queries, scaled: (row, head) = ri * G + g
    for (int64_t g = 0; g < G; ++g)
      for (int64_t c = 0; c < D16; ++c)
        store_n(&qbuf[(ri * G + g) * d + L * c], load(qp + row_p[s * n + r0 + ri] * q_stride + (h * G + g) * d + L * c) * sc, L);
  // rows of positions p0..p0+CHUNK-1 of K or V: float32 rows straight from the pool; bf16 widened (exact) into `chunk`
  const int64_t* seq_slots = slot_p + s * W;
  const int64_t slot_stride = KVH * d, head_at = h * d;
  auto rows_of = [&](const T* base, int64_t p0, int64_t p1) -> const float* {
    if constexpr (std::is_same_v<T, float>) {
      (void)p1;
      return nullptr;  // read in place (row_at)
    } else {
      // the pointers and strides in locals: the stores below may alias what a lambda's captures point to
      const int64_t* sl = seq_slots;
      const int64_t stride = slot_stride, at0 = head_at, dd = d, nd = D16;
      float* dst = chunk;
      for (int64_t j = p0; j < p1; ++j, dst += dd) {
        const T* src = base + sl[j] * stride + at0;
        for (int64_t c = 0; c < nd; ++c) store_n(dst + L * c, load(src + L * c), L);
      }
      return chunk;
    }
  };
  auto row_at = [&](const T* base, const float* widened, int64_t p0, int64_t j) -> const float* {
    if constexpr (std::is_same_v<T, float>) { (void)widened; (void)p0; return base + (slot_p[s * W + j] * KVH + h) * d; }
    else { (void)base; return widened + (j - p0) * d; }
  };
  // body(ri, a, e, p0, rows): row ri's keys a..e-1 (indices into `keys`) lie in this chunk of positions
  auto each_chunk = [&](const T* base, auto body) {
    for (int64_t ri = 0; ri < nr; ++ri) at[ri] = starts[ri];
    for (int64_t p0 = 0; p0 < W; p0 += CHUNK) {
      const int64_t p1 = std::min<int64_t>(W, p0 + CHUNK);
      bool used = false;
      for (int64_t ri = 0; ri < nr && !used; ++ri) used = at[ri] < starts[ri + 1] && key[at[ri]] < p1;
      if (!used) continue;
      const float* widened = rows_of(base, p0, p1);
      for (int64_t ri = 0; ri < nr; ++ri) {
        const int64_t a = at[ri];
        int64_t e = a;
        while (e < starts[ri + 1] && key[e] < p1) ++e;
        at[ri] = e;
        if (e > a) body(ri, a, e, p0, widened);
      }
    }
  };
  // scores: s_i = hsum over d of (q * scale) * k_i, sixteen keys reduced together (hsum16)
  each_chunk(kp, [&](int64_t ri, int64_t a, int64_t e, int64_t p0, const float* widened) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t qi = ri * G + g;
      vf qv[D16C > 0 ? D16C : 16];
      for (int64_t c = 0; c < D16; ++c) qv[c] = load(&qbuf[qi * d + L * c]);
      float* sq = &scores[qi * W16 - starts[ri]];  // indexed by the row's key index
      for (int64_t i0 = a; i0 < e; i0 += L) {
        const int64_t count = std::min<int64_t>(L, e - i0);
        vf acc[L];
        for (int64_t i = 0; i < L; ++i) {
          acc[i] = vf{};
          if (i >= count) continue;
          const float* krow = row_at(kp, widened, p0, key[i0 + i]);
          for (int64_t c = 0; c < D16; ++c) acc[i] = qv[c] * load(krow + L * c) + acc[i];
        }
        store_n(sq + i0, hsum16(acc), count);
      }
    }
  });
  for (int64_t ri = 0; ri < nr; ++ri) {  // numerators in place; 1 / their sum; the sums of p v from zero
    const int64_t nk = starts[ri + 1] - starts[ri];
    for (int64_t g = 0; g < G; ++g) {
      const int64_t qi = ri * G + g;
      inv[qi] = softmax_numerators(&scores[qi * W16], nk);
      for (int64_t c = 0; c < D16; ++c) store_n(&accs[qi * d + L * c], vf{}, L);
    }
  }
  // sum_i p_i v_i, keys in order (chunk by chunk, each (row, head) carrying its sums across chunks). Where d is
  // known (64, 128) a row's heads go through each key together, up to 16 / D16 at once: each head's sums are its
  // own chain of multiply-adds in key order, as one head alone, but the heads' chains interleave (one head's four
  // chains of 64 lanes waited on their multiply-adds' latency) and each V row is loaded once for them
  each_chunk(vp, [&](int64_t ri, int64_t a, int64_t e, int64_t p0, const float* widened) {
    if constexpr (D16C > 0) {  // 4 heads of d = 64, 2 of d = 128 a block: 16 vectors of sums
      head_blocks<16 / D16C>(G, [&](auto nh, int64_t g) {
        pv_heads<decltype(nh)::value, D16C>(&scores[(ri * G + g) * W16 - starts[ri]], W16, &accs[(ri * G + g) * d],
                                            a, e, [&](int64_t i) { return row_at(vp, widened, p0, key[i]); });
      });
      return;
    }
    for (int64_t g = 0; g < G; ++g) {
      const int64_t qi = ri * G + g;
      const float* sq = &scores[qi * W16 - starts[ri]];
      vf acc[16];
      for (int64_t c = 0; c < D16; ++c) acc[c] = load(&accs[qi * d + L * c]);
      for (int64_t i = a; i < e; ++i) {
        const float* vrow = row_at(vp, widened, p0, key[i]);
        const float pi = sq[i];
        for (int64_t c = 0; c < D16; ++c) acc[c] = pi * load(vrow + L * c) + acc[c];
      }
      for (int64_t c = 0; c < D16; ++c) store_n(&accs[qi * d + L * c], acc[c], L);
    }
  });
  for (int64_t ri = 0; ri < nr; ++ri) {
    if (!real_p[s * n + r0 + ri]) continue;
    const int64_t t = row_p[s * n + r0 + ri];
    for (int64_t g = 0; g < G; ++g) {
      const int64_t qi = ri * G + g;
      T* orow = op + (t * H + h * G + g) * d;
      for (int64_t c = 0; c < D16; ++c) store_n(orow + L * c, load(&accs[qi * d + L * c]) * inv[qi], L);
    }
  }
}

// The avx2 build's work item (the kernel before the chunks; the same bits): one (row, head) at a time over all of
// its keys, the item's keys and values widened to float32 once
template <typename T>
void attention_item_by_row(const T* qp, const T* kp, const T* vp, T* op, const int64_t* slot_p, const int64_t* row_p,
                           const bool* hid_p, const bool* real_p, int64_t s, int64_t h, int64_t r0, int64_t r1,
                           int64_t n, int64_t W, int64_t H, int64_t KVH, int64_t G, int64_t D16, int64_t q_stride,
                           float sc) {
  const int64_t d = D16 * L;
  std::vector<float> kf(W * d), vf_(W * d), scores(W + L);
  std::vector<int64_t> keys;
  keys.reserve(W);
  for (int64_t j = 0; j < W; ++j) {  // exact: to float32
    const int64_t at = (slot_p[s * W + j] * KVH + h) * d;
    for (int64_t c = 0; c < D16; ++c) {
      store_n(&kf[j * d + L * c], load(kp + at + L * c), L);
      store_n(&vf_[j * d + L * c], load(vp + at + L * c), L);
    }
  }
  for (int64_t r = r0; r < r1; ++r) {
    if (!real_p[s * n + r]) continue;
    const bool* hid = hid_p + (s * n + r) * W;
    keys.clear();
    for (int64_t j = 0; j < W; ++j) if (!hid[j]) keys.push_back(j);
    const int64_t nk = static_cast<int64_t>(keys.size());
    const int64_t t = row_p[s * n + r];
    for (int64_t g = 0; g < G; ++g) {
      const T* qrow = qp + t * q_stride + (h * G + g) * d;
      vf qv[256 / L];
      for (int64_t c = 0; c < D16; ++c) qv[c] = load(qrow + L * c) * sc;
      for (int64_t i = 0; i < nk; ++i) {
        const float* krow = &kf[keys[i] * d];
        vf acc{};
        for (int64_t c = 0; c < D16; ++c) acc = qv[c] * load(krow + L * c) + acc;
        scores[i] = hsum(acc);
      }
      const float inv = softmax_numerators(scores.data(), nk);
      vf acc[256 / L] = {};
      for (int64_t i = 0; i < nk; ++i) {
        const float* vrow = &vf_[keys[i] * d];
        const float pi = scores[i];
        for (int64_t c = 0; c < D16; ++c) acc[c] = pi * load(vrow + L * c) + acc[c];
      }
      T* orow = op + (t * H + h * G + g) * d;
      for (int64_t c = 0; c < D16; ++c) store_n(orow + L * c, acc[c] * inv, L);
    }
  }
}
}  // namespace

// Attention of one width group (model_runtime/attention.py's WidthGroup) over the paged KV pool, in q's dtype (bf16
// or float32), float32 inside. q [T, H, d] (heads d apart), k_flat / v_flat [slots, KVH, d] (contiguous), slots
// [seqs, W], rows [seqs, n] (rows of q), hidden [seqs, n, W] (keys a row may not see), real [seqs * n] (false:
// padding, skipped); out [T, H, d] gets the real rows. Per (row, query head), over the row's visible keys j in
// slot order: s_j = (q * scale) . k_j (hsum of a 16-lane accumulator over d), p_j = exp(s_j - max), out =
// (sum_j p_j v_j) / sum_j p_j (the p_j summed in 16 lanes in key order, then hsum). Masked keys are skipped, so a
// row's bits depend only on its own keys: not on the rows, sequences or width around it.
// How it runs (the same bits as one (row, head) at a time, 3-7x faster): a work item is (sequence, kv head, up to 16
// rows); its keys go by in chunks of 32 positions, each chunk's K rows (then V rows) used by every query of the
// item while in L1 (float32 rows read in place, bf16 widened once per chunk), sixteen keys' scores reduced together
// by hsum's own tree (hsum16), and each (row, head) carries its sums of p_j v_j from chunk to chunk in key order
// (a row's heads through each V row together where d is 64 or 128: pv_heads).
// The avx2 build keeps the earlier item, one (row, head) at a time over all its keys (attention_item_by_row): with
// 16 ymm registers the chunked one spilled and ran 0.8-0.9x its speed at 8 rows (1.8x at one row of 2048 keys).
void paged_attention_group(torch::Tensor q, torch::Tensor k_flat, torch::Tensor v_flat, torch::Tensor slots,
                           torch::Tensor rows, torch::Tensor hidden, torch::Tensor real, torch::Tensor out,
                           double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2));
  TORCH_CHECK(k_flat.scalar_type() == q.scalar_type() && v_flat.scalar_type() == q.scalar_type()
              && k_flat.is_contiguous() && v_flat.is_contiguous() && k_flat.sizes() == v_flat.sizes());
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && out.is_contiguous() && out.sizes() == q.sizes());
  TORCH_CHECK(slots.scalar_type() == torch::kLong && rows.scalar_type() == torch::kLong
              && hidden.scalar_type() == torch::kBool && real.scalar_type() == torch::kBool);
  slots = slots.contiguous(); rows = rows.contiguous(); hidden = hidden.contiguous(); real = real.contiguous();
  const int64_t H = q.size(1), d = q.size(2), KVH = k_flat.size(1), G = H / KVH;
  const int64_t seqs = rows.size(0), n = rows.size(1), W = slots.size(1);
  TORCH_CHECK(d % L == 0 && d <= 256 && H % KVH == 0 && k_flat.size(2) == d);
  TORCH_CHECK(hidden.size(0) == seqs && hidden.size(1) == n && hidden.size(2) == W && real.numel() == seqs * n);
  const int64_t D16 = d / L, q_stride = q.stride(0);
  const int64_t* slot_p = slots.data_ptr<int64_t>();
  const int64_t* row_p = rows.data_ptr<int64_t>();
  const bool* hid_p = hidden.data_ptr<bool>();
  const bool* real_p = real.data_ptr<bool>();
  const float sc = static_cast<float>(scale);
  constexpr int64_t ROWS = 16;  // rows per work item: they share their sequence's keys
  const int64_t blocks = (n + ROWS - 1) / ROWS;
  by_dtype(q, [&](auto tag) {
    using T = decltype(tag);
    const T* qp = cptr<T>(q);
    const T* kp = cptr<T>(k_flat);
    const T* vp = cptr<T>(v_flat);
    T* op = ptr<T>(out);
    at::parallel_for(0, seqs * KVH * blocks, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t item = i0; item < i1; ++item) {
        const int64_t b = item % blocks, h = (item / blocks) % KVH, s = item / (blocks * KVH);
        const int64_t r0 = b * ROWS, r1 = std::min<int64_t>(n, r0 + ROWS);
        bool any = false;
        for (int64_t r = r0; r < r1; ++r) any = any || real_p[s * n + r];
        if (!any) continue;
        auto run = [&](auto d16c) {
          attention_item<T, decltype(d16c)::value>(qp, kp, vp, op, slot_p, row_p, hid_p, real_p, s, h, r0, r1, n, W,
                                                   H, KVH, G, D16, q_stride, sc);
        };
#ifdef __AVX512F__
        if (D16 == 8) run(std::integral_constant<int, 8>{});
        else if (D16 == 4) run(std::integral_constant<int, 4>{});
        else run(std::integral_constant<int, 0>{});
#else
        (void)run;
        attention_item_by_row<T>(qp, kp, vp, op, slot_p, row_p, hid_p, real_p, s, h, r0, r1, n, W, H, KVH, G, D16,
                                 q_stride, sc);
#endif
      }
    });
  });
}

// The ISA this build was compiled for (model_runtime/kernel_build.py checks it against the registry's row).
std::string isa() {
#ifdef __AVX512F__
  return "avx512";
#else
  return "avx2";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, py::arg("x"), py::arg("w"), py::arg("bias") = py::none(), py::arg("out_fp32") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, py::call_guard<py::gil_scoped_release>());
  m.def("paged_attention_group", &paged_attention_group, py::call_guard<py::gil_scoped_release>());
  m.def("isa", &isa);
  m.def("ops", [] {  // for the quantized builds' layer loop (q4_layers.cpp): these kernels by address
    static const PortableOps ops{&rms_norm, &silu_mul, &paged_attention_group};
    return py::capsule(static_cast<const void*>(&ops), PORTABLE_OPS);
  });
}
