// Linear layers on Intel AMX (the amx path of model_runtime/kernel_registry.py): bfloat16, batch-invariant by
// construction (the target), and int8 weights x int8 activations quantized per row (the draft: only its speed
// matters).
//
// y[r, n] = sum_k x[r, k] * W[n, k] (+ bias[n]), x and W in bfloat16, accumulated in float32 tiles.
// W is packed once at load (model_runtime/packed_weight.py) into AMX's B-operand layout:
//   wp[nb, kb, i, 2 * j + p] = W[16 * nb + j, 32 * kb + 2 * i + p]    (16 x 32 bf16 = one 1 KB tile)
// so each block of 16 outputs streams from memory as one contiguous run. Up to 16 rows go through as one
// tile of exactly those rows, 4 output blocks at a time; 17..32 rows as tiles of 16 and R - 16 rows x 2
// output blocks; more rows zero-padded to 16-row blocks, one after another. Each output element accumulates
// its 32-wide k-blocks in order into one tile element, whatever rows share the tile or the call: a row's bits
// do not depend on how many rows are in the product, and one row costs what 16 cost (the weights are
// streamed once either way).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <initializer_list>

#include "amx_tiles.h"
#include "ops.h"
#include "simd.h"


namespace {
constexpr int PREFETCH_TILES = 4;

void configure(int ac_rows = 16, int ac_tiles = 0) {
  // tiles [0, ac_tiles) (accumulators and activations) hold `ac_rows` rows; the rest (weights) 16
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) { cfg.rows[t] = t < ac_tiles ? ac_rows : 16; cfg.colsb[t] = 64; }
  load_config(cfg);
}

void configure_rows(std::initializer_list<int> rows) {  // rows of tiles 0..7 in turn (64 bytes each)
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  int t = 0;
  for (int r : rows) { cfg.rows[t] = static_cast<uint8_t>(r); cfg.colsb[t] = 64; ++t; }
  load_config(cfg);
}

// 16 bias values from outputs n0.. (bf16 or fp32; masked), widened to fp32 exactly
__m512 load_bias(const torch::Tensor& bias, int64_t n0, __mmask16 mask) {
  if (!bias.defined()) return _mm512_setzero_ps();
  if (bias.scalar_type() == torch::kFloat32) return _mm512_maskz_loadu_ps(mask, bias.data_ptr<float>() + n0);
  return widen_bf16(reinterpret_cast<const uint16_t*>(bias.data_ptr()) + n0, mask);
}

// software prefetch of the weight tile PREFETCH_TILES ahead of tile kb on a stream of 1 KB tiles: +15-20% GB/s
// measured here (a prefetch past the end of the buffer is harmless: it never faults)
inline void prefetch_tile(const char* stream, int64_t kb) {
  const char* p = stream + (kb + PREFETCH_TILES) * 1024;
  for (int l = 0; l < 1024; l += 64) _mm_prefetch(p + l, _MM_HINT_T0);
}

// Passes over `passes` units of work, claimed from a shared counter by every thread (a thread the shared machine
// slows takes fewer), each thread claiming its next pass one ahead: body(q, next) with next = passes at the end.
// `setup` runs once per thread before its passes (tile configuration); tiles are released after.
template <typename Setup, typename Body>
void claimed_passes(int64_t passes, Setup setup, Body body) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    setup();
    int64_t q = next.fetch_add(1);
    while (q < passes) {
      const int64_t qn = std::min<int64_t>(next.fetch_add(1), passes);
      body(q, qn);
      q = qn;
    }
    _tile_release();
  });
}

