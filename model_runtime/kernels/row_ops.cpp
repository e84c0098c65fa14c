// Row-wise bf16 ops beside the linears (model_runtime/model.py, model_runtime/attention.py): each row's result is
// computed by the same instructions whether it is alone in the call or among others (batch invariance).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <algorithm>
#include <vector>

#include "head_blocks.h"
#include "ops.h"
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


namespace {
// lane i of the result = the sum of acc[i]'s 16 lanes, by the same tree for every i (pairs within 128-bit chunks,
// then chunks), so a key's score does not depend on which keys share its block
inline __m512 sum_lanes16(const __m512* acc) {
  __m512 t[8], u[4], x[2];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * i], acc[2 * i + 1]), _mm512_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
// NH heads' sums of p_i v_i over keys a..e-1 (indices into `keys`), D16C vectors a head: sg the first head's scores
// (indexed by key index; the next head's `stride` further), ab the first head's float32 sums (the next head's d
// further), vf the widened V rows. Each head's sums are the same chain of multiply-adds in key order as alone; the
// heads' chains interleave, and each V row is loaded once for them.
template <int64_t NH, int64_t D16C>
inline void pv_heads(const float* sg, int64_t stride, float* ab, int64_t a, int64_t e, const int64_t* keys,
                     const float* vf) {
  constexpr int64_t d = 16 * D16C;
  __m512 acc[NH][D16C];
  for (int64_t g = 0; g < NH; ++g)
    for (int64_t c = 0; c < D16C; ++c) acc[g][c] = _mm512_loadu_ps(ab + g * d + 16 * c);
  for (int64_t i = a; i < e; ++i) {
    const float* vrow = vf + keys[i] * d;
    __m512 v[D16C];
    for (int64_t c = 0; c < D16C; ++c) v[c] = _mm512_loadu_ps(vrow + 16 * c);
    for (int64_t g = 0; g < NH; ++g) {
      const __m512 pi = _mm512_set1_ps(sg[g * stride + i]);
      for (int64_t c = 0; c < D16C; ++c) acc[g][c] = _mm512_fmadd_ps(pi, v[c], acc[g][c]);
    }
  }
  for (int64_t g = 0; g < NH; ++g)
    for (int64_t c = 0; c < D16C; ++c) _mm512_storeu_ps(ab + g * d + 16 * c, acc[g][c]);
}

}  // namespace

