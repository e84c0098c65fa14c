// The decoder layers' loop of a q4 model (model_runtime/model.py's CausalLM.forward; every linear the GGUF's
// codes, quant_linear.cpp) in C++: the same operations in the same order as the Python loop, on the same kernels
// (quant_linear_into for the linears; the portable build's RMSNorm, SiLU * up and attention, reached through the
// PortableOps its module hands over; ATen's for the rotary embedding, the bias and the residual adds), so the bits
// are the Python loop's without its per-operation interpreter cost (~0.1 ms a layer: ~9% of a q4 0.5B decode step,
// ~6% of the 1.5B's; docs/benchmarks.md, "The q4 layer loop in C++"). One rank only (no all-reduce between the layers).
#include <torch/extension.h>

#include <array>
#include <vector>

#include "portable_ops.h"
#include "quant_ops.h"

namespace {

struct Part {  // one part of a linear along its outputs (model_runtime/quant_weights.py's Part)
  torch::Tensor packed;
  int64_t n, bits, superblock, block;
};

// QuantLinear.__call__: x as contiguous float32, each part's outputs written in place, then the bias added
struct Linear {
  std::vector<Part> parts;
  int64_t n_out;

  torch::Tensor operator()(const torch::Tensor& x, const c10::optional<torch::Tensor>& bias = c10::nullopt) const {
    const auto xf = x.to(torch::kFloat).contiguous();
    auto out = torch::empty({xf.size(0), n_out}, xf.options());
    int64_t col = 0;
    for (const Part& p : parts) {
      quant_linear_into(xf, p.packed, p.n, p.bits, p.superblock, p.block, out, col);
      col += p.n;
    }
    return bias.has_value() ? out + *bias : out;
  }
};

struct Layer {
  torch::Tensor input_norm, post_norm;
  c10::optional<torch::Tensor> qkv_bias;
  Linear qkv, o, gate_up, down;
};

Linear linear_from(const py::handle& parts) {  // [(packed, n, bits, superblock, block), ...]
  Linear lin{{}, 0};
  for (const auto& item : parts.cast<py::list>()) {
    const py::tuple t = item.cast<py::tuple>();
    TORCH_CHECK(t.size() == 5, "a part is (packed, n, bits, superblock, block)");
    lin.parts.push_back(Part{t[0].cast<torch::Tensor>(), t[1].cast<int64_t>(), t[2].cast<int64_t>(),
                             t[3].cast<int64_t>(), t[4].cast<int64_t>()});
    lin.n_out += lin.parts.back().n;
  }
  TORCH_CHECK(!lin.parts.empty(), "a linear has at least one part");
  return lin;
}

// Immutable after construction: the model's per-layer weights (shared tensors, no copies), its head shapes and the
// portable kernels it runs around the linears.
class Q4LayerStack {
 public:
  // layers: per layer (input_norm, post_norm, qkv_bias or None, qkv, o, gate_up, down), each linear a list of parts;
  // attention_scale the attention's (model_runtime/attention.py: d ** -0.5, as Python rounds it); ops: the
  // portable module's `ops()` capsule
  Q4LayerStack(const py::list& layers, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps,
               double attention_scale, const py::capsule& ops)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(attention_scale) {
    TORCH_CHECK(ops.name() != nullptr && std::string(ops.name()) == PORTABLE_OPS, "ops: the portable module's ops()");
    ops_ = *static_cast<const PortableOps*>(ops.get_pointer());
    for (const auto& item : layers) {
      const py::tuple t = item.cast<py::tuple>();
      TORCH_CHECK(t.size() == 7, "a layer is (input_norm, post_norm, qkv_bias, qkv, o, gate_up, down)");
      c10::optional<torch::Tensor> bias;
      if (!t[2].is_none()) bias = t[2].cast<torch::Tensor>();
      layers_.push_back(Layer{t[0].cast<torch::Tensor>(), t[1].cast<torch::Tensor>(), bias, linear_from(t[3]),
                              linear_from(t[4]), linear_from(t[5]), linear_from(t[6])});
    }
  }

  // h [T, hidden] float32 (the embeddings); cos / sin [T, d] (rope_cos_sin); slot_mapping [T] long; k_caches /
  // v_caches one [blocks, block_size, kv_heads, d] tensor per layer; groups: every WidthGroup of the forward as
  // (slots, rows, hidden, real). Returns h after the last layer.
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
      auto x = ops_.rms_norm(h, lw.input_norm, eps_);
      auto parts = lw.qkv(x, lw.qkv_bias).split_with_sizes({(hq + hkv) * d, hkv * d}, -1);
      auto qk = parts[0].reshape({T, hq + hkv, d});
      auto roped = qk * cos3 + qk.roll(d / 2, -1) * sin3;  // model.apply_rope
      auto qkr = roped.split_with_sizes({hq, hkv}, 1);
      auto v = parts[1].view({T, hkv, d});
      auto k_flat = k_caches[i].view({-1, hkv, d}), v_flat = v_caches[i].view({-1, hkv, d});
      k_flat.index_copy_(0, slot_mapping, qkr[1]);
      v_flat.index_copy_(0, slot_mapping, v);
      auto out = torch::empty({T, hq, d}, h.options());
      for (const auto& g : plan) ops_.paged_attention_group(qkr[0], k_flat, v_flat, g[0], g[1], g[2], g[3], out, scale_);
      h = h + lw.o(out.view({T, hq * d}));
      // MLP
      x = ops_.rms_norm(h, lw.post_norm, eps_);
      h = h + lw.down(ops_.silu_mul(lw.gate_up(x)));
    }
    return h;
  }

 private:
  std::vector<Layer> layers_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
  PortableOps ops_{};
};

}  // namespace

void bind_q4_layers(py::module& m) {
  py::class_<Q4LayerStack>(m, "Q4LayerStack")
      .def(py::init<const py::list&, int64_t, int64_t, int64_t, double, double, const py::capsule&>(),
           py::arg("layers"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("eps"),
           py::arg("attention_scale"), py::arg("ops"))
      .def("forward", &Q4LayerStack::forward, py::arg("h"), py::arg("cos"), py::arg("sin"), py::arg("slot_mapping"),
           py::arg("k_caches"), py::arg("v_caches"), py::arg("groups"));
}