// few_rows' four products C j += A 4 x B (5, 6, 7, 5) (the intrinsics take tile numbers as literals)
struct DotBF16 {
  static void d0() { _tile_dpbf16ps(0, 4, 5); }
  static void d1() { _tile_dpbf16ps(1, 4, 6); }
  static void d2() { _tile_dpbf16ps(2, 4, 7); }
  static void d3() { _tile_dpbf16ps(3, 4, 5); }
  static void m0() { _tile_dpbf16ps(0, 2, 3); }
  static void m1() { _tile_dpbf16ps(1, 2, 4); }
};
struct DotI8 {
  static void d0() { _tile_dpbssd(0, 4, 5); }
  static void d1() { _tile_dpbssd(1, 4, 6); }
  static void d2() { _tile_dpbssd(2, 4, 7); }
  static void d3() { _tile_dpbssd(3, 4, 5); }
  static void m0() { _tile_dpbssd(0, 2, 3); }
  static void m1() { _tile_dpbssd(1, 2, 4); }
};

// Up to 16 rows (decode, a verify, a draft step): one A tile of the R rows, 4 output blocks a pass (4
// independent accumulation chains; tiles C 0-3, A 4, B 5-7), passes claimed one ahead so that a pass's last
// iterations prefetch the next pass's first tiles. Weights: NB blocks of KB 1 KB tiles each; x: R rows of 64-byte
// k-blocks, a_stride bytes apart. emit(c, nb) writes accumulator tile c (R rows) of output block nb.
template <typename Dot, typename Acc, typename Emit>
void few_rows(const char* x, int64_t a_stride, const char* w, int64_t NB, int64_t KB, int64_t R, Emit emit) {
  const int64_t stream = KB * 1024;
  claimed_passes((NB + 3) / 4, [&] { configure(static_cast<int>(R), 5); }, [&](int64_t q, int64_t qn) {
    alignas(64) Acc c[4][16][16];
    const int64_t nb0 = 4 * q, count = std::min<int64_t>(4, NB - nb0);  // 4, or 2 at the end
    const char* b0 = w + nb0 * stream;
    const char* b1 = b0 + stream;
    const char* b2 = b1 + stream;
    const char* b3 = b2 + stream;
    const char* n0 = w + 4 * qn * stream;  // the next pass's streams run on from these
    const int64_t ncount = std::max<int64_t>(0, std::min<int64_t>(4, NB - 4 * qn));
    auto prefetch_pass = [&](int64_t kb, int64_t streams) {
      if (kb + PREFETCH_TILES < KB) {
        prefetch_tile(b0, kb); prefetch_tile(b1, kb);
        if (streams == 4) { prefetch_tile(b2, kb); prefetch_tile(b3, kb); }
      } else {
        for (int64_t j = 0; j < ncount; ++j) prefetch_tile(n0 + j * stream, kb - KB);
      }
    };
    if (count == 4) {
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int64_t kb = 0; kb < KB; ++kb) {
        prefetch_pass(kb, 4);
        _tile_loadd(4, x + kb * 64, a_stride);
        _tile_loadd(5, b0 + kb * 1024, 64);
        _tile_loadd(6, b1 + kb * 1024, 64);
        _tile_loadd(7, b2 + kb * 1024, 64);
        Dot::d0();
        Dot::d1();
        Dot::d2();
        _tile_loadd(5, b3 + kb * 1024, 64);
        Dot::d3();
      }
      _tile_stored(2, c[2], 64);
      _tile_stored(3, c[3], 64);
    } else {
      _tile_zero(0); _tile_zero(1);
      for (int64_t kb = 0; kb < KB; ++kb) {
        prefetch_pass(kb, 2);
        _tile_loadd(4, x + kb * 64, a_stride);
        _tile_loadd(5, b0 + kb * 1024, 64);
        _tile_loadd(6, b1 + kb * 1024, 64);
        Dot::d0();
        Dot::d1();
      }
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    for (int64_t j = 0; j < count; ++j) emit(c[j], nb0 + j);
  });
}

