// 4-bit weights (quantization="int4") for decode steps of up to 4 rows, y[M, N] = x[M, K] @ W^T, with W
// stored as panels of 32 output columns like the bf16 panel matmul's (panel_matmul.cpp), so a thread's
// share is one contiguous stream read once, with the same software prefetch 8 KB ahead into L2.
//
// The format is a Q4_0/Q4_1 GGUF block's: groups of 32 k per column, w = q * scale + lo, q in 0..15. Per
// panel and group: 16 k pairs of 32 bytes (byte j: column j's even-k code in the low nibble, odd-k code
// in the high one), then the group's 32 scales and 32 minima in bfloat16: 640 bytes for 1024 weights, 5
// bits a weight, as in Q4_1. Built by models/ops.py (Q4Panels) with plain torch ops.
//
// On AVX512-BF16 (the only build that has these loops): each 16 columns' k pair of codes is widened to
// 32-bit lanes, its two nibbles moved to the lane's two halves and looked up as bf16(0..15) with one
// vpermw, and vdpbf16ps multiplies them by the row's bf16 pair: exact products, float32 sums per group,
// then y += scale * sum(x q) + lo * sum(x). PyTorch's _weight_int4pack_mm, which this replaces where it
// is used, took 8.3 ms a token for the whole int4 model on AMD Zen 4 (23% of the bandwidth limit).
#include <torch/extension.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "panels.h"

namespace {

using panels::kAheadBytes;
using panels::kCols;
using panels::prefetch_l2;

constexpr int64_t kGroup = 32;                                    // k per scale
constexpr int64_t kPairBytes = kCols;                             // one k pair of a panel's codes
constexpr int64_t kGroupBytes = kGroup / 2 * kPairBytes + 2 * kCols * 2;  // codes, scales, minima
constexpr int64_t kMaxRows = 4;

using bf16 = at::BFloat16;
#if defined(TM_AVX512_BF16)
// The codes of 16 columns' k pair (16 bytes) as the bf16 pairs vdpbf16ps takes: each byte widened to a
// 32-bit lane, its two nibbles moved to the lane's two 16-bit halves, each looked up as bf16(0..15).
static inline __m512bh q4_pairs(__m128i codes, __m512i table) {
  const __m512i v = _mm512_cvtepu8_epi32(codes);
  const __m512i idx = _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi32(0xF)),
                                      _mm512_and_si512(_mm512_slli_epi32(v, 12), _mm512_set1_epi32(0xF0000)));
  return (__m512bh)_mm512_permutexvar_epi16(idx, table);
}

static inline __m512 bf16x16(const bf16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// All M (<= 4) rows against one panel: per group, exact bf16 products summed in float32, then
// y += scale * sum(x q) + lo * sum(x) (the row's sum over the group, xsum).
template <int M>
__attribute__((always_inline)) inline void q4_panel(const bf16* x, int64_t xs, const float* xsum, int64_t groups,
                                                    const uint8_t* wp, float* c, __m512i table) {
  __m512 y[M][2];
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) y[m][0] = y[m][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = wp + g * kGroupBytes;
    prefetch_l2(wg + kAheadBytes);
    prefetch_l2(wg + kAheadBytes + 64);
    prefetch_l2(wg + kAheadBytes + 128);
    prefetch_l2(wg + kAheadBytes + 192);
    prefetch_l2(wg + kAheadBytes + 256);
    prefetch_l2(wg + kAheadBytes + 320);
    prefetch_l2(wg + kAheadBytes + 384);
    prefetch_l2(wg + kAheadBytes + 448);
    prefetch_l2(wg + kAheadBytes + 512);
    prefetch_l2(wg + kAheadBytes + 576);
    __m512 acc[M][2];
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < kGroup / 2; ++kp) {
      const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + kp * kPairBytes));
      const __m512bh w0 = q4_pairs(_mm256_castsi256_si128(codes), table);
      const __m512bh w1 = q4_pairs(_mm256_extracti128_si256(codes, 1), table);
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) {
        int32_t pair;
        std::memcpy(&pair, x + m * xs + g * kGroup + 2 * kp, sizeof(pair));
        const __m512bh xm = (__m512bh)_mm512_set1_epi32(pair);
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xm, w0);
        acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xm, w1);
      }
    }
    const bf16* sc = reinterpret_cast<const bf16*>(wg + kGroup / 2 * kPairBytes);
    const __m512 s0 = bf16x16(sc), s1 = bf16x16(sc + 16), lo0 = bf16x16(sc + 32), lo1 = bf16x16(sc + 48);
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      const __m512 xg = _mm512_set1_ps(xsum[m * groups + g]);
      y[m][0] = _mm512_fmadd_ps(acc[m][0], s0, _mm512_fmadd_ps(lo0, xg, y[m][0]));
      y[m][1] = _mm512_fmadd_ps(acc[m][1], s1, _mm512_fmadd_ps(lo1, xg, y[m][1]));
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) {
    _mm512_store_ps(c + m * kCols, y[m][0]);
    _mm512_store_ps(c + m * kCols + 16, y[m][1]);
  }
}

template <int M>
void q4_rows(const bf16* x, int64_t xs, const float* xsum, const uint8_t* w, bf16* y, int64_t K, int64_t N) {
  const int64_t groups = K / kGroup, panel_bytes = groups * kGroupBytes;
  alignas(64) uint16_t words[32] = {};
  for (int i = 0; i < 16; ++i) words[i] = c10::BFloat16(static_cast<float>(i)).x;
  const __m512i table = _mm512_load_si512(words);
  panels::for_each_panel(N, M, std::max<int64_t>(1, 65536 / panel_bytes), y, [&](int64_t p, float* c) {
    q4_panel<M>(x, xs, xsum, groups, w + p * panel_bytes, c, table);
  });
}
#endif

}  // namespace

// x: [M <= 4, K] bfloat16 (rows may be strided), panels: [ceil(N/32), K/32, 640] uint8 (Q4Panels), n: N.
torch::Tensor q4_matmul(torch::Tensor x, torch::Tensor packed, int64_t n) {
  TORCH_CHECK(panels::kBf16Loops, "the 4-bit panel loops need a build for AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16,
              "x must be [M, K] bfloat16 with contiguous rows");
  TORCH_CHECK(x.size(0) <= kMaxRows, "4-bit panel loops: up to 4 rows");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == kGroupBytes,
              "panels: Q4Panels' [N/32, K/32, 640] uint8");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K == packed.size(1) * kGroup, "K mismatch");
  TORCH_CHECK(n > 0 && n <= packed.size(0) * kCols, "n out of range");
  auto y = torch::empty({M, n}, x.options());
  if (M == 0) return y;
#if defined(TM_AVX512_BF16)
  const int64_t groups = K / kGroup;
  std::vector<float> xsum(M * groups);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      const bf16* xg = x.data_ptr<bf16>() + m * x.stride(0) + g * kGroup;
      for (int64_t i = 0; i < kGroup; ++i) s += static_cast<float>(xg[i]);
      xsum[m * groups + g] = s;
    }
  const bf16* xp = x.data_ptr<bf16>();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  bf16* yp = y.data_ptr<bf16>();
  switch (M) {
    case 1: q4_rows<1>(xp, x.stride(0), xsum.data(), w, yp, K, n); break;
    case 2: q4_rows<2>(xp, x.stride(0), xsum.data(), w, yp, K, n); break;
    case 3: q4_rows<3>(xp, x.stride(0), xsum.data(), w, yp, K, n); break;
    default: q4_rows<4>(xp, x.stride(0), xsum.data(), w, yp, K, n); break;
  }
#endif
  return y;
}
