// The decoder layers' loop of a q4 model (model_runtime/model.py's CausalLM.forward; every linear the GGUF's
// codes, quant_linear.cpp) in C++: layer_loop.h's loop with quant_linear_into for the linears and the portable
// build's RMSNorm, SiLU * up and attention, reached through the PortableOps its module hands over (ATen's for the
// rotary embedding, the bias and the residual adds), so the bits are the Python loop's without its per-operation
// interpreter cost (~0.1 ms a layer: ~9% of a q4 0.5B decode step, ~6% of the 1.5B's; docs/benchmarks.md, "The
// q4 layer loop in C++"). One rank only (no all-reduce between the layers).
#include <torch/extension.h>

#include <vector>

#include "layer_loop.h"
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

}  // namespace

// Q4LayerStack(layers, heads, kv_heads, head_dim, eps, attention_scale, ops): layers per layer (input_norm,
// post_norm, qkv_bias or None, qkv, o, gate_up, down), each linear a list of parts; attention_scale the attention's
// (model_runtime/attention.py: d ** -0.5, as Python rounds it); ops the portable module's `ops()` capsule. Its
// forward takes attention groups of any width.
void bind_q4_layers(py::module& m) {
  py::class_<LayerLoop<Linear>> cls(m, "Q4LayerStack");
  cls.def(py::init([](const py::list& layers, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps,
                      double attention_scale, const py::capsule& ops) {
            return LayerLoop<Linear>(layers_from<Linear>(layers, linear_from),
                                     Heads{heads, kv_heads, head_dim, eps, attention_scale}, ops_from(ops));
          }),
          py::arg("layers"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("eps"),
          py::arg("attention_scale"), py::arg("ops"));
  bind_forward(cls);
}