// More rows (large batches, prefill): x zero-padded to Mp (a multiple of 16) rows; for each pair of output blocks
// (passes claimed from a shared counter), row blocks one after another, the pair's weights re-read from L2
// (measured faster above 32 rows than passes over pairs of row blocks). Tiles: C 0-1, A 2, B 3-4.
// emit(c, m0, nb) writes accumulator tile c (rows m0..) of output block nb.
template <typename Dot, typename Acc, typename Emit>
void many_rows(const char* x, int64_t a_stride, const char* w, int64_t NB, int64_t KB, int64_t Mp, Emit emit) {
  const int64_t stream = KB * 1024;
  claimed_passes(NB / 2, [] { configure(); }, [&](int64_t p, int64_t) {
    alignas(64) Acc c[2][16][16];
    const char* b0 = w + 2 * p * stream;
    const char* b1 = b0 + stream;
    for (int64_t m0 = 0; m0 < Mp; m0 += 16) {
      const char* a = x + m0 * a_stride;
      _tile_zero(0); _tile_zero(1);
      for (int64_t kb = 0; kb < KB; ++kb) {
        prefetch_tile(b0, kb); prefetch_tile(b1, kb);
        _tile_loadd(2, a + kb * 64, a_stride);
        _tile_loadd(3, b0 + kb * 1024, 64);
        _tile_loadd(4, b1 + kb * 1024, 64);
        Dot::m0();
        Dot::m1();
      }
      _tile_stored(0, c[0], 64);
      _tile_stored(1, c[1], 64);
      emit(c[0], m0, 2 * p);
      emit(c[1], m0, 2 * p + 1);
    }
  });
}
}  // namespace

