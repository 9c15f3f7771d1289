// The kernels' entry points, for the Python bindings (bindings.cpp) and for C++ callers of several of
// them in one call (decode_step.cpp). Torch's light headers only (tensor.h): see there why.
#pragma once

#include "tensor.h"

#include <vector>

at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                           at::Tensor block_tables, at::Tensor context_lens, double scale, int64_t kv_format);
void kv_write_q8(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
                 at::Tensor slots, bool fp8);
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps);
at::Tensor add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor w, double eps);
at::Tensor silu_mul(at::Tensor gu);
void rope_(at::Tensor qkv, int64_t heads, int64_t D, at::Tensor positions, at::Tensor cos,
           at::Tensor sin_signed);
at::Tensor to_bf16(at::Tensor x);
std::vector<at::Tensor> quantize_rows_u8(at::Tensor x);
void scale_rows_(at::Tensor y, at::Tensor scales);
std::vector<at::Tensor> e4m3_rows_bf16(at::Tensor x);
at::Tensor scale_rows_cols(at::Tensor y, at::Tensor rs, at::Tensor cs, at::ScalarType out_dtype);
at::Tensor sample_rows(at::Tensor logits, at::Tensor temps, at::Tensor u);
at::Tensor argmax_rows(at::Tensor logits);
void lora_delta_(at::Tensor y, at::Tensor x, at::Tensor a, std::vector<at::Tensor> bs, std::vector<int64_t> lo,
                 at::Tensor segments, at::Tensor active);
void prefill_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor out,
                       at::Tensor starts, at::Tensor lens, double scale);
void prefill_attention_cached(at::Tensor q, at::Tensor out, at::Tensor k_cache, at::Tensor v_cache,
                              at::Tensor starts, at::Tensor lens, at::Tensor past,
                              at::Tensor block_tables, double scale, int64_t kv_format);
at::Tensor panel_pack(at::Tensor weight, int64_t group);
at::Tensor panel_matmul(at::Tensor x, at::Tensor panels, int64_t n, int64_t vector_rows);
bool panel_dot_available();
at::Tensor q4_matmul(at::Tensor x, at::Tensor panels, int64_t n, int64_t exact_rows);
at::Tensor g8_matmul(at::Tensor x, at::Tensor panels, int64_t n, int64_t wide_rows);
at::Tensor q8_matmul(at::Tensor x, at::Tensor panels, at::Tensor scales, int64_t n);
at::Tensor panel_matmul_dot(at::Tensor x, at::Tensor panels, int64_t n);
at::Tensor panel_matmul_wide(at::Tensor x, at::Tensor panels, int64_t n);
bool panel_wide_fast();
at::Tensor q4_matmul_wide(at::Tensor x, at::Tensor packed, int64_t n);
bool q4_wide_available();
at::Tensor g8_matmul_wide(at::Tensor x, at::Tensor packed, int64_t n);
bool g8_wide_available();
at::Tensor f8_matmul(at::Tensor x, at::Tensor x_scales, at::Tensor panels, at::Tensor w_scales,
                        int64_t n);
at::Tensor i8_matmul(at::Tensor xq, at::Tensor x_scales, at::Tensor panels, at::Tensor offsets,
                        at::Tensor w_scales, int64_t n);
