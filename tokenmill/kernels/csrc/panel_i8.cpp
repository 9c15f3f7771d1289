// int8 x int8 matmuls of `quantization="int8"` (W8A8: weights per output column, activations per row,
// quantized as the step runs) for steps of any number of rows (256 a sweep of the weights), on AVX512-VNNI:
// y[M, N] = (sum_k q_x[m, k] q_w[n, k]) * x_scale[m] * w_scale[n], rounded once to bfloat16.
//
// The codes are in 32-column panels with four k side by side ([N/32][K/4][32][4], panel_pack with group
// 4), the layout of vpdpbusd, which multiplies four unsigned bytes of x by four signed bytes of a column
// and adds the four products to the column's 32-bit sum: 64 multiply-adds an instruction, twice
// vdpbf16ps's. x comes as quantize_rows_u8 leaves it (q + 128, unsigned); the 128 x the column's code sum
// is taken off at the end, so the int32 sums are the exact integer products whatever the order, and every
// row's result is the same in any batch. A thread's panels are one stream with the software prefetch into
// L2 of the bf16 panel matmul (panels::panel_prefetch); up to 8 rows a pass (16 accumulators).
//
// Why: oneDNN's u8 x s8 matmul on AMD Zen 4 (avx512_core_vnni) took longer at one row than the bf16 dot
// loops over twice the bytes (docs/history/benchmarks.md, eleventh sitting); measured there only, so models/ops.py
// uses it only on CPUs without AMX.
#include "tensor.h"
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "panels.h"

namespace {

using panels::kCols;

constexpr int64_t kQuadRow = kCols * 4;  // one k quad across a panel: 128 bytes, two cache lines

#if defined(TM_AVX512_BF16)
// One pass over a panel for M <= 8 rows, each row's sums in two accumulators (columns 0-15, 16-31), then
// the integer products scaled into c. Inlined and unrolled for the reason panels::dot_pass is: as a call
// of its own GCC kept the accumulators on the stack.
template <int M>
__attribute__((always_inline)) inline void i8_pass(const uint8_t* x, int64_t xs, const float* x_scale,
                                                   const int8_t* wp, int64_t quads, const int32_t* offset,
                                                   const float* w_scale, float* c, panels::PassPrefetch& ahead) {
  __m512i acc[M][2];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_si512();
  for (int64_t kq = 0; kq < quads; ++kq) {
    ahead.step();
    const __m512i v0 = _mm512_loadu_si512(wp + kq * kQuadRow);
    const __m512i v1 = _mm512_loadu_si512(wp + kq * kQuadRow + 64);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      int32_t quad;  // the row's four codes, grouped as the panel groups k
      std::memcpy(&quad, x + m * xs + 4 * kq, sizeof(quad));
      const __m512i xm = _mm512_set1_epi32(quad);
      acc[m][0] = _mm512_dpbusd_epi32(acc[m][0], xm, v0);
      acc[m][1] = _mm512_dpbusd_epi32(acc[m][1], xm, v1);
    }
  }
  const __m512i off0 = _mm512_loadu_si512(offset), off1 = _mm512_loadu_si512(offset + 16);
  const __m512 s0 = _mm512_loadu_ps(w_scale), s1 = _mm512_loadu_ps(w_scale + 16);
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) {
    // The sums less 128 x the column's code sum are the signed products, exact in int32 (|sum| <= 255 x
    // 127 x K); as float32 they round only above 2^24 (2^-24 relative).
    const __m512 r = _mm512_set1_ps(x_scale[m]);
    const __m512 a0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[m][0], off0));
    const __m512 a1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[m][1], off1));
    _mm512_store_ps(c + m * kCols, _mm512_mul_ps(_mm512_mul_ps(a0, r), s0));
    _mm512_store_ps(c + m * kCols + 16, _mm512_mul_ps(_mm512_mul_ps(a1, r), s1));
  }
}

