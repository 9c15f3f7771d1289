// The kernels' entry points, for the Python bindings (bindings.cpp) and for C++ callers of several of
// them in one call (decode_step.cpp).
#pragma once

#include <torch/extension.h>

#include <vector>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale, int64_t kv_format);
void kv_write_q8(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                 torch::Tensor slots, bool fp8);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps);
torch::Tensor silu_mul(torch::Tensor gu);
void rope_(torch::Tensor qkv, int64_t heads, int64_t D, torch::Tensor positions, torch::Tensor cos,
           torch::Tensor sin_signed);
torch::Tensor to_bf16(torch::Tensor x);
std::vector<torch::Tensor> quantize_rows_u8(torch::Tensor x);
void scale_rows_(torch::Tensor y, torch::Tensor scales);
std::vector<torch::Tensor> e4m3_rows_bf16(torch::Tensor x);
torch::Tensor scale_rows_cols(torch::Tensor y, torch::Tensor rs, torch::Tensor cs, at::ScalarType out_dtype);
torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor temps, torch::Tensor u);
torch::Tensor argmax_rows(torch::Tensor logits);
void prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out,
                       torch::Tensor starts, torch::Tensor lens, double scale);
void prefill_attention_cached(torch::Tensor q, torch::Tensor out, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor starts, torch::Tensor lens, torch::Tensor past,
                              torch::Tensor block_tables, double scale, int64_t kv_format);
torch::Tensor panel_pack(torch::Tensor weight, int64_t group);
torch::Tensor panel_matmul(torch::Tensor x, torch::Tensor panels, int64_t n, int64_t vector_rows);
bool panel_dot_available();
torch::Tensor q4_matmul(torch::Tensor x, torch::Tensor panels, int64_t n, int64_t exact_rows);
torch::Tensor g8_matmul(torch::Tensor x, torch::Tensor panels, int64_t n, int64_t wide_rows);
torch::Tensor q8_matmul(torch::Tensor x, torch::Tensor panels, torch::Tensor scales, int64_t n);
torch::Tensor panel_matmul_dot(torch::Tensor x, torch::Tensor panels, int64_t n);
torch::Tensor f8_matmul(torch::Tensor x, torch::Tensor x_scales, torch::Tensor panels, torch::Tensor w_scales,
                        int64_t n);
torch::Tensor i8_matmul(torch::Tensor xq, torch::Tensor x_scales, torch::Tensor panels, torch::Tensor offsets,
                        torch::Tensor w_scales, int64_t n);
void register_decode_layers(pybind11::module_& m);
