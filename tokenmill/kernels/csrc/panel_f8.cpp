// fp8 matmuls of `quantization="fp8"` (e4m3 weights per output column, e4m3 activations per row, the
// FP8_DYNAMIC scheme) for steps of any number of rows (256 a sweep of the weights), on AVX512-BF16:
// y[M, N] = (sum_k x_code[m, k] w_code[n, k]) * x_scale[m] * w_scale[n], rounded once to bfloat16.
//
// The weights stay one byte each (e4m3 codes in the 32-column panels of the bf16 panel matmul, a k pair
// side by side), so a step reads half of bf16's bytes. The codes are widened to bf16 (every e4m3 value is
// exact in bf16: 4 significant bits of 8) and multiplied by vdpbf16ps with the activations' codes, also
// held in bf16: the products are exact in float32 and summed there, as fp8 hardware sums them. Up to 8
// rows widen in registers as the panel streams in; more rows widen the panel once into a buffer of the
// thread's, which the bf16 dot loops then read from L1/L2 a pass of 8 rows at a time.
//
// e4m3 byte s eeee mmm -> bf16: for exponent field e > 0 the same bits moved into place with the
// exponent rebiased (7 -> 127: + 120), sign apart; e = 0 (zero, and m x 2^-9) from an 8-entry table.
// The codes come from rounding (models/fp8_linear.py clamps to +-448), never the NaN code 0x7F.
//
// Why: the emulated path multiplied bf16 copies of the codes through oneDNN, reading bf16's bytes: on
// AMD Zen 4 it ran at 0.63x the bf16 model at one stream (docs/history/benchmarks.md). Measured there only, so
// models/ops.py uses it only on CPUs without AMX, as the bf16 dot loops.
#include "tensor.h"
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "panels.h"

namespace {

using panels::kAheadBytes;
using panels::kCols;
using panels::kPairRow;  // one k pair of a panel: 64 one-byte codes
using panels::prefetch_l2;

#if defined(TM_AVX512_BF16)
// 32 e4m3 codes -> 32 bf16 values (exact).
static inline __m512i e4m3_to_bf16(__m256i codes) {
  const __m512i w = _mm512_cvtepu8_epi16(codes);
  const __m512i mag = _mm512_and_si512(w, _mm512_set1_epi16(0x7F));
  const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x80)), 8);
  const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
  // Exponent field 0: m x 2^-9 for m = 0..7 (bf16 bits), indexed by the code itself (< 8).
  const __m512i small = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                         0x3C60, 0x3C40, 0x3C20, 0x3C00, 0x3BC0, 0x3B80, 0x3B00, 0x0000);
  const __mmask32 sub = _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8));
  return _mm512_or_si512(_mm512_mask_permutexvar_epi16(normal, sub, mag, small), sign);
}

// A panel's K x 32 codes (bytes in the pair layout) into `out` as the bf16 panel of the same layout.
static inline void widen_panel(const uint8_t* wp, int64_t bytes, at::BFloat16* out) {
  const char* ahead = reinterpret_cast<const char*>(wp) + kAheadBytes;
  for (int64_t i = 0; i < bytes; i += 64) {
    prefetch_l2(ahead + i);
    const __m512i v = _mm512_loadu_si512(wp + i);
    _mm512_storeu_si512(out + i, e4m3_to_bf16(_mm512_castsi512_si256(v)));
    _mm512_storeu_si512(out + i + 32, e4m3_to_bf16(_mm512_extracti64x4_epi64(v, 1)));
  }
}

