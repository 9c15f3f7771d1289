// Small float helpers shared by the CPU kernels, written as plain arithmetic so that loops over them
// vectorize under -O3 at every instruction-set level (libm calls and c10's conversions stay scalar).
#pragma once
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

// Rows per thread-pool task for row-wise loops: about 32k elements, so a small batch (a decode step
// of a few rows) runs on the calling thread instead of waking the pool.
static inline int64_t grain_for(int64_t row_elems) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_elems, 1));
}

// The largest of n floats (abs: of their magnitudes). Written with vector registers: GCC leaves a float
// max reduction scalar without -ffast-math, even under omp simd, one vmaxss waiting on the last per
// element: in decode attention's softmax that was a quarter of the whole kernel's time. NaN elements are
// skipped, as std::max(m, x) skips them.
template <bool ABS = false>
static inline float max_of(const float* x, int64_t n) {
  float mx = ABS ? 0.f : -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 m = _mm512_set1_ps(mx);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    m = _mm512_max_ps(ABS ? _mm512_abs_ps(v) : v, m);  // this order: a NaN element is skipped
  }
  mx = _mm512_reduce_max_ps(m);
#elif defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_set1_ps(mx);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    m = _mm256_max_ps(ABS ? _mm256_andnot_ps(sign, v) : v, m);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  for (float v : lanes) mx = std::max(mx, v);
#endif
  for (; i < n; ++i) mx = std::max(mx, ABS ? std::fabs(x[i]) : x[i]);
  return mx;
}

// exp(x) from 2^n * 2^r with |r| <= 1/2 and a degree-7 Taylor polynomial of 2^r (relative error
// < 1e-7 on the range silu needs). Plain arithmetic, so the compiler vectorizes loops over it;
// std::exp stays a scalar libm call and made silu*mul 4x slower than PyTorch's. Loops over it
// vectorize only with -fno-trapping-math (kernels/__init__.py): without it the AVX2 build ran
// silu*mul 10x slower than the AVX-512 one.
static inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float t = x * 1.4426950408889634f;  // log2(e)
  const float n = std::nearbyint(t);
  const float r = (t - n) * 0.6931471805599453f;  // in [-ln2/2, ln2/2]
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__AVX512F__)
// exp_approx on sixteen lanes, step for step (the scalar loops get the same arithmetic vectorized).
static inline __m512 exp_approx16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

// Load n values of T into float. bfloat16 is the top half of a float32, so the conversion is a shift,
// which the compiler turns into vector instructions.
template <typename T>
static inline void load_f32(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void load_f32<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(s[i]) << 16;
    float v;
    std::memcpy(&v, &bits, sizeof(v));
    dst[i] = v;
  }
}

// Store n floats as T, rounded to nearest even (as PyTorch's .to(bfloat16) rounds).
template <typename T>
static inline void store_f32(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// One float to bfloat16 bits, rounded to nearest even; NaN stays a (quiet) NaN. Branch-free, so a loop
// over it vectorizes (c10's conversion has a branch and stays scalar).
static inline uint16_t bf16_bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  const uint16_t rounded = static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
  return (b & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>(0x7FC0) : rounded;
}

template <>
inline void store_f32<c10::BFloat16>(const float* src, c10::BFloat16* dst, int64_t n) {
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
  int64_t i = 0;
#if defined(TM_AVX512_BF16)
  // The CPU's own conversion (vcvtneps2bf16): 16 at a time, round to nearest even like bf16_bits,
  // except that it flushes float32 subnormals to zero, far below bfloat16's resolution of a result.
  for (; i + 16 <= n; i += 16) {
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), reinterpret_cast<const __m256i&>(h));
  }
#endif
#pragma omp simd
  for (int64_t j = i; j < n; ++j) d[j] = bf16_bits(src[j]);
}