// x [R, K] bf16; wp [NB, KB, 16, 32] bf16 (NB even); returns [R, n_out] in bf16 or fp32.
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor wp, int64_t n_out, c10::optional<torch::Tensor> bias, bool out_fp32) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && wp.scalar_type() == torch::kBFloat16);
  const int64_t R = x.size(0), K = x.size(1), NBk = wp.size(0), KB = wp.size(1);
  // rows: up to 16 in one tile of R rows, up to 32 in tiles of 16 and R - 16 rows; padded to a multiple of 16 above
  const int64_t Kp = KB * 32, Mp = R <= 16 ? 16 : R <= 32 ? 32 : (R + 15) / 16 * 16;
  TORCH_CHECK(K <= Kp && Kp - K < 32 && NBk % 2 == 0 && n_out <= NBk * 16);
  if (R == 0) return torch::empty({0, n_out}, x.options().dtype(out_fp32 ? torch::kFloat32 : torch::kBFloat16));
  const int64_t Mx = Mp <= 32 ? R : Mp;  // rows of x the tiles read (tiles of R rows up to 32)
  torch::Tensor xpad;
  if (Mx == R && Kp == K && x.is_contiguous()) xpad = x;
  else { xpad = torch::zeros({Mx, Kp}, x.options()); xpad.narrow(0, 0, R).narrow(1, 0, K).copy_(x); }
  auto out = torch::empty({R, n_out}, x.options().dtype(out_fp32 ? torch::kFloat32 : torch::kBFloat16));
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->scalar_type() == torch::kBFloat16 ? bias->contiguous() : bias->to(torch::kFloat32).contiguous();
    TORCH_CHECK(b.numel() >= n_out);
  }
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xpad.data_ptr());
  const uint16_t* wpp = reinterpret_cast<const uint16_t*>(wp.data_ptr());
  float* of = out_fp32 ? out.data_ptr<float>() : nullptr;
  uint16_t* ob = out_fp32 ? nullptr : reinterpret_cast<uint16_t*>(out.data_ptr());
  // write one accumulator tile: rows m0.., outputs 16 * nb..
  // (vectorised: 16 outputs a row at once; bf16 rounding by vcvtneps2bf16, round to nearest even)
  auto emit = [&](const float (*c)[16], int64_t m0, int64_t nb) {
    const int64_t rows = std::min<int64_t>(16, R - m0), cols = std::min<int64_t>(16, n_out - nb * 16);
    if (rows <= 0 || cols <= 0) return;
    const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
    const __m512 bias_v = load_bias(b, nb * 16, mask);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 v = _mm512_add_ps(_mm512_load_ps(c[r]), bias_v);
      const int64_t at = (m0 + r) * n_out + nb * 16;
      if (of) _mm512_mask_storeu_ps(of + at, mask, v);
      else _mm256_mask_storeu_epi16(ob + at, mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
    }
  };
  const char* xb = reinterpret_cast<const char*>(xp);
  const char* wb = reinterpret_cast<const char*>(wpp);
  const int64_t stream = KB * 1024;  // bytes of one output block's tiles
  if (Mp == 16) {
    few_rows<DotBF16, float>(xb, Kp * 2, wb, NBk, KB, R, [&](const float (*c)[16], int64_t nb) { emit(c, 0, nb); });
  } else if (Mp == 32) {
    // 17..32 rows (a batch's verify): 2 row blocks (16 and R - 16 rows) x 2 output blocks per pass, so the
    // weights of a pass are read from memory once for all rows (tiles: C 0-1 rows 0..15, C 2-3 rows 16..,
    // A 4 and 5, B 6-7); passes claimed and prefetched as in the <= 16-row path
    const int tail = static_cast<int>(R - 16);
    const char* a0 = xb;
    const char* a1 = a0 + 16 * Kp * 2;
    claimed_passes(NBk / 2, [&] { configure_rows({16, 16, tail, tail, 16, tail, 16, 16}); }, [&](int64_t p, int64_t pn) {
      alignas(64) float c[4][16][16];
      const char* b0 = wb + 2 * p * stream;
      const char* b1 = b0 + stream;
      const char* n0 = wb + 2 * pn * stream;
      const bool more = pn < NBk / 2;
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int64_t kb = 0; kb < KB; ++kb) {
        if (kb + PREFETCH_TILES < KB) { prefetch_tile(b0, kb); prefetch_tile(b1, kb); }
        else if (more) { prefetch_tile(n0, kb - KB); prefetch_tile(n0 + stream, kb - KB); }
        _tile_loadd(4, a0 + kb * 64, Kp * 2);
        _tile_loadd(5, a1 + kb * 64, Kp * 2);
        _tile_loadd(6, b0 + kb * 1024, 64);
        _tile_loadd(7, b1 + kb * 1024, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, c[0], 64);
      _tile_stored(1, c[1], 64);
      _tile_stored(2, c[2], 64);
      _tile_stored(3, c[3], 64);
      emit(c[0], 0, 2 * p);
      emit(c[1], 0, 2 * p + 1);
      emit(c[2], 16, 2 * p);
      emit(c[3], 16, 2 * p + 1);
    });
  } else {
    // more rows (large batches, prefill)
    many_rows<DotBF16, float>(xb, Kp * 2, wb, NBk, KB, Mp, emit);
  }
  return out;
}