// All M rows against one panel of codes. Up to 8 rows: one pass widening each k pair in registers as the
// panel streams in (no buffer). More: the panel widened once into a buffer of the thread's, which the
// bf16 dot loops read from L1/L2 a pass of 8 rows at a time. Both run panels::dot_pass, so a row's sums
// are the same bits in a step of any size.
inline void f8_rows(const at::BFloat16* x, int64_t xs, const uint8_t* wp, int64_t pairs, float* c, int64_t M) {
  if (M <= 8) {
    const char* ahead = reinterpret_cast<const char*>(wp) + kAheadBytes;
    auto pair = [&](int64_t kp, __m512bh& v0, __m512bh& v1) {
      prefetch_l2(ahead + kp * kPairRow);
      const __m512i v = _mm512_loadu_si512(wp + kp * kPairRow);
      v0 = (__m512bh)e4m3_to_bf16(_mm512_castsi512_si256(v));
      v1 = (__m512bh)e4m3_to_bf16(_mm512_extracti64x4_epi64(v, 1));
    };
    panels::with_rows(M, [&](auto rows) { panels::dot_pass<decltype(rows)::value>(x, xs, pairs, c, pair); });
    return;
  }
  // The thread's widened panel (K x 32 bf16: 36-96 KB for SmolLM2's linears).
  thread_local std::vector<at::BFloat16> wide;
  const int64_t bytes = pairs * kPairRow;
  if (static_cast<int64_t>(wide.size()) < bytes) wide.resize(bytes);
  widen_panel(wp, bytes, wide.data());
  panels::dot_rows(x, xs, wide.data(), pairs, c, M, wp, bytes, true);  // bytes: the codes' (one each)
}
#endif

}  // namespace

// x: [M, K] e4m3 activation codes held in bfloat16 (e4m3_rows_bf16's; rows may be strided);
// x_scales: float32 [M] (or [M, 1]); panels: panel_pack of the [N, K] e4m3 codes viewed as int8;
// w_scales: float32, one per panel column; n: N. Returns [M, N] bfloat16.
at::Tensor f8_matmul(at::Tensor x, at::Tensor x_scales, at::Tensor packed, at::Tensor w_scales,
                        int64_t n) {
  TORCH_CHECK(panels::kBf16Loops, "the fp8 panel loops need a build for AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16,
              "x must be [M, K] bfloat16 (e4m3 codes) with contiguous rows");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.size(2) == kCols && packed.size(3) == 2 && packed.size(1) * 2 == x.size(1),
              "panels: panel_pack's [N/32, K/2, 32, 2] of e4m3 codes (as int8), K as x's");
  const int64_t cols = packed.size(0) * kCols;
  TORCH_CHECK(x_scales.scalar_type() == at::kFloat && x_scales.is_contiguous() && x_scales.numel() == x.size(0),
              "x_scales: float32, one per row");
  TORCH_CHECK(w_scales.scalar_type() == at::kFloat && w_scales.is_contiguous() && w_scales.numel() == cols,
              "w_scales: float32, one per panel column");
  TORCH_CHECK(n > 0 && n <= cols, "n out of range");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K > 0, "K must be positive");
  auto y = at::empty({M, n}, x.options());
  if (M == 0) return y;
#if defined(TM_AVX512_BF16)
  const int64_t pairs = K / 2, panel_bytes = K * kCols;
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const int64_t xs = x.stride(0);
  const float* rs = x_scales.data_ptr<float>();
  const uint8_t* w = reinterpret_cast<const uint8_t*>(packed.data_ptr<int8_t>());
  const float* cs = w_scales.data_ptr<float>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  panels::for_each_sweep(M, [&](int64_t r0, int64_t rows) {
    panels::for_each_panel(n, rows, std::max<int64_t>(1, 65536 / panel_bytes), yp + r0 * n, [&](int64_t p, float* c) {
      f8_rows(xp + r0 * xs, xs, w + p * panel_bytes, pairs, c, rows);
      const __m512 s0 = _mm512_loadu_ps(cs + p * kCols);
      const __m512 s1 = _mm512_loadu_ps(cs + p * kCols + 16);
      for (int64_t m = 0; m < rows; ++m) {
        const __m512 r = _mm512_set1_ps(rs[r0 + m]);
        float* cm = c + m * kCols;
        _mm512_store_ps(cm, _mm512_mul_ps(_mm512_mul_ps(_mm512_load_ps(cm), r), s0));
        _mm512_store_ps(cm + 16, _mm512_mul_ps(_mm512_mul_ps(_mm512_load_ps(cm + 16), r), s1));
      }
    });
  });
#endif
  return y;
}
