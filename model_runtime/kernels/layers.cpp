// The decoder layers' loop (model_runtime/model.py's CausalLM.forward) in C++ for a model whose linears are all
// packed for the AMX kernels, on one rank: the same operations in the same order as the Python loop (our kernels
// for the linears, norms, activation and attention; ATen's for the rotary embedding and the residual adds), so
// the bits are the Python loop's, without its per-operation interpreter cost (~0.3 ms a layer: 17% of an int8
// 0.5B draft step, 10% of a bf16 1.5B decode step, measured here).
#include <torch/extension.h>

#include <array>
#include <vector>

#include "ops.h"

namespace {

// One packed linear (model_runtime/packed_weight.py): bf16 tiles, or int8 tiles with per-output scales.
struct Linear {
  torch::Tensor packed;
  c10::optional<torch::Tensor> scale;  // int8 only
  int64_t n_out;

  torch::Tensor operator()(const torch::Tensor& x, const c10::optional<torch::Tensor>& bias = c10::nullopt) const {
    if (scale.has_value()) return amx_linear_i8(x, packed, *scale, n_out, bias);
    return amx_linear(x, packed, n_out, bias, false);
  }
};

struct Layer {
  torch::Tensor input_norm, post_norm;
  c10::optional<torch::Tensor> qkv_bias;
  Linear qkv, o, gate_up, down;
};

Linear linear_from(const py::tuple& t) {  // (packed, scale or None, n_out)
  c10::optional<torch::Tensor> scale;
  if (!t[1].is_none()) scale = t[1].cast<torch::Tensor>();
  return Linear{t[0].cast<torch::Tensor>(), scale, t[2].cast<int64_t>()};
}

}  // namespace

// Immutable after construction: the model's per-layer weights (shared tensors, no copies) and its head shapes.
class LayerStack {
 public:
  // layers: per layer (input_norm, post_norm, qkv_bias or None, qkv, o, gate_up, down), each linear a tuple
  // (packed, int8 scale or None, n_out)
  // and attention_scale the attention's (model_runtime/attention.py: d ** -0.5, as Python rounds it)
  LayerStack(const py::list& layers, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps,
             double attention_scale)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(attention_scale) {
    for (const auto& item : layers) {
      const py::tuple t = item.cast<py::tuple>();
      TORCH_CHECK(t.size() == 7, "a layer is (input_norm, post_norm, qkv_bias, qkv, o, gate_up, down)");
      c10::optional<torch::Tensor> bias;
      if (!t[2].is_none()) bias = t[2].cast<torch::Tensor>();
      layers_.push_back(Layer{t[0].cast<torch::Tensor>(), t[1].cast<torch::Tensor>(), bias,
                              linear_from(t[3].cast<py::tuple>()), linear_from(t[4].cast<py::tuple>()),
                              linear_from(t[5].cast<py::tuple>()), linear_from(t[6].cast<py::tuple>())});
    }
  }

  // h [T, hidden] bf16 (the embeddings); cos / sin [T, d] (rope_cos_sin); slot_mapping [T] long; k_caches /
  // v_caches one [blocks, block_size, kv_heads, d] tensor per layer; groups: every WidthGroup of the forward as
  // (slots, rows, hidden, real), each within the attention kernel's width. Returns h after the last layer.
  torch::Tensor forward(torch::Tensor h, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& slot_mapping, const std::vector<torch::Tensor>& k_caches,
                        const std::vector<torch::Tensor>& v_caches, const std::vector<py::tuple>& groups) const {
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size());
    std::vector<std::array<torch::Tensor, 4>> plan;
    for (const auto& g : groups) {
      plan.push_back({g[0].cast<torch::Tensor>(), g[1].cast<torch::Tensor>(), g[2].cast<torch::Tensor>(),
                      g[3].cast<torch::Tensor>()});
    }
    py::gil_scoped_release no_gil;  // the other Python threads (the engine's) run meanwhile
    const int64_t T = h.size(0), d = head_dim_, hq = heads_, hkv = kv_heads_;
    const auto cos3 = cos.unsqueeze(1), sin3 = sin.unsqueeze(1);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& lw = layers_[i];
      // attention: as CausalLM._attention
      auto x = rms_norm(h, lw.input_norm, eps_);
      auto parts = lw.qkv(x, lw.qkv_bias).split_with_sizes({(hq + hkv) * d, hkv * d}, -1);
      auto qk = parts[0].reshape({T, hq + hkv, d});
      auto roped = qk * cos3 + qk.roll(d / 2, -1) * sin3;  // model.apply_rope
      auto qkr = roped.split_with_sizes({hq, hkv}, 1);
      auto v = parts[1].view({T, hkv, d});
      auto k_flat = k_caches[i].view({-1, hkv, d}), v_flat = v_caches[i].view({-1, hkv, d});
      k_flat.index_copy_(0, slot_mapping, qkr[1]);
      v_flat.index_copy_(0, slot_mapping, v);
      auto out = torch::empty({T, hq, d}, h.options());
      for (const auto& g : plan) paged_attention_group(qkr[0], k_flat, v_flat, g[0], g[1], g[2], g[3], out, scale_);
      h = h + lw.o(out.view({T, hq * d}));
      // MLP
      x = rms_norm(h, lw.post_norm, eps_);
      h = h + lw.down(silu_mul(lw.gate_up(x)));
    }
    return h;
  }

 private:
  std::vector<Layer> layers_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
};

void bind_layers(py::module& m) {
  py::class_<LayerStack>(m, "LayerStack")
      .def(py::init<const py::list&, int64_t, int64_t, int64_t, double, double>(), py::arg("layers"), py::arg("heads"),
           py::arg("kv_heads"), py::arg("head_dim"), py::arg("eps"), py::arg("attention_scale"))
      .def("forward", &LayerStack::forward, py::arg("h"), py::arg("cos"), py::arg("sin"), py::arg("slot_mapping"),
           py::arg("k_caches"), py::arg("v_caches"), py::arg("groups"));
}
