// Across the quantized builds' two sources: quant_linear.cpp's linear for q4_layers.cpp's loop, and the loop's
// bindings for quant_linear.cpp's module. model_runtime/kernel_registry.py hashes this header into the builds.
#pragma once
#include <torch/extension.h>

// x [M, K] float32 -> out[:, col : col + n_out] (float32, written in place)
void quant_linear_into(torch::Tensor x, torch::Tensor w, int64_t n_out, int64_t bits, int64_t sb, int64_t b,
                       torch::Tensor out, int64_t col);
// q4_layers.cpp: the Q4LayerStack class
void bind_q4_layers(py::module& m);
