// The kernels' entry points, one declaration each for the sources that call across files (amx_linear.cpp binds
// them all; layers.cpp loops over them). model_runtime/amx_kernel.py hashes the headers into the build flags.
#pragma once
#include <torch/extension.h>

// amx_linear.cpp
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor wp, int64_t n_out, c10::optional<torch::Tensor> bias,
                         bool out_fp32);
torch::Tensor amx_linear_i8(torch::Tensor x, torch::Tensor wq, torch::Tensor wscale, int64_t n_out,
                            c10::optional<torch::Tensor> bias);
// row_ops.cpp
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
void paged_attention_group(torch::Tensor q, torch::Tensor k_flat, torch::Tensor v_flat, torch::Tensor slots,
                           torch::Tensor rows, torch::Tensor hidden, torch::Tensor real, torch::Tensor out,
                           double scale);
// layers.cpp: the decoder layers' loop over these kernels (the LayerStack class)
void bind_layers(py::module& m);
