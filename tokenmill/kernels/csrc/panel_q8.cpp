// 8-bit weights (weight-only, one scale per output column: quantization="int4"'s output head),
// y[M, N] = x[M, K] @ W^T * scale, with the int8 codes in the 32-column panels of the bf16 panel matmul
// ([N/32][K/2][32][2]: a k pair's two codes side by side), read as one stream with the same software
// prefetch into L2 (panels::panel_prefetch). Up to 4 rows the products are exact (below); above, each panel is
// dequantized once a sweep of up to 256 rows into a bf16 panel in L2 (w = q * scale rounded to bf16, the
// weights a bf16 copy of the layer would hold) and the bf16 dot loops run over it, so the layer needs no
// such copy for larger steps.
//
// On AVX512-BF16 builds (where models/ops.py uses it; measured on AMD Zen 4 only): each 16 columns' k pair
// is sign-extended to 16-bit pairs in 32-bit lanes, split into the even and odd k's as float32, and
// multiplied by the row's float32 x with FMAs (exact products, float32 sums); the column's scale last.
// PyTorch's _weight_int8pack_mm took 1.56 ms for SmolLM2-135M's 49152 x 576 head at one row there, the
// bf16 dot loops 1.27 ms for twice the bytes.
#include "tensor.h"
#include <algorithm>
#include <cstdint>
#include <vector>

#include "panels.h"

namespace {

using panels::kAheadBytes;
using panels::kCols;
using panels::prefetch_l2;

using panels::kPairRow;  // one k pair of a panel: 64 one-byte codes
constexpr int64_t kMaxRows = 4;      // exact products up to here, the dequantized panel above
constexpr int64_t kRowBlock = 256;  // rows a sweep of the weights (each panel dequantized once a sweep)

#if defined(TM_AVX512_BF16)
// 16 columns' k pair (32 bytes: column j's two codes at 2j, 2j+1) as float32 even-k and odd-k vectors.
static inline void q8_pairs(__m256i codes, __m512& even, __m512& odd) {
  const __m512i v = _mm512_cvtepi8_epi16(codes);  // lane j: even code low 16 bits, odd code high
  even = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 16), 16));
  odd = _mm512_cvtepi32_ps(_mm512_srai_epi32(v, 16));
}

template <int M>
__attribute__((always_inline)) inline void q8_panel(const float* xf, int64_t K, const int8_t* wp,
                                                    const float* scale, float* c) {
  __m512 acc[M][4];
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = _mm512_setzero_ps();
  const char* ahead = reinterpret_cast<const char*>(wp) + kAheadBytes;
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    prefetch_l2(ahead + kp * kPairRow);
    const __m512i codes = _mm512_loadu_si512(wp + kp * kPairRow);
    __m512 e0, o0, e1, o1;
    q8_pairs(_mm512_castsi512_si256(codes), e0, o0);
    q8_pairs(_mm512_extracti64x4_epi64(codes, 1), e1, o1);
    panels::fma_pair<M>(xf, K, kp, e0, o0, e1, o1, acc);
  }
  const __m512 s0 = _mm512_loadu_ps(scale), s1 = _mm512_loadu_ps(scale + 16);
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) {
    _mm512_store_ps(c + m * kCols, _mm512_mul_ps(_mm512_add_ps(acc[m][0], acc[m][1]), s0));
    _mm512_store_ps(c + m * kCols + 16, _mm512_mul_ps(_mm512_add_ps(acc[m][2], acc[m][3]), s1));
  }
}

// One panel's weights dequantized, w = q * scale rounded to bf16 (round to nearest even, as PyTorch
// rounds), into `out`: the codes already sit in the bf16 panels' layout, so each value keeps its place.
inline void dequantize_panel(const int8_t* wp, int64_t K, const float* scale, at::BFloat16* out) {
  // 16 values of a k pair are 8 columns' even and odd k side by side: each column's scale twice.
  const __m512i twice = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  __m512 s[4];
  for (int i = 0; i < 4; ++i) s[i] = _mm512_permutexvar_ps(twice, _mm512_castps256_ps512(_mm256_loadu_ps(scale + 8 * i)));
  const char* ahead = reinterpret_cast<const char*>(wp) + kAheadBytes;
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    prefetch_l2(ahead + kp * kPairRow);
    const int8_t* src = wp + kp * kPairRow;
    at::BFloat16* dst = out + kp * kPairRow;
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * i));
      const __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)), s[i]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * i), (__m256i)_mm512_cvtneps_pbh(w));
    }
  }
}

template <int M>
void q8_rows(const float* xf, const int8_t* w, const float* scale, at::BFloat16* y, int64_t K, int64_t N) {
  const int64_t panel_bytes = K * kCols;
  panels::for_each_panel(N, M, std::max<int64_t>(1, 65536 / panel_bytes), y, [&](int64_t p, float* c) {
    q8_panel<M>(xf, K, w + p * panel_bytes, scale + p * kCols, c);
  });
}
#endif

}  // namespace

// x: [M, K] bfloat16 (rows may be strided); panels: panel_pack of the [N, K] int8 codes;
// scales: [ceil(N/32) * 32] float32; n: N.
at::Tensor q8_matmul(at::Tensor x, at::Tensor packed, at::Tensor scales, int64_t n) {
  TORCH_CHECK(panels::kBf16Loops, "the 8-bit panel loops need a build for AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16,
              "x must be [M, K] bfloat16 with contiguous rows");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.size(2) == kCols && packed.size(3) == 2 && packed.size(1) * 2 == x.size(1),
              "panels: panel_pack's [N/32, K/2, 32, 2] of int8 codes, K as x's");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == packed.size(0) * kCols,
              "scales: float32, one per panel column");
  TORCH_CHECK(n > 0 && n <= packed.size(0) * kCols, "n out of range");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K > 0, "K must be positive");
  auto y = at::empty({M, n}, x.options());
  if (M == 0) return y;
#if defined(TM_AVX512_BF16)
  const int8_t* w = packed.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  if (M > kMaxRows) {
    const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
    const int64_t panel_bytes = K * kCols, grain = std::max<int64_t>(1, 65536 / panel_bytes);
    for (int64_t r0 = 0; r0 < M; r0 += kRowBlock) {
      const int64_t rows = std::min(kRowBlock, M - r0);
      panels::for_each_panel(n, rows, grain, yp + r0 * n, [&](int64_t p, float* c) {
        thread_local std::vector<at::BFloat16> buf;
        buf.resize(K * kCols);
        dequantize_panel(w + p * panel_bytes, K, s + p * kCols, buf.data());
        panels::dot_rows(xp + r0 * x.stride(0), x.stride(0), buf.data(), K / 2, c, rows, w + p * panel_bytes,
                         panel_bytes, true);
      });
    }
    return y;
  }
  std::vector<float> xf(M * K);
  for (int64_t m = 0; m < M; ++m) load_f32(x.data_ptr<at::BFloat16>() + m * x.stride(0), &xf[m * K], K);
  switch (M) {
    case 1: q8_rows<1>(xf.data(), w, s, yp, K, n); break;
    case 2: q8_rows<2>(xf.data(), w, s, yp, K, n); break;
    case 3: q8_rows<3>(xf.data(), w, s, yp, K, n); break;
    default: q8_rows<4>(xf.data(), w, s, yp, K, n); break;
  }
#endif
  return y;
}
