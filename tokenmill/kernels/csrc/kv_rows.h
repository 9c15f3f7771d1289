// How one (token, kv head) row of the paged KV cache is stored, for the kernels that write and read it.
// PlainRows<T>: D values of the model's dtype. Q8Rows<FP8>: D 8-bit codes, then the row's float32 scale
// (value = code * scale), int8 or fp8 e4m3: the layout of tokenmill/models/attention/kv_quant.py,
// which is the reference these must match bit for bit.
#pragma once
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec_math.h"

template <typename T>
struct PlainRows {
  using elem = T;
  static constexpr bool scaled = false;
  static int64_t width(int64_t D) { return D; }
  static float scale(const elem*, int64_t) { return 1.f; }
  static void load(const elem* p, int64_t D, float* dst) { load_f32(p, dst, D); }
};

// e4m3 (float8_e4m3fn) code -> float: exponent bias 7, subnormals below 2^-6, 0x7F/0xFF NaN.
static inline float fp8_e4m3_value(uint8_t c) {
  const int e = (c >> 3) & 15, m = c & 7;
  if (e == 15 && m == 7) return std::nanf("");
  const float mag = e == 0 ? std::ldexp(m / 8.f, -6) : std::ldexp(1.f + m / 8.f, e - 7);
  return c & 0x80 ? -mag : mag;
}

static inline const float* fp8_e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[c] = fp8_e4m3_value(static_cast<uint8_t>(c));
    return t;
  }();
  return table.data();
}

// float (|y| <= 448) -> the nearest e4m3 code, ties to even, as PyTorch's .to(torch.float8_e4m3fn).
static inline uint8_t fp8_e4m3_code(float y) {
  uint32_t bits;
  std::memcpy(&bits, &y, sizeof(bits));
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  bits &= 0x7FFFFFFFu;
  float a;
  std::memcpy(&a, &bits, sizeof(a));
  if (a < 0.015625f)  // below the smallest normal, 2^-6: steps of 2^-9 (8 steps is 2^-6's own code)
    return sign | static_cast<uint8_t>(std::nearbyint(a * 512.f));
  // Round float32's 23 mantissa bits to 3, ties to even; a carry moves into the exponent.
  bits += 0x7FFFFu + ((bits >> 20) & 1u);
  return sign | static_cast<uint8_t>((((bits >> 23) - 120u) << 3) | ((bits >> 20) & 7u));
}

template <bool FP8>
struct Q8Rows {
  using elem = uint8_t;
  static constexpr bool scaled = true;
  static constexpr float kCodeMax = FP8 ? 448.f : 127.f;
  static int64_t width(int64_t D) { return D + 4; }
  static float scale(const elem* p, int64_t D) {
    float s;
    std::memcpy(&s, p + D, sizeof(s));
    return s;
  }
  static void load(const elem* p, int64_t D, float* dst) {
    const float s = scale(p, D);
    if constexpr (FP8) {
      int64_t d = 0;
#if defined(__F16C__)
      // Eight codes at a time as the AVX-512 kernel reads them: each code's bits moved into a float16's
      // (its value / 2^8, exactly), widened, times 2^8 s: the table's products bit for bit, as scaling by
      // a power of two is exact (but for 0x7F and 0xFF, e4m3's NaNs, read as +-480 s as that kernel reads
      // them; only a NaN input is stored as one). The table's one lookup a value made the AVX2 build's
      // fp8 cache 0.55-0.60x its bf16 cache (`benchmarks/decode_attention.py --level avx2`, AMD Zen 5).
      const __m256 s8 = _mm256_set1_ps(s * 256.f);
      for (; d + 8 <= D; d += 8) {
        const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + d)));
        const __m128i sign = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
        const __m128i mag = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7);
        _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(sign, mag)), s8));
      }
#endif
      const float* table = fp8_e4m3_table();
      for (; d < D; ++d) dst[d] = table[p[d]] * s;
    } else {
      const int8_t* c = reinterpret_cast<const int8_t*>(p);
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(c[d]) * s;
    }
  }
  // D floats -> D codes and their scale at p (the reference's arithmetic, step by step).
  static void store(const float* x, int64_t D, elem* p) {
    float s = max_of<true>(x, D) / kCodeMax;
    if (!(s > 0.f)) s = 1.f;
    for (int64_t d = 0; d < D; ++d) {
      const float y = std::min(std::max(x[d] / s, -kCodeMax), kCodeMax);
      if constexpr (FP8)
        p[d] = fp8_e4m3_code(y);
      else
        p[d] = static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(y)));
    }
    std::memcpy(p + D, &s, sizeof(s));
  }
};
