// The portable kernels (portable.cpp) that another build calls by address: the quantized builds' layer loop
// (q4_layers.cpp) runs a q4 model's norms, activation and attention on them. portable.cpp hands them over as one
// PyCapsule named PORTABLE_OPS (its module's `ops()`); model_runtime/kernel_build.py hashes this header into both
// builds, so the two always agree on it. The AMX build fills one with its own row ops (ops.h: the same signatures)
// for its layer loop (layers.cpp); layer_loop.h runs either.
#pragma once
#include <torch/extension.h>

struct PortableOps {
  torch::Tensor (*rms_norm)(torch::Tensor x, torch::Tensor weight, double eps);
  torch::Tensor (*silu_mul)(torch::Tensor gate_up);
  void (*paged_attention_group)(torch::Tensor q, torch::Tensor k_flat, torch::Tensor v_flat, torch::Tensor slots,
                                torch::Tensor rows, torch::Tensor hidden, torch::Tensor real, torch::Tensor out,
                                double scale);
};

constexpr const char* PORTABLE_OPS = "specserve.portable_ops";
