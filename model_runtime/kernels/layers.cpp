// The decoder layers' loop (model_runtime/model.py's CausalLM.forward) in C++ for a model whose linears are all
// packed for the AMX kernels, on one rank: layer_loop.h's loop on the AMX linears and the portable build's RMSNorm,
// SiLU * up and attention (reached through the PortableOps its module hands over, as q4_layers.cpp's loop does), and
// ATen's for the rotary embedding and the residual adds, so the bits
// are the Python loop's, without its per-operation interpreter cost (~0.3 ms a layer: 17% of an int8 0.5B draft
// step, 10% of a bf16 1.5B decode step, measured here).
#include <torch/extension.h>

#include <vector>

#include "layer_loop.h"
#include "ops.h"
#include "portable_ops.h"

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

Linear linear_from(const py::handle& item) {  // (packed, scale or None, n_out)
  const py::tuple t = item.cast<py::tuple>();
  c10::optional<torch::Tensor> scale;
  if (!t[1].is_none()) scale = t[1].cast<torch::Tensor>();
  return Linear{t[0].cast<torch::Tensor>(), scale, t[2].cast<int64_t>()};
}

}  // namespace

// LayerStack(layers, heads, kv_heads, head_dim, eps, attention_scale, ops): layers per layer (input_norm, post_norm,
// qkv_bias or None, qkv, o, gate_up, down), each linear a tuple (packed, int8 scale or None, n_out); attention_scale
// the attention's (model_runtime/attention.py: d ** -0.5, as Python rounds it); ops the portable module's `ops()`
// capsule. Its forward takes attention groups of any width.
void bind_layers(py::module& m) {
  py::class_<LayerLoop<Linear>> cls(m, "LayerStack");
  cls.def(py::init([](const py::list& layers, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps,
                      double attention_scale, const py::capsule& ops) {
            return LayerLoop<Linear>(layers_from<Linear>(layers, linear_from),
                                     Heads{heads, kv_heads, head_dim, eps, attention_scale}, ops_from(ops));
          }),
          py::arg("layers"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("eps"),
          py::arg("attention_scale"), py::arg("ops"));
  bind_forward(cls);
}
