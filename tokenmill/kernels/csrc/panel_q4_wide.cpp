// 4-bit weights times 8-bit activations on AVX2 (W4A8; quantization="int4" on CPUs without AVX512-BF16),
// y[M, N] = x[M, K] @ W^T with x float32 or bfloat16 and y float32, over the 4-bit panels of panel_q4.cpp
// (q4_pack: per panel and group of 32 k, 8 quads of 64 bytes, then float16 scales and, unless every
// minimum is -8 scale, float16 minima). The steps of a few rows that read every weight once: 4 bits a
// weight rather than bf16's 16.
//
// The activations are quantized per row and group of 32 k (codes round(x / a), a = max|x| / 127: the
// Q8_0 block llama.cpp multiplies its Q4 weights by). Without VNNI, vpmaddubsw multiplies the weight
// codes (unsigned, 0..15) by the activation codes (signed) and adds neighbouring pairs into 16 bits; a
// pair is at most 2 x 15 x 127 = 3810, so the 8 quads of a group add up in 16 bits (30480 < 32767)
// before one vpmaddwd widens them to 32: exact integer sums. Then, per group, as panel_q4.cpp's int8_pass:
// with minima y += scale a sum(q codes) + lo a sum(codes); without, y += scale a (sum(q codes) - 8 sum(codes)).
// One row a pass over a panel (a panel of SmolLM2's widest K, 1536, is 30 KB: the next row finds it in
// L1 or L2), each row summed in an order that does not depend on the others.
#include "tensor.h"
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "panels.h"
#include "vec_math.h"

// Named, not anonymous: this file shares a translation unit with panel_g8.cpp (kernels/build.py), whose
// anonymous namespace has constants of the same names.
namespace q4_wide {

using panels::kCols;

constexpr int64_t kGroup = 32;
constexpr int64_t kQuadBytes = 64;
constexpr int64_t kQuads = kGroup / 4;
constexpr int64_t kCodeBytes = kQuads * kQuadBytes;  // 512
template <bool Sym>
constexpr int64_t kGroupBytes = kCodeBytes + (Sym ? 1 : 2) * kCols * 2;

// Per row and group: codes round(x / a) (half to even), a = max|x| / 127, their integer sum, and a * sum
// (the value sum the minimum's term takes, as Q8_1 carries it). A group of zeros gets zero codes, a = 0.
template <typename T>
void quantize_rows(const T* x, int64_t xs, int64_t M, int64_t K, int8_t* xq, float* xa, int32_t* isum,
                   float* xsum) {
  const int64_t groups = K / kGroup;
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t b, int64_t e) {
    float v[kGroup];
    for (int64_t m = b; m < e; ++m)
      for (int64_t g = 0; g < groups; ++g) {
        load_f32(x + m * xs + g * kGroup, v, kGroup);
        float amax = 0.f;
        for (int64_t i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(v[i]));
        float inv = amax > 0.f ? 127.f / amax : 0.f;
        if (!std::isfinite(inv)) inv = 0.f;
        int8_t* qg = xq + m * K + g * kGroup;
        int32_t sum = 0;
        for (int64_t i = 0; i < kGroup; ++i) {
          qg[i] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
          sum += qg[i];
        }
        const int64_t mg = m * groups + g;
        xa[mg] = amax / 127.f;
        isum[mg] = sum;
        xsum[mg] = xa[mg] * static_cast<float>(sum);
      }
  });
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
static inline __m256 f16x8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// One row's codes (xq: K of them; xa, isum, xsum: per group) against one panel, into c (32 floats).
template <bool Sym>
void row_panel(const int8_t* xq, const float* xa, const int32_t* isum, const float* xsum, int64_t groups,
               const uint8_t* wp, float* c, panels::PassPrefetch& ahead) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 y[4];
  for (int i = 0; i < 4; ++i) y[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = wp + g * kGroupBytes<Sym>;
    ahead.step();
    // 16-bit pair sums of columns 0-7, 8-15, 16-23, 24-31 (lanes of 4 k each, two words a lane).
    __m256i p[4];
    for (int i = 0; i < 4; ++i) p[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int64_t q = 0; q < kQuads; ++q) {
      int32_t quad;
      std::memcpy(&quad, xq + g * kGroup + 4 * q, sizeof(quad));
      const __m256i xm = _mm256_set1_epi32(quad);
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + q * kQuadBytes));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + q * kQuadBytes + 32));
      p[0] = _mm256_add_epi16(p[0], _mm256_maddubs_epi16(_mm256_and_si256(v0, low), xm));
      p[1] = _mm256_add_epi16(p[1], _mm256_maddubs_epi16(_mm256_and_si256(v1, low), xm));
      p[2] = _mm256_add_epi16(p[2], _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v0, 4), low), xm));
      p[3] = _mm256_add_epi16(p[3], _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v1, 4), low), xm));
    }
    const uint16_t* sc = reinterpret_cast<const uint16_t*>(wg + kCodeBytes);
    const __m256 r = _mm256_set1_ps(xa[g]);
    // p[0..3] hold columns 0-7, 8-15, 16-23, 24-31; the scales are stored by column.
    for (int i = 0; i < 4; ++i) {
      __m256i s32 = _mm256_madd_epi16(p[i], ones);
      if constexpr (Sym) s32 = _mm256_sub_epi32(s32, _mm256_set1_epi32(8 * isum[g]));
      const __m256 s = _mm256_mul_ps(f16x8(sc + 8 * i), r);
      if constexpr (Sym) {
        y[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), s, y[i]);
      } else {
        const __m256 lo = f16x8(sc + kCols + 8 * i);
        y[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), s, _mm256_fmadd_ps(lo, _mm256_set1_ps(xsum[g]), y[i]));
      }
    }
  }
  for (int i = 0; i < 4; ++i) _mm256_store_ps(c + 8 * i, y[i]);
}