// int8: wq[nb, kb, i, 4 * j + p] = Wq[16 * nb + j, 64 * kb + 4 * i + p] (one 1 KB tile of 16 x 64 int8), with
// W ~ Wq * wscale[n] (per output, symmetric). Each row of x is quantized to int8 with its own scale
// max|x| / 127 (round to nearest even); y = (int32 dot) * xscale[r] * wscale[n] + bias[n], in bfloat16.
torch::Tensor amx_linear_i8(torch::Tensor x, torch::Tensor wq, torch::Tensor wscale, int64_t n_out,
                            c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && wq.scalar_type() == torch::kInt8
              && wscale.scalar_type() == torch::kFloat32);
  x = x.contiguous();
  const int64_t R = x.size(0), K = x.size(1), NBk = wq.size(0), KB = wq.size(1);
  const int64_t Kp = KB * 64, Mp = (R + 15) / 16 * 16;
  TORCH_CHECK(K <= Kp && Kp - K < 64 && NBk % 2 == 0 && n_out <= NBk * 16 && wscale.numel() >= n_out);
  if (R == 0) return torch::empty({0, n_out}, x.options());
  const bool small = R <= 16;  // one tile of R rows, 4 output blocks a pass (as amx_linear's decode path)
  auto xq = torch::zeros({small ? R : Mp, Kp}, x.options().dtype(torch::kInt8));
  auto xs = torch::empty({std::max<int64_t>(R, 1)}, x.options().dtype(torch::kFloat32));
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr());
  int8_t* xqp = xq.data_ptr<int8_t>();
  float* xsp = xs.data_ptr<float>();
  // per row: amax, then round-to-nearest-even of x / scale (vectorised, 16 at a time; the tail masked)
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* row = xb + r * K;
      __m512 vmax = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 16) {
        vmax = _mm512_max_ps(vmax, _mm512_abs_ps(widen_bf16(row + k, tail_mask(K - k))));
      }
      const float amax = _mm512_reduce_max_ps(vmax);
      const float scale = amax > 0.f ? amax / 127.f : 1.f, inv = 1.f / scale;
      xsp[r] = scale;
      const __m512 inv_v = _mm512_set1_ps(inv);
      for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 m = tail_mask(K - k);
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(widen_bf16(row + k, m), inv_v));  // MXCSR: nearest even
        _mm_mask_storeu_epi8(xqp + r * Kp + k, m, _mm512_cvtsepi32_epi8(q));
      }
    }
  });
  auto out = torch::empty({R, n_out}, x.options());
  torch::Tensor b32;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) { b32 = bias->to(torch::kFloat32).contiguous(); bp = b32.data_ptr<float>(); }
  const int8_t* wp = wq.data_ptr<int8_t>();
  const float* ws = wscale.data_ptr<float>();
  uint16_t* ob = reinterpret_cast<uint16_t*>(out.data_ptr());
  // y = (int32 dot) * xscale[r] * wscale[n] + bias[n] for one accumulator tile (rows m0.., outputs 16 * nb..)
  auto emit = [&](const int32_t (*c)[16], int64_t m0, int64_t nb) {
    const int64_t rows = std::min<int64_t>(16, R - m0), nbase = nb * 16, cols = std::min<int64_t>(16, n_out - nbase);
    if (rows <= 0 || cols <= 0) return;
    const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
    const __m512 ws_v = _mm512_maskz_loadu_ps(mask, ws + nbase);
    const __m512 bias_v = bp ? _mm512_maskz_loadu_ps(mask, bp + nbase) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(c[r]));
      const __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(dot, _mm512_set1_ps(xsp[m0 + r])), ws_v), bias_v);
      _mm256_mask_storeu_epi16(ob + (m0 + r) * n_out + nbase, mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
    }
  };
  const char* wb = reinterpret_cast<const char*>(wp);
  if (small) {  // a draft's decode step: amx_linear's few-rows path on int8 tiles
    few_rows<DotI8, int32_t>(reinterpret_cast<const char*>(xqp), Kp, wb, NBk, KB, R,
                             [&](const int32_t (*c)[16], int64_t nb) { emit(c, 0, nb); });
    return out;
  }
  many_rows<DotI8, int32_t>(reinterpret_cast<const char*>(xqp), Kp, wb, NBk, KB, Mp, emit);
  return out;
}


PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_layers(m);
  m.def("amx_enable", &amx_enable);
  m.def("amx_linear", &amx_linear, py::arg("x"), py::arg("wp"), py::arg("n_out"), py::arg("bias") = py::none(), py::arg("out_fp32") = false);
  m.def("amx_linear_i8", &amx_linear_i8, py::arg("x"), py::arg("wq"), py::arg("wscale"), py::arg("n_out"),
        py::arg("bias") = py::none());
  m.def("isa", [] { return std::string("amx"); });  // model_runtime/kernel_build.py checks it
}
