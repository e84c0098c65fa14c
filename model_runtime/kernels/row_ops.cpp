// Row-wise bf16 ops beside the linears (model_runtime/model.py, model_runtime/attention.py): each row's result is
// computed by the same instructions whether it is alone in the call or among others (batch invariance).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <algorithm>
#include <vector>

#include "simd.h"

// MLP activation: gate_up [R, 2I] bf16 (gate | up) -> [R, I] bf16, out = bf16(bf16(silu(gate)) * up): the
// roundings of `F.silu(gate) * up` in bf16, in one pass (silu(g) = g / (1 + exp(-g)) in float32)
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == torch::kBFloat16 && gate_up.size(1) % 2 == 0);
  gate_up = gate_up.contiguous();
  const int64_t R = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({R, I}, gate_up.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(gate_up.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(I, 1));  // rows per task: ~64K elements
  at::parallel_for(0, R, grain, [&](int64_t r0, int64_t r1) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* g = src + r * 2 * I;
      const uint16_t* u = g + I;
      for (int64_t i = 0; i < I; i += 16) {
        const __mmask16 m = tail_mask(I - i);
        const __m512 gv = widen_bf16(g + i, m);
        const __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
        const __m512 silu_b = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(silu));  // F.silu's bf16 result
        store_bf16(dst + r * I + i, m, _mm512_mul_ps(silu_b, widen_bf16(u + i, m)));
      }
    }
  });
  return out;
}

// RMSNorm of bf16 rows: out = bf16(w * bf16(x * (1 / sqrt(mean(x^2) + eps)))), sums in float32 (16 lanes in
// order, then the lanes added); the roundings of the model's torch formula (model_runtime/model.py)
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && weight.scalar_type() == torch::kBFloat16);
  x = x.contiguous();
  weight = weight.contiguous();
  const int64_t R = x.size(0), D = x.size(1);
  TORCH_CHECK(weight.numel() == D);
  auto out = torch::empty({R, D}, x.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* w = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(D, 1));
  at::parallel_for(0, R, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* row = src + r * D;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t i = 0; i < D; i += 16) {
        const __m512 v = widen_bf16(row + i, tail_mask(D - i));
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, acc);
      float sum = 0.f;
      for (int l = 0; l < 16; ++l) sum += lanes[l];
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(D) + static_cast<float>(eps));
      const __m512 inv_v = _mm512_set1_ps(inv);
      for (int64_t i = 0; i < D; i += 16) {
        const __mmask16 m = tail_mask(D - i);
        const __m512 normed = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(_mm512_mul_ps(widen_bf16(row + i, m), inv_v)));
        store_bf16(dst + r * D + i, m, _mm512_mul_ps(widen_bf16(w + i, m), normed));
      }
    }
  });
  return out;
}