template <bool Sym>
void run(const int8_t* xq, const float* xa, const int32_t* isum, const float* xsum, int64_t M, int64_t K,
         const uint8_t* w, int64_t n, float* y) {
  const int64_t groups = K / kGroup, panel_bytes = groups * kGroupBytes<Sym>;
  const int64_t grain = std::max<int64_t>(1, 65536 / panel_bytes);
  panels::for_each_panel(n, M, grain, y, [&](int64_t p, float* c) {
    const uint8_t* wp = w + p * panel_bytes;
    for (int64_t m = 0; m < M; ++m) {
      panels::PassPrefetch ahead = panels::panel_prefetch(wp, panel_bytes, groups, m, M);
      row_panel<Sym>(xq + m * K, xa + m * groups, isum + m * groups, xsum + m * groups, groups, wp,
                     c + m * kCols, ahead);
    }
  });
}
#endif

}  // namespace q4_wide

bool q4_wide_available() {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return true;
#else
  return false;
#endif
}

// x: [M, K] float32 or bfloat16 (rows may be strided), panels: q4_pack's [ceil(N/32), K/32, 640] (576
// without minima) uint8, n: N. -> [M, n] float32.
at::Tensor q4_matmul_wide(at::Tensor x, at::Tensor packed, int64_t n) {
  TORCH_CHECK(q4_wide_available(), "the AVX2 4-bit loops need a build with AVX2, FMA and F16C");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be [M, K] float32 or bfloat16 with contiguous rows");
  const bool sym = packed.dim() == 3 && packed.size(2) == q4_wide::kGroupBytes<true>;
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  (sym || packed.size(2) == q4_wide::kGroupBytes<false>),
              "panels: q4_pack's [N/32, K/32, 640 or 576] uint8");
  const int64_t M = x.size(0), K = x.size(1), groups = K / q4_wide::kGroup;
  TORCH_CHECK(K == packed.size(1) * q4_wide::kGroup, "K mismatch");
  TORCH_CHECK(n > 0 && n <= packed.size(0) * panels::kCols, "n out of range");
  auto y = at::empty({M, n}, x.options().dtype(at::kFloat));
  if (M == 0) return y;
  std::vector<int8_t> xq(M * K);
  std::vector<float> xa(M * groups), xsum(M * groups);
  std::vector<int32_t> isum(M * groups);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "q4_matmul_wide", [&] {
    q4_wide::quantize_rows(x.data_ptr<scalar_t>(), x.stride(0), M, K, xq.data(), xa.data(), isum.data(), xsum.data());
  });
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  const uint8_t* w = packed.data_ptr<uint8_t>();
  if (sym)
    q4_wide::run<true>(xq.data(), xa.data(), isum.data(), xsum.data(), M, K, w, n, y.data_ptr<float>());
  else
    q4_wide::run<false>(xq.data(), xa.data(), isum.data(), xsum.data(), M, K, w, n, y.data_ptr<float>());
#endif
  return y;
}
