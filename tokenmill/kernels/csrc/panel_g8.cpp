// 8-bit weights in groups of 32 k, one float16 scale each (w = scale * q, q in -128..127: a Q8_0 GGUF
// block), times activations quantized as the step runs per row and group of 32 (group_quant.h): W8A8
// as llama.cpp multiplies a Q8_0 file by Q8_0 activations, for any number of rows (AVX512-BF16 builds,
// which have VNNI).
//
// Why groups rather than the per-channel and per-row scales of panel_i8.cpp: the same Q8_0 file cost
// +0.54% perplexity against bf16 multiplied so (emulated, benchmarks/q8_0_accuracy.py) and +1.18%
// through quantization="int8"'s per-channel path, which dequantizes the file and quantizes it again. The
// price is a float epilogue per group of 32 k (the int32 sums scaled and added), which W4A8 also pays.
//
// Layout: 32-column panels as the other panel kernels' (one contiguous stream a thread, the software
// prefetch into L2 of panels::panel_prefetch). Per panel and group: 8 k quads of 128 bytes, the first
// 64 columns 0-15 and the last 64 columns 16-31, byte 4j + t holding column j's q + 128 at k = 4 * quad + t (unsigned,
// the first operand of vpdpbusd); then the group's 32 scales in float16 (a Q8_0 block's own, so its
// weights come back exactly): 1088 bytes for 1024 weights, 8.5 bits a weight, as in Q8_0. Built by
// models/ops.py (g8_pack) with plain torch ops.
//
// The product: vpdpbusd sums (q + 128) * code over a quad in int32; each row's accumulators start at
// -128 * sum(codes) of the group, so after the 8 quads they hold sum(q * code) exactly (|sum| < 2^20);
// then y += scale * x_scale * sum in float32. Rows are taken 256 a sweep of the weights (they stay in
// L2 while the weights stream), 4 a pass. Every row is summed in an order that does not depend on the
// other rows, so a row's result is the same in any step.
//
// Steps of up to `wide_rows` rows (int4's 8-bit output head takes every step so) quantize the rows to
// 16-bit codes instead, with a power-of-two scale per group (group_quant::quantize_groups16: the
// precision of bf16 activations), and multiply them by vpdpwssd over the same panels, each code quad
// split into 16-bit pairs as it streams in: twice the multiply instructions of the 8-bit codes, as fast
// up to 2 rows (the bytes bound them), 0.64x at 32 rows (AMD Zen 4); the 8-bit codes cost the int4
// model +0.1% perplexity through its head alone (benchmarks/perplexity.py).
#include "tensor.h"
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "group_quant.h"
#include "panels.h"

namespace {

using panels::kCols;

constexpr int64_t kGroup = group_quant::kGroup;       // k per scale
constexpr int64_t kHalfBytes = 16 * 4;                 // one k quad of 16 columns: 64 bytes
constexpr int64_t kQuads = kGroup / 4;                 // quads in a group
constexpr int64_t kCodeBytes = kQuads * 2 * kHalfBytes;  // 1024
constexpr int64_t kGroupBytes = kCodeBytes + kCols * 2;  // codes, then 32 float16 scales: 1088

#if defined(TM_AVX512_BF16)
// Up to 4 rows of activation codes (xq, rows K apart; xa: their scales; xsum: their code sums, per row
// and group) against one panel, for either code width: per group the int32 accumulators start at -128 x
// the row's code sum, `quad(acc, wq, xg)` adds one k quad's products (wq: the quad's 128 bytes of weight
// codes; xg: the rows' codes at the quad's first k), and the sums are scaled by the group's weight and
// row scales into float32. `ahead`: the pass's prefetch (panels::panel_prefetch), a step a group.
template <int M, typename T, typename Quad>
__attribute__((always_inline)) inline void group_pass(const T* xq, int64_t K, const float* xa, const int32_t* xsum,
                                                      int64_t groups, const uint8_t* wp, float* c,
                                                      panels::PassPrefetch& ahead, const Quad& quad) {
  __m512 y[M][2];
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) y[m][0] = y[m][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = wp + g * kGroupBytes;
    ahead.step();
    __m512i acc[M][2];
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_set1_epi32(-128 * xsum[m * groups + g]);
#pragma GCC unroll 8
    for (int64_t q = 0; q < kQuads; ++q) quad(acc, wg + q * 2 * kHalfBytes, xq + g * kGroup + 4 * q);
    const uint16_t* sc = reinterpret_cast<const uint16_t*>(wg + kCodeBytes);
    const __m512 s0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc)));
    const __m512 s1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 16)));
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      const __m512 r = _mm512_set1_ps(xa[m * groups + g]);
      y[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][0]), _mm512_mul_ps(s0, r), y[m][0]);
      y[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][1]), _mm512_mul_ps(s1, r), y[m][1]);
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) {
    _mm512_store_ps(c + m * kCols, y[m][0]);
    _mm512_store_ps(c + m * kCols + 16, y[m][1]);
  }
}