// All M rows against one panel, 8 at a time, each pass with its share of the prefetch
// (panels::panel_prefetch).
inline void i8_rows(const uint8_t* x, int64_t xs, const float* x_scale, const int8_t* wp, int64_t quads,
                    const int32_t* offset, const float* w_scale, float* c, int64_t M) {
  const int64_t passes = (M + 7) / 8;
  for (int64_t m0 = 0, g = 0; m0 < M; m0 += 8, ++g) {
    panels::PassPrefetch ahead = panels::panel_prefetch(wp, quads * kQuadRow, quads, g, passes);
    panels::with_rows(M - m0, [&](auto rows) {
      i8_pass<decltype(rows)::value>(x + m0 * xs, xs, x_scale + m0, wp, quads, offset, w_scale, c + m0 * kCols,
                                     ahead);
    });
  }
}
#endif

}  // namespace

// xq: [M, K] uint8 (q + 128, quantize_rows_u8's; rows may be strided); x_scales: float32 [M] (or
// [M, 1]); panels: panel_pack(codes, 4) of the [N, K] int8 weight codes; offsets: int32 [ceil(N/32) * 32],
// 128 x each column's code sum (0 past N); w_scales: float32, one per panel column; n: N.
// Returns [M, N] bfloat16.
at::Tensor i8_matmul(at::Tensor xq, at::Tensor x_scales, at::Tensor packed, at::Tensor offsets,
                        at::Tensor w_scales, int64_t n) {
  TORCH_CHECK(panels::kBf16Loops, "the int8 panel loops need a build for AVX512-BF16 (which has VNNI)");
  TORCH_CHECK(xq.dim() == 2 && xq.stride(1) == 1 && xq.scalar_type() == at::kByte,
              "xq must be [M, K] uint8 with contiguous rows");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.size(2) == kCols && packed.size(3) == 4 && packed.size(1) * 4 == xq.size(1),
              "panels: panel_pack's [N/32, K/4, 32, 4] of int8 codes, K as x's");
  const int64_t cols = packed.size(0) * kCols;
  TORCH_CHECK(x_scales.scalar_type() == at::kFloat && x_scales.is_contiguous() && x_scales.numel() == xq.size(0),
              "x_scales: float32, one per row");
  TORCH_CHECK(offsets.scalar_type() == at::kInt && offsets.is_contiguous() && offsets.numel() == cols,
              "offsets: int32, one per panel column");
  TORCH_CHECK(w_scales.scalar_type() == at::kFloat && w_scales.is_contiguous() && w_scales.numel() == cols,
              "w_scales: float32, one per panel column");
  TORCH_CHECK(n > 0 && n <= cols, "n out of range");
  const int64_t M = xq.size(0), K = xq.size(1);
  TORCH_CHECK(K > 0, "K must be positive");
  auto y = at::empty({M, n}, xq.options().dtype(at::kBFloat16));
  if (M == 0) return y;
#if defined(TM_AVX512_BF16)
  const int64_t quads = K / 4, panel_bytes = K * kCols;
  const uint8_t* x = xq.data_ptr<uint8_t>();
  const int64_t xs = xq.stride(0);
  const float* rs = x_scales.data_ptr<float>();
  const int8_t* w = packed.data_ptr<int8_t>();
  const int32_t* off = offsets.data_ptr<int32_t>();
  const float* cs = w_scales.data_ptr<float>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  // ~64 KB of codes a task at least, as the other panel kernels.
  panels::for_each_sweep(M, [&](int64_t r0, int64_t rows) {
    panels::for_each_panel(n, rows, std::max<int64_t>(1, 65536 / panel_bytes), yp + r0 * n, [&](int64_t p, float* c) {
      const int8_t* wp = w + p * panel_bytes;
      i8_rows(x + r0 * xs, xs, rs + r0, wp, quads, off + p * kCols, cs + p * kCols, c, rows);
    });
  });
#endif
  return y;
}
