// The AMX build's entry points that another of its sources calls (amx_linear.cpp binds them; layers.cpp loops over
// them). model_runtime/kernel_registry.py hashes the headers into the build flags.
#pragma once
#include <torch/extension.h>

// amx_linear.cpp
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor wp, int64_t n_out, c10::optional<torch::Tensor> bias,
                         bool out_fp32);
torch::Tensor amx_linear_i8(torch::Tensor x, torch::Tensor wq, torch::Tensor wscale, int64_t n_out,
                            c10::optional<torch::Tensor> bias);
// layers.cpp: the decoder layers' loop over these linears and the portable build's row ops (the LayerStack class)
void bind_layers(py::module& m);