// Attention of one width group (model_runtime/attention.py's WidthGroup) over the paged KV pool, bf16 in and out,
// float32 inside. q [T, H, d] (rows of the forward; heads d apart), k_flat / v_flat [slots, KVH, d] (contiguous),
// slots [seqs, W] (each sequence's key slots), rows [seqs, n] (rows of q), hidden [seqs, n, W] (keys a row may not
// see), real [seqs * n] (false: a padding entry, skipped); out [T, H, d] gets the real rows.
// Per (row, query head): s_j = (q * scale) . k_j over the row's visible keys j in slot order, p_j = exp(s_j - max),
// out = (sum_j p_j v_j) / sum_j p_j. Rows are taken in blocks that share their keys and values widened to float32
// once (exact), and each (row, head) then runs the same instructions over its own keys whatever else is in the
// call, so a row's bits do not depend on how many rows share the call.
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
  // work items: (sequence, kv head, block of up to ROWS rows); a block widens its sequence's W keys and values
  // of that head to float32 once (shared by its rows' query heads), then each (row, head) runs on its own
  const int64_t ROWS = 16, blocks = (n + ROWS - 1) / ROWS;
  at::parallel_for(0, seqs * KVH * blocks, 1, [&](int64_t i0, int64_t i1) {
    // per-thread buffers, grown and kept across calls (no allocation or zeroing per call)
    static thread_local std::vector<float> kf, vf, scores, accs;
    static thread_local std::vector<int64_t> keys, starts;  // each row's visible positions (of the W), concatenated
    if (static_cast<int64_t>(kf.size()) < W * d) { kf.resize(W * d); vf.resize(W * d); }
    const int64_t W16 = (W + 15) / 16 * 16;
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t b = item % blocks, h = (item / blocks) % KVH, s = item / (blocks * KVH);
      const int64_t r0 = b * ROWS, r1 = std::min<int64_t>(n, r0 + ROWS), nr = r1 - r0;
      bool any = false;
      for (int64_t r = r0; r < r1; ++r) any = any || real_p[s * n + r];
      if (!any) continue;
      for (int64_t j = 0; j < W; ++j) {  // exact: bf16 -> float32
        const int64_t at = (slot_p[s * W + j] * KVH + h) * d;
        for (int64_t c = 0; c < D16; ++c) {
          _mm512_storeu_ps(&kf[j * d + 16 * c], widen_bf16(kp + at + 16 * c, 0xffff));
          _mm512_storeu_ps(&vf[j * d + 16 * c], widen_bf16(vp + at + 16 * c, 0xffff));
        }
      }
      keys.clear();
      starts.assign(nr + 1, 0);
      for (int64_t ri = 0; ri < nr; ++ri) {
        const bool* hid = hid_p + (s * n + r0 + ri) * W;
        if (real_p[s * n + r0 + ri]) for (int64_t j = 0; j < W; ++j) if (!hid[j]) keys.push_back(j);
        starts[ri + 1] = static_cast<int64_t>(keys.size());
      }
      const int64_t nq = nr * G;  // query vectors: (row, head)
      if (static_cast<int64_t>(scores.size()) < nq * W16) scores.resize(nq * W16);
      if (static_cast<int64_t>(accs.size()) < nq * d) accs.resize(nq * d);
      std::fill(scores.begin(), scores.begin() + nq * W16, -INFINITY);
      std::fill(accs.begin(), accs.begin() + nq * d, 0.0f);
      // keys in chunks of CHUNK positions (their float32 K and V stay in L1 across the block's queries); a row's
      // scores and sums still go over its own keys in order, each score and sum computed alone
      constexpr int64_t CHUNK = 32;
      std::vector<int64_t> at(nr);  // per row: first of its keys not yet visited
      // body(ri, a, e): row ri's keys a..e-1 (indices into `keys`), chunk by chunk of positions, rows in turn
      auto each_chunk = [&](auto body) {
        for (int64_t ri = 0; ri < nr; ++ri) at[ri] = starts[ri];
        for (int64_t p0 = 0; p0 < W; p0 += CHUNK) {
          for (int64_t ri = 0; ri < nr; ++ri) {
            const int64_t a = at[ri];
            int64_t e = a;
            while (e < starts[ri + 1] && keys[e] < p0 + CHUNK) ++e;
            at[ri] = e;
            if (e > a) body(ri, a, e);
          }
        }
      };
      each_chunk([&](int64_t ri, int64_t a, int64_t e) {
        const int64_t t = row_p[s * n + r0 + ri];
        for (int64_t g = 0; g < G; ++g) {
          const uint16_t* qrow = qp + t * q_stride + (h * G + g) * d;
          __m512 qv[16];  // the query head, scaled, in float32
          for (int64_t c = 0; c < D16; ++c) qv[c] = _mm512_mul_ps(widen_bf16(qrow + 16 * c, 0xffff), _mm512_set1_ps(sc));
          float* sg = scores.data() + (ri * G + g) * W16 - starts[ri];  // indexed by the row's key index
          for (int64_t i0 = a; i0 < e; i0 += 16) {  // up to 16 keys' dot products, reduced together
            const int64_t count = std::min<int64_t>(16, e - i0);
            __m512 acc[16];
            for (int64_t i = 0; i < 16; ++i) {
              acc[i] = _mm512_setzero_ps();
              if (i >= count) continue;
              const float* krow = &kf[keys[i0 + i] * d];
              for (int64_t c = 0; c < D16; ++c) acc[i] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(krow + 16 * c), acc[i]);
            }
            _mm512_mask_storeu_ps(sg + i0, tail_mask(count), sum_lanes16(acc));
          }
        }
      });
      std::vector<float> inv(nq);
      for (int64_t ri = 0; ri < nr; ++ri) {  // softmax numerators in place, and 1 / their sum
        const int64_t nk = starts[ri + 1] - starts[ri], nk16 = (nk + 15) / 16 * 16;
        if (nk == 0) continue;
        for (int64_t g = 0; g < G; ++g) {
          float* sg = scores.data() + (ri * G + g) * W16;
          __m512 mx = _mm512_set1_ps(-INFINITY);
          for (int64_t i = 0; i < nk16; i += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sg + i));
          const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
          __m512 sum = _mm512_setzero_ps();
          for (int64_t i = 0; i < nk16; i += 16) {
            const __mmask16 live = tail_mask(nk - i);
            const __m512 p = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(_mm512_loadu_ps(sg + i), m)));
            _mm512_storeu_ps(sg + i, p);
            sum = _mm512_add_ps(sum, p);
          }
          inv[ri * G + g] = 1.0f / _mm512_reduce_add_ps(sum);
        }
      }
      each_chunk([&](int64_t ri, int64_t a, int64_t e) {  // sum_i p_i v_i, keys in order, the sums kept in float32
        auto heads = [&](auto d16) {  // 4 heads of d = 64, 2 of d = 128 a block: 16 vectors of sums
          constexpr int64_t D16C = decltype(d16)::value;
          head_blocks<16 / D16C>(G, [&](auto nh, int64_t g) {
            pv_heads<decltype(nh)::value, D16C>(scores.data() + (ri * G + g) * W16 - starts[ri], W16,
                                                accs.data() + (ri * G + g) * d, a, e, keys.data(), vf.data());
          });
        };
        if (D16 == 4) return heads(std::integral_constant<int64_t, 4>{});
        if (D16 == 8) return heads(std::integral_constant<int64_t, 8>{});
        for (int64_t g = 0; g < G; ++g) {
          const float* sg = scores.data() + (ri * G + g) * W16 - starts[ri];
          float* ab = &accs[(ri * G + g) * d];
          __m512 acc[16];
          for (int64_t c = 0; c < D16; ++c) acc[c] = _mm512_loadu_ps(ab + 16 * c);
          for (int64_t i = a; i < e; ++i) {
            const float* vrow = &vf[keys[i] * d];
            const __m512 pi = _mm512_set1_ps(sg[i]);
            for (int64_t c = 0; c < D16; ++c) acc[c] = _mm512_fmadd_ps(pi, _mm512_loadu_ps(vrow + 16 * c), acc[c]);
          }
          for (int64_t c = 0; c < D16; ++c) _mm512_storeu_ps(ab + 16 * c, acc[c]);
        }
      });
      for (int64_t ri = 0; ri < nr; ++ri) {
        if (!real_p[s * n + r0 + ri]) continue;
        const int64_t t = row_p[s * n + r0 + ri];
        for (int64_t g = 0; g < G; ++g) {
          const float* ab = &accs[(ri * G + g) * d];
          uint16_t* orow = op + (t * H + h * G + g) * d;
          const __m512 iv = _mm512_set1_ps(inv[ri * G + g]);
          for (int64_t c = 0; c < D16; ++c) store_bf16(orow + 16 * c, 0xffff, _mm512_mul_ps(_mm512_loadu_ps(ab + 16 * c), iv));
        }
      }
    }
  });
}
