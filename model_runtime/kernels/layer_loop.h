// The decoder layers' loop that both C++ stacks run (layers.cpp in the AMX build, q4_layers.cpp in the quantized
// builds): model_runtime/model.py's CausalLM.forward and _attention, operation for operation in the same order, so
// either stack gives the Python loop's bits. What differs between them is the linear (Linear: a callable
// `(x, optional bias) -> out`); the norms, activation and attention are the portable build's, by address
// (PortableOps). Both builds hash this header into their flags.
#pragma once
#include <torch/extension.h>

#include <array>
#include <utility>
#include <vector>

#include "portable_ops.h"

template <class Linear>
struct DecoderLayer {
  torch::Tensor input_norm, post_norm;
  c10::optional<torch::Tensor> qkv_bias;
  Linear qkv, o, gate_up, down;
};

struct Heads {
  int64_t heads, kv_heads, head_dim;
  double eps, scale;  // RMSNorm's eps; the attention's scale (d ** -0.5, as Python rounds it)
};

using AttentionPlan = std::vector<std::array<torch::Tensor, 4>>;  // per WidthGroup: (slots, rows, hidden, real)

// groups: every WidthGroup of the forward as (slots, rows, hidden, real); read while the GIL is held
inline AttentionPlan attention_plan(const std::vector<py::tuple>& groups) {
  AttentionPlan plan;
  for (const auto& g : groups) {
    plan.push_back({g[0].cast<torch::Tensor>(), g[1].cast<torch::Tensor>(), g[2].cast<torch::Tensor>(),
                    g[3].cast<torch::Tensor>()});
  }
  return plan;
}

// layers: per layer (input_norm, post_norm, qkv_bias or None, qkv, o, gate_up, down), each linear as `make` reads it
template <class Linear, class Make>
std::vector<DecoderLayer<Linear>> layers_from(const py::list& layers, Make make) {
  std::vector<DecoderLayer<Linear>> out;
  for (const auto& item : layers) {
    const py::tuple t = item.cast<py::tuple>();
    TORCH_CHECK(t.size() == 7, "a layer is (input_norm, post_norm, qkv_bias, qkv, o, gate_up, down)");
    c10::optional<torch::Tensor> bias;
    if (!t[2].is_none()) bias = t[2].cast<torch::Tensor>();
    out.push_back(DecoderLayer<Linear>{t[0].cast<torch::Tensor>(), t[1].cast<torch::Tensor>(), bias, make(t[3]),
                                       make(t[4]), make(t[5]), make(t[6])});
  }
  return out;
}

// h [T, hidden] (the embeddings); cos / sin [T, d] (rope_cos_sin); slot_mapping [T] long; k_caches / v_caches one
// [blocks, block_size, kv_heads, d] tensor per layer. Returns h after the last layer. Call without the GIL.
template <class Linear>
torch::Tensor run_layers(const std::vector<DecoderLayer<Linear>>& layers, const PortableOps& ops, const Heads& shape,
                         torch::Tensor h, const torch::Tensor& cos, const torch::Tensor& sin,
                         const torch::Tensor& slot_mapping, const std::vector<torch::Tensor>& k_caches,
                         const std::vector<torch::Tensor>& v_caches, const AttentionPlan& plan) {
  TORCH_CHECK(k_caches.size() == layers.size() && v_caches.size() == layers.size());
  const int64_t T = h.size(0), d = shape.head_dim, hq = shape.heads, hkv = shape.kv_heads;
  const auto cos3 = cos.unsqueeze(1), sin3 = sin.unsqueeze(1);
  for (size_t i = 0; i < layers.size(); ++i) {
    const DecoderLayer<Linear>& lw = layers[i];
    // attention: as CausalLM._attention
    auto x = ops.rms_norm(h, lw.input_norm, shape.eps);
    auto parts = lw.qkv(x, lw.qkv_bias).split_with_sizes({(hq + hkv) * d, hkv * d}, -1);
    auto qk = parts[0].reshape({T, hq + hkv, d});
    auto roped = qk * cos3 + qk.roll(d / 2, -1) * sin3;  // model.apply_rope
    auto qkr = roped.split_with_sizes({hq, hkv}, 1);
    auto v = parts[1].view({T, hkv, d});
    auto k_flat = k_caches[i].view({-1, hkv, d}), v_flat = v_caches[i].view({-1, hkv, d});
    k_flat.index_copy_(0, slot_mapping, qkr[1]);
    v_flat.index_copy_(0, slot_mapping, v);
    auto out = torch::empty({T, hq, d}, h.options());
    for (const auto& g : plan) ops.paged_attention_group(qkr[0], k_flat, v_flat, g[0], g[1], g[2], g[3], out, shape.scale);
    h = h + lw.o(out.view({T, hq * d}));
    // MLP
    x = ops.rms_norm(h, lw.post_norm, shape.eps);
    h = h + lw.down(ops.silu_mul(lw.gate_up(x)));
  }
  return h;
}

// A model's layers and what runs them; immutable after construction (shared weight tensors, no copies). Each build
// binds its own (layers.cpp: LayerStack, q4_layers.cpp: Q4LayerStack).
template <class Linear>
class LayerLoop {
 public:
  LayerLoop(std::vector<DecoderLayer<Linear>> layers, Heads shape, PortableOps ops)
      : layers_(std::move(layers)), shape_(shape), ops_(ops) {}

  // run_layers; groups: every WidthGroup of the forward as (slots, rows, hidden, real)
  torch::Tensor forward(torch::Tensor h, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& slot_mapping, const std::vector<torch::Tensor>& k_caches,
                        const std::vector<torch::Tensor>& v_caches, const std::vector<py::tuple>& groups) const {
    const AttentionPlan plan = attention_plan(groups);
    py::gil_scoped_release no_gil;  // the other Python threads (the engine's) run meanwhile
    return run_layers(layers_, ops_, shape_, h, cos, sin, slot_mapping, k_caches, v_caches, plan);
  }

 private:
  std::vector<DecoderLayer<Linear>> layers_;
  Heads shape_;
  PortableOps ops_;
};

// py::class_<LayerLoop<Linear>>'s forward, with its argument names
template <class Linear>
void bind_forward(py::class_<LayerLoop<Linear>>& cls) {
  cls.def("forward", &LayerLoop<Linear>::forward, py::arg("h"), py::arg("cos"), py::arg("sin"),
          py::arg("slot_mapping"), py::arg("k_caches"), py::arg("v_caches"), py::arg("groups"));
}