// 8-bit codes: each row's four codes of the quad broadcast, vpdpbusd against the biased weight codes.
template <int M>
__attribute__((always_inline)) inline void g8_pass(const int8_t* xq, int64_t K, const float* xa,
                                                   const int32_t* xsum, int64_t groups, const uint8_t* wp, float* c,
                                                   panels::PassPrefetch& ahead) {
  group_pass<M>(xq, K, xa, xsum, groups, wp, c, ahead,
                [K](__m512i (&acc)[M][2], const uint8_t* wq, const int8_t* xg) __attribute__((always_inline)) {
    const __m512i v0 = _mm512_loadu_si512(wq), v1 = _mm512_loadu_si512(wq + kHalfBytes);
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      int32_t quad;  // the row's four codes at this quad's k
      std::memcpy(&quad, xg + m * K, sizeof(quad));
      const __m512i xm = _mm512_set1_epi32(quad);
      acc[m][0] = _mm512_dpbusd_epi32(acc[m][0], v0, xm);
      acc[m][1] = _mm512_dpbusd_epi32(acc[m][1], v1, xm);
    }
  });
}

// 16-bit codes (group_quant::quantize_groups16, each quad's pairs (k0, k2), (k1, k3)): each 16 columns'
// quad splits into those pairs of 16-bit lanes (the even bytes, and the odd ones shifted down),
// multiplied by vpdpwssd. The int32 sums stay exact: at most 32 x 255 x 2^15.
template <int M>
__attribute__((always_inline)) inline void g8_pass16(const int16_t* xq, int64_t K, const float* xa,
                                                     const int32_t* xsum, int64_t groups, const uint8_t* wp,
                                                     float* c, panels::PassPrefetch& ahead) {
  group_pass<M>(xq, K, xa, xsum, groups, wp, c, ahead,
                [K](__m512i (&acc)[M][2], const uint8_t* wq, const int16_t* xg) __attribute__((always_inline)) {
    const __m512i even = _mm512_set1_epi32(0x00FF00FF);
    const __m512i v0 = _mm512_loadu_si512(wq), v1 = _mm512_loadu_si512(wq + kHalfBytes);
    const __m512i a0 = _mm512_and_si512(v0, even), b0 = _mm512_srli_epi16(v0, 8);  // (k0, k2), (k1, k3)
    const __m512i a1 = _mm512_and_si512(v1, even), b1 = _mm512_srli_epi16(v1, 8);
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      int32_t pa, pb;  // the row's (k0, k2) and (k1, k3) codes at this quad
      std::memcpy(&pa, xg + m * K, sizeof(pa));
      std::memcpy(&pb, xg + m * K + 2, sizeof(pb));
      const __m512i xa2 = _mm512_set1_epi32(pa), xb2 = _mm512_set1_epi32(pb);
      acc[m][0] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(acc[m][0], a0, xa2), b0, xb2);
      acc[m][1] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(acc[m][1], a1, xa2), b1, xb2);
    }
  });
}
#endif

}  // namespace

// x: [M, K] bfloat16 (rows may be strided), panels: [ceil(N/32), K/32, 1088] uint8 (g8_pack), n: N. Steps of
// up to `wide_rows` rows take 16-bit activation codes (g8_pass16), larger ones 8-bit (g8_pass).
at::Tensor g8_matmul(at::Tensor x, at::Tensor packed, int64_t n, int64_t wide_rows) {
  group_quant::check_panels(x, packed, n, kGroupBytes, "the 8-bit group panels", "g8_pack");
  const int64_t M = x.size(0), K = x.size(1);
  auto y = at::empty({M, n}, x.options());
  if (M == 0) return y;
#if defined(TM_AVX512_BF16)
  const int64_t groups = K / kGroup, panel_bytes = groups * kGroupBytes;
  const int64_t grain = std::max<int64_t>(1, 65536 / panel_bytes);  // ~64 KB of codes a task at least
  const uint8_t* w = packed.data_ptr<uint8_t>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  std::vector<float> xa(M * groups);
  std::vector<int32_t> xsum(M * groups);
  if (M <= wide_rows) {
    std::vector<int16_t> xq(M * K);
    group_quant::quantize_groups16(x.data_ptr<at::BFloat16>(), x.stride(0), M, K, xq.data(), xa.data(), xsum.data());
    panels::sweep_rows4(n, M, grain, w, panel_bytes, groups, yp,
                        [&](auto four, int64_t r, const uint8_t* wp, float* c, panels::PassPrefetch& ahead) {
      g8_pass16<decltype(four)::value>(xq.data() + r * K, K, xa.data() + r * groups, xsum.data() + r * groups,
                                       groups, wp, c, ahead);
    });
    return y;
  }
  std::vector<int8_t> xq(M * K);
  group_quant::quantize_groups(x.data_ptr<at::BFloat16>(), x.stride(0), M, K, xq.data(), xa.data(), xsum.data());
  panels::sweep_rows4(n, M, grain, w, panel_bytes, groups, yp,
                        [&](auto four, int64_t r, const uint8_t* wp, float* c, panels::PassPrefetch& ahead) {
    g8_pass<decltype(four)::value>(xq.data() + r * K, K, xa.data() + r * groups, xsum.data() + r * groups, groups, wp,
                                   c, ahead);
  });
#endif
  return y;
}
