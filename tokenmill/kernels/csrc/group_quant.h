// Activations quantized per row and group of 32 k as a step runs, for the panels whose weights come in
// groups of 32 (panel_q4.cpp's W4A8, panel_g8.cpp's W8A8): the blocks llama.cpp multiplies its Q4 and
// Q8_0 weights by (Q8_0/Q8_1 activations), so each group's scale follows its own largest value rather
// than the whole row's.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include "tensor.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "panels.h"

namespace group_quant {

constexpr int64_t kGroup = 32;  // k per scale

// Each row's groups of 32 (bfloat16 or float32 rows) as float32 (v) with their largest magnitude: code(v, amax, group index within
// all rows' groups) writes the group's codes, scale and code sum. Rows in parallel (independent, so a
// row's codes do not depend on the rows beside it).
template <typename T, typename Code>
inline void for_each_group(const T* x, int64_t xs, int64_t M, int64_t K, const Code& code) {
  const int64_t groups = K / kGroup;
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t b, int64_t e) {
    float v[kGroup];
    for (int64_t m = b; m < e; ++m)
      for (int64_t g = 0; g < groups; ++g) {
        const T* xg = x + m * xs + g * kGroup;
        float amax = 0.f;
        for (int64_t i = 0; i < kGroup; ++i) {
          v[i] = static_cast<float>(xg[i]);
          amax = std::max(amax, std::fabs(v[i]));
        }
        code(v, amax, m * groups + g);
      }
  });
}

// Per row and group: codes round(x / a) (half to even), a = max|x| / 127, and the codes' sum (an exact
// integer, |sum| <= 32 * 127). A group of zeros, or of values so small that 127 / max overflows
// (subnormals), gets 0 codes and a = 0: its share of the product is below float32's resolution anyway.
template <typename T>
inline void quantize_groups(const T* x, int64_t xs, int64_t M, int64_t K, int8_t* xq, float* xa, int32_t* xsum) {
  for_each_group(x, xs, M, K, [&](const float* v, float amax, int64_t mg) {
    float inv = amax > 0.f ? 127.f / amax : 0.f;
    if (!std::isfinite(inv)) inv = 0.f;
    int8_t* qg = xq + mg * kGroup;
    int32_t sum = 0;
    for (int64_t i = 0; i < kGroup; ++i) {
      qg[i] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
      sum += qg[i];
    }
    xa[mg] = amax / 127.f;
    xsum[mg] = sum;
  });
}

// Per row and group, 16-bit codes for vpdpwssd (panel_g8.cpp's wide rows): x / a with a power of two,
// a = 2^(e - 15) where max|x| = f 2^e (0.5 <= f < 1), so every code is below 2^15 in magnitude and every
// element within 2^7 of its group's largest comes out exactly (bfloat16 holds 8 significant bits); the
// smaller ones are rounded (half to even) at 2^-15 of the largest. Each quad of 4 k is stored as the
// pairs (k0, k2), (k1, k3), the order in which panel_g8.cpp's codes split into 16-bit lanes; xsum is the
// group's code sum (|sum| < 2^20). A group of zeros gets 0 codes and a = 0.
inline void quantize_groups16(const at::BFloat16* x, int64_t xs, int64_t M, int64_t K, int16_t* xq, float* xa,
                              int32_t* xsum) {
  for_each_group(x, xs, M, K, [&](const float* v, float amax, int64_t mg) {
    int ex = 0;
    std::frexp(amax, &ex);
    // 2^(15 - ex) multiplies exactly where float32 holds it; a group whose largest value is below
    // 2^-112 scales each element by ldexp instead (the factor itself would overflow).
    const float f = amax > 0.f && ex >= -112 ? std::ldexp(1.f, 15 - ex) : 0.f;
    int16_t* qg = xq + mg * kGroup;
    int32_t sum = 0;
    for (int64_t i = 0; i < kGroup; ++i) {
      const float c = f > 0.f      ? std::nearbyint(v[i] * f)
                      : amax > 0.f ? std::nearbyint(std::ldexp(v[i], 15 - ex))
                                   : 0.f;
      qg[(i & ~3) + ((i & 1) << 1) + ((i >> 1) & 1)] = static_cast<int16_t>(c);  // k0 k2 k1 k3
      sum += static_cast<int32_t>(c);
    }
    xa[mg] = amax > 0.f ? std::ldexp(1.f, ex - 15) : 0.f;
    xsum[mg] = sum;
  });
}

// The arguments of a group panels' matmul: x [M, K] bfloat16 with contiguous rows (they may be strided),
// the panels [ceil(N/32), K/32, group_bytes] uint8 as `packer` builds them, 0 < n <= their columns.
// `what` names the kernel for the message of a build without AVX512-BF16.
inline void check_panels(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t group_bytes,
                         const char* what, const char* packer) {
  TORCH_CHECK(panels::kBf16Loops, what, " need a build for AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16,
              "x must be [M, K] bfloat16 with contiguous rows");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == group_bytes,
              "panels: ", packer, "'s [N/32, K/32, ", group_bytes, "] uint8");
  TORCH_CHECK(x.size(1) == packed.size(1) * kGroup, "K mismatch");
  TORCH_CHECK(n > 0 && n <= packed.size(0) * panels::kCols, "n out of range");
}

}  // namespace group_quant