// Attention of one width group (model_runtime/attention.py's WidthGroup) over the paged KV pool, bf16 in and out,
// float32 inside. q [T, H, d] (rows of the forward; heads d apart), k_flat / v_flat [slots, KVH, d] (contiguous),
// slots [seqs, W] (each sequence's key slots), rows [seqs, n] (rows of q), hidden [seqs, n, W] (keys a row may not
// see), real [seqs * n] (false: a padding entry, skipped); out [T, H, d] gets the real rows.
// Per (row, query head): s_j = (q * scale) . k_j over the row's visible keys j in slot order, p_j = exp(s_j - max),
// out = (sum_j p_j v_j) / sum_j p_j. Each (row, head) runs the same instructions over the same keys whatever else
// is in the call (no blocking across rows), so a row's bits do not depend on how many rows share the call.
void paged_attention_group(torch::Tensor q, torch::Tensor k_flat, torch::Tensor v_flat, torch::Tensor slots,
                           torch::Tensor rows, torch::Tensor hidden, torch::Tensor real, torch::Tensor out, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kBFloat16 && q.stride(2) == 1 && q.stride(1) == q.size(2));
  TORCH_CHECK(k_flat.scalar_type() == torch::kBFloat16 && v_flat.scalar_type() == torch::kBFloat16
              && k_flat.is_contiguous() && v_flat.is_contiguous() && k_flat.sizes() == v_flat.sizes());
  TORCH_CHECK(out.scalar_type() == torch::kBFloat16 && out.is_contiguous() && out.sizes() == q.sizes());
  TORCH_CHECK(slots.scalar_type() == torch::kLong && rows.scalar_type() == torch::kLong
              && hidden.scalar_type() == torch::kBool && real.scalar_type() == torch::kBool);
  slots = slots.contiguous(); rows = rows.contiguous(); hidden = hidden.contiguous(); real = real.contiguous();
  const int64_t H = q.size(1), d = q.size(2), KVH = k_flat.size(1), G = H / KVH;
  const int64_t seqs = rows.size(0), n = rows.size(1), W = slots.size(1);
  TORCH_CHECK(d % 16 == 0 && d <= 256 && H % KVH == 0 && k_flat.size(2) == d);
  TORCH_CHECK(hidden.size(0) == seqs && hidden.size(1) == n && hidden.size(2) == W && real.numel() == seqs * n);
  const int64_t D16 = d / 16, q_stride = q.stride(0);
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(k_flat.data_ptr());
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(v_flat.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t* slot_p = slots.data_ptr<int64_t>();
  const int64_t* row_p = rows.data_ptr<int64_t>();
  const bool* hid_p = hidden.data_ptr<bool>();
  const bool* real_p = real.data_ptr<bool>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, seqs * n * KVH, 1, [&](int64_t i0, int64_t i1) {
    std::vector<int64_t> keys;
    std::vector<float> scores;
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t entry = item / KVH, h = item % KVH, s = entry / n;  // entry = s * n + r
      if (!real_p[entry]) continue;
      const int64_t t = row_p[entry];
      const bool* hid = hid_p + entry * W;
      keys.clear();
      for (int64_t j = 0; j < W; ++j) if (!hid[j]) keys.push_back(slot_p[s * W + j]);
      const int64_t nk = static_cast<int64_t>(keys.size());
      const int64_t nk16 = (nk + 15) / 16 * 16;
      scores.assign(G * nk16, -INFINITY);
      __m512 qv[16 * 8];  // up to 8 query heads of the group x d / 16 lanes, scaled, in float32
      for (int64_t g0 = 0; g0 < G; g0 += 8) {
        const int64_t gn = std::min<int64_t>(8, G - g0);
        for (int64_t g = 0; g < gn; ++g) {
          const uint16_t* qrow = qp + t * q_stride + (h * G + g0 + g) * d;
          for (int64_t c = 0; c < D16; ++c) qv[g * 16 + c] = _mm512_mul_ps(widen_bf16(qrow + 16 * c, 0xffff), _mm512_set1_ps(sc));
        }
        for (int64_t j = 0; j < nk; ++j) {
          const uint16_t* krow = kp + (keys[j] * KVH + h) * d;
          for (int64_t g = 0; g < gn; ++g) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t c = 0; c < D16; ++c) acc = _mm512_fmadd_ps(qv[g * 16 + c], widen_bf16(krow + 16 * c, 0xffff), acc);
            scores[(g0 + g) * nk16 + j] = _mm512_reduce_add_ps(acc);
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * nk16;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < nk16; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sg + j));
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < nk16; j += 16) {
          const __mmask16 live = tail_mask(nk - j);
          const __m512 p = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(_mm512_loadu_ps(sg + j), m)));
          _mm512_storeu_ps(sg + j, p);
          sum = _mm512_add_ps(sum, p);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
        __m512 acc[16];
        for (int64_t c = 0; c < D16; ++c) acc[c] = _mm512_setzero_ps();
        for (int64_t j = 0; j < nk; ++j) {
          const uint16_t* vrow = vp + (keys[j] * KVH + h) * d;
          const __m512 pj = _mm512_set1_ps(sg[j]);
          for (int64_t c = 0; c < D16; ++c) acc[c] = _mm512_fmadd_ps(pj, widen_bf16(vrow + 16 * c, 0xffff), acc[c]);
        }
        uint16_t* orow = op + (t * H + h * G + g) * d;
        for (int64_t c = 0; c < D16; ++c) store_bf16(orow + 16 * c, 0xffff, _mm512_mul_ps(acc[c], inv));
      }
    }
  });
}
