// 8-bit weights in groups of 32 times 8-bit activations on AVX2 (W8A8; quantization="int8" on CPUs
// without AVX512-BF16 and VNNI), y[M, N] = x[M, K] @ W^T with x float32 or bfloat16 and y float32, over
// panel_g8.cpp's panels (g8_pack: per panel and group of 32 k, 8 quads of 128 bytes holding q + 128,
// then 32 float16 scales: a Q8_0 block's form, 8.5 bits a weight).
//
// The activations are quantized per row and group of 32 k (group_quant::quantize_groups: codes
// round(x / a), a = max|x| / 127), as for panel_g8.cpp. Without VNNI the product of two signed bytes
// takes llama.cpp's sign trick: vpmaddubsw multiplies |q| (unsigned) by the activation code with q's
// sign (vpsignb) and adds neighbouring pairs into 16 bits. A pair is at most 2 x 128 x 127 = 32512, so it
// never saturates; vpmaddwd then widens each quad's pairs to 32 bits, which hold a group's sum exactly
// (|sum| <= 32 x 128 x 127). Per group, y += scale * a * sum in float32.
//
// One row a pass over a panel (a panel of SmolLM2's widest K, 1536, is 51 KB: the next row finds it in
// L2), each row summed in an order that does not depend on the other rows, so a row's result is the
// same in any step.
#include "tensor.h"
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "group_quant.h"
#include "panels.h"

// Named, not anonymous: this file shares a translation unit with the other panel files (kernels/build.py).
namespace g8_wide {

using panels::kCols;

constexpr int64_t kGroup = 32;
constexpr int64_t kQuads = kGroup / 4;
constexpr int64_t kQuadBytes = 128;
constexpr int64_t kCodeBytes = kQuads * kQuadBytes;  // 1024
constexpr int64_t kGroupBytes = kCodeBytes + kCols * 2;  // 1088

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// One row's codes (xq: K of them; xa: a scale per group) against one panel, into c (32 floats).
void row_panel(const int8_t* xq, const float* xa, int64_t groups, const uint8_t* wp, float* c,
               panels::PassPrefetch& ahead) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  __m256 y[4];
  for (int i = 0; i < 4; ++i) y[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = wp + g * kGroupBytes;
    ahead.step();
    // 32-bit sums of columns 0-7, 8-15, 16-23, 24-31 (a quad's 128 bytes hold them in that order, 4 k
    // of one column in each 4 bytes).
    __m256i s[4];
    for (int i = 0; i < 4; ++i) s[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int64_t q = 0; q < kQuads; ++q) {
      int32_t quad;
      std::memcpy(&quad, xq + g * kGroup + 4 * q, sizeof(quad));
      const __m256i xm = _mm256_set1_epi32(quad);
      for (int i = 0; i < 4; ++i) {
        // q + 128 with its top bit flipped is q as a signed byte.
        const __m256i w = _mm256_xor_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + q * kQuadBytes + 32 * i)), flip);
        const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xm, w));
        s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(p, ones));
      }
    }
    const uint16_t* sc = reinterpret_cast<const uint16_t*>(wg + kCodeBytes);
    const __m256 r = _mm256_set1_ps(xa[g]);
    for (int i = 0; i < 4; ++i) {
      const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 8 * i)));
      y[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i]), _mm256_mul_ps(scale, r), y[i]);
    }
  }
  for (int i = 0; i < 4; ++i) _mm256_store_ps(c + 8 * i, y[i]);
}

void run(const int8_t* xq, const float* xa, int64_t M, int64_t K, const uint8_t* w, int64_t n, float* y) {
  const int64_t groups = K / kGroup, panel_bytes = groups * kGroupBytes;
  const int64_t grain = std::max<int64_t>(1, 65536 / panel_bytes);
  panels::for_each_panel(n, M, grain, y, [&](int64_t p, float* c) {
    const uint8_t* wp = w + p * panel_bytes;
    for (int64_t m = 0; m < M; ++m) {
      panels::PassPrefetch ahead = panels::panel_prefetch(wp, panel_bytes, groups, m, M);
      row_panel(xq + m * K, xa + m * groups, groups, wp, c + m * kCols, ahead);
    }
  });
}
#endif

}  // namespace g8_wide

bool g8_wide_available() {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return true;
#else
  return false;
#endif
}

// x: [M, K] float32 or bfloat16 (rows may be strided), panels: g8_pack's [ceil(N/32), K/32, 1088] uint8,
// n: N. -> [M, n] float32.
at::Tensor g8_matmul_wide(at::Tensor x, at::Tensor packed, int64_t n) {
  TORCH_CHECK(g8_wide_available(), "the AVX2 8-bit loops need a build with AVX2, FMA and F16C");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be [M, K] float32 or bfloat16 with contiguous rows");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == g8_wide::kGroupBytes,
              "panels: g8_pack's [N/32, K/32, 1088] uint8");
  const int64_t M = x.size(0), K = x.size(1), groups = K / g8_wide::kGroup;
  TORCH_CHECK(K == packed.size(1) * g8_wide::kGroup, "K mismatch");
  TORCH_CHECK(n > 0 && n <= packed.size(0) * panels::kCols, "n out of range");
  auto y = at::empty({M, n}, x.options().dtype(at::kFloat));
  if (M == 0) return y;
  std::vector<int8_t> xq(M * K);
  std::vector<float> xa(M * groups);
  std::vector<int32_t> xsum(M * groups);
  if (x.scalar_type() == at::kFloat)
    group_quant::quantize_groups(x.data_ptr<float>(), x.stride(0), M, K, xq.data(), xa.data(), xsum.data());
  else
    group_quant::quantize_groups(x.data_ptr<at::BFloat16>(), x.stride(0), M, K, xq.data(), xa.data(), xsum.data());
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  g8_wide::run(xq.data(), xa.data(), M, K, packed.data_ptr<uint8_t>(), n, y.data_ptr<float>());
#endif
  return y;
}
