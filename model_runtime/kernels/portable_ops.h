// The portable kernels (portable.cpp) that another build calls by address: the quantized builds' layer loop
// (q4_layers.cpp) and the AMX build's (layers.cpp) run a model's norms, activation and attention on them.
// portable.cpp hands them over as one PyCapsule named PORTABLE_OPS (its module's `ops()`), which the loops' builds
// read back with ops_from; model_runtime/kernel_registry.py hashes this header into every build that includes it,
// so they always agree on it. One source per op: these kernels are the only RMSNorm, SiLU * up and attention.
#pragma once
#include <torch/extension.h>

#include <string>

struct PortableOps {
  torch::Tensor (*rms_norm)(torch::Tensor x, torch::Tensor weight, double eps);
  torch::Tensor (*silu_mul)(torch::Tensor gate_up);
  void (*paged_attention_group)(torch::Tensor q, torch::Tensor k_flat, torch::Tensor v_flat, torch::Tensor slots,
                                torch::Tensor rows, torch::Tensor hidden, torch::Tensor real, torch::Tensor out,
                                double scale);
};

constexpr const char* PORTABLE_OPS = "specserve.portable_ops";

// The PortableOps of a capsule made by the portable module's `ops()` (checked by its name)
inline const PortableOps& ops_from(const py::capsule& ops) {
  TORCH_CHECK(ops.name() != nullptr && std::string(ops.name()) == PORTABLE_OPS, "ops: the portable module's ops()");
  return *static_cast<const PortableOps*>(ops.get_pointer());
}
