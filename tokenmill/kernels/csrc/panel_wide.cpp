// bfloat16 weights, float32 arithmetic: y[M, N] = x[M, K] @ W^T with x and y float32 and W the bf16
// panels of panel_matmul.cpp ([N/32][K/2][32][2]), for any number of rows. For CPUs without BF16
// instructions (AVX2: AMD Zen 3, Intel's client CPUs; AVX-512 without BF16), where a bf16 matmul is
// emulated (oneDNN and PyTorch widen, multiply and round back at every step, and on AMD Zen 3 a batch of
// 32 ran slower than one stream): the weights keep bf16's bytes, and widening one to float32 is a shift,
// so the products are float32 FMAs at the memory's pace for decode and at the FMA units' for prompts.
//
// Two ways through a panel, the same sums in the same order (each column's k in turn, one FMA each), so a
// row's result does not depend on how many rows share its step (seeded sampling stays reproducible):
// - up to kFlyRows rows a sweep (decode steps): the weights widened in registers as they stream, passes of
//   2 rows over all 32 columns (8 accumulators, the widened pair and the rows' x in the other 8 of AVX2's
//   16 vector registers);
// - more rows: the panel widened once a sweep into a float32 panel [K][32] in L2, then passes of 6 rows x
//   16 columns over it (12 accumulators, 2 weight vectors and a broadcast: AVX2's classic float32 kernel,
//   bound by the FMA units rather than by the loads).
// Measured against PyTorch's bf16 and float32 matmuls, and in the model: docs/history/benchmarks.md, "CPUs without
// BF16 instructions" (benchmarks/wide_bf16.py).
#include "tensor.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "panels.h"

namespace {

using bf16 = at::BFloat16;
using panels::kCols;
using panels::kPairRow;
using panels::PassPrefetch;

constexpr int64_t kFlyRows = 4;      // rows a sweep up to which the weights are widened in registers
constexpr int64_t kSweepRows = 64;   // float32 rows a sweep: 64 x 1536 x 4 bytes (384 KB) stay in L2
constexpr int64_t kFlyPass = 2;      // rows a pass of the register path
constexpr int64_t kBufPass = 6;      // rows a pass over a widened panel
constexpr int64_t kBlockK = 128;     // k a block of those passes: 128 x 32 float32 (16 KB) stay in L1

int64_t panel_grain(int64_t pairs) { return std::max<int64_t>(1, 1024 / std::max<int64_t>(pairs, 1)); }

#if defined(__AVX2__) && defined(__FMA__)
// 8 columns' k pair (16 bf16: column j's even k at 2j, odd at 2j + 1) as float32 even-k and odd-k vectors:
// the even weight is the low half of each 32-bit lane (shifted up), the odd one the high half (masked).
__attribute__((always_inline)) inline void widen8(const bf16* p, __m256& even, __m256& odd) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

template <int M>
__attribute__((always_inline)) inline void fly_pass(const float* x, int64_t xs, const bf16* wp, int64_t pairs,
                                                    float* c, PassPrefetch& ahead) {
  __m256 acc[M][4];
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m)
    for (int q = 0; q < 4; ++q) acc[m][q] = _mm256_setzero_ps();
  for (int64_t kp = 0; kp < pairs; ++kp) {
    ahead.step();
    const bf16* row = wp + kp * kPairRow;
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      __m256 e, o;
      widen8(row + q * 16, e, o);
#pragma GCC unroll 2
      for (int m = 0; m < M; ++m) {
        acc[m][q] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + m * xs + 2 * kp), e, acc[m][q]);
        acc[m][q] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + m * xs + 2 * kp + 1), o, acc[m][q]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int q = 0; q < 4; ++q) _mm256_store_ps(c + m * kCols + q * 8, acc[m][q]);
}

// The panel as float32 [K][32] (k-major, the 32 columns of each k contiguous) into buf.
inline void widen_panel(const bf16* wp, int64_t pairs, float* buf, PassPrefetch& ahead) {
  for (int64_t kp = 0; kp < pairs; ++kp) {
    ahead.step();
    const bf16* row = wp + kp * kPairRow;
    float* even = buf + 2 * kp * kCols;
    for (int q = 0; q < 4; ++q) {
      __m256 e, o;
      widen8(row + q * 16, e, o);
      _mm256_store_ps(even + q * 8, e);
      _mm256_store_ps(even + kCols + q * 8, o);
    }
  }
}

// R rows x 16 columns (`half` of the panel) over k in [k0, k1) of the widened panel, continuing the sums
// left in c by the block of k before (k0 > 0): the same sums, in the same order, as one pass over all k.
template <int R>
__attribute__((always_inline)) inline void buf_pass(const float* x, int64_t xs, const float* buf, int64_t k0,
                                                    int64_t k1, int64_t half, float* c) {
  __m256 acc[R][2];
  float* out = c + half * 16;
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    acc[r][0] = k0 ? _mm256_load_ps(out + r * kCols) : _mm256_setzero_ps();
    acc[r][1] = k0 ? _mm256_load_ps(out + r * kCols + 8) : _mm256_setzero_ps();
  }
  const float* w = buf + half * 16;
  for (int64_t k = k0; k < k1; ++k) {
    const __m256 w0 = _mm256_load_ps(w + k * kCols), w1 = _mm256_load_ps(w + k * kCols + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * xs + k);
      acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(out + r * kCols, acc[r][0]);
    _mm256_store_ps(out + r * kCols + 8, acc[r][1]);
  }
}

// One panel for a sweep's `rows` rows at x (xs apart) into c (rows x 32, kCols apart); buf: K x 32 floats.
void wide_panel(const float* x, int64_t xs, const bf16* wp, int64_t pairs, int64_t rows, float* c, float* buf) {
  const int64_t bytes = pairs * kPairRow * 2;
  if (rows <= kFlyRows) {
    const int64_t passes = (rows + kFlyPass - 1) / kFlyPass;
    for (int64_t m0 = 0, g = 0; m0 < rows; m0 += kFlyPass, ++g) {
      PassPrefetch ahead = panels::panel_prefetch(wp, bytes, pairs, g, passes);
      if (rows - m0 >= 2)
        fly_pass<2>(x + m0 * xs, xs, wp, pairs, c + m0 * kCols, ahead);
      else
        fly_pass<1>(x + m0 * xs, xs, wp, pairs, c + m0 * kCols, ahead);
    }
    return;
  }
  PassPrefetch ahead = panels::panel_prefetch(wp, bytes, pairs, 0, 1);
  widen_panel(wp, pairs, buf, ahead);
  // Blocks of kBlockK k, so that the block of the widened panel the passes read stays in L1.
  for (int64_t k0 = 0; k0 < 2 * pairs; k0 += kBlockK)
    for (int64_t m0 = 0; m0 < rows; m0 += kBufPass)
      for (int64_t half = 0; half < 2; ++half)
        panels::with_rows(std::min(rows - m0, kBufPass), [&](auto r) {
          buf_pass<decltype(r)::value>(x + m0 * xs, xs, buf, k0, std::min(k0 + kBlockK, 2 * pairs), half,
                                       c + m0 * kCols);
        });
}
#else
// Elsewhere (no AVX2: ARM, POWER, old x86), the same sums in the same order as plain loops.
void wide_panel(const float* x, int64_t xs, const bf16* wp, int64_t pairs, int64_t rows, float* c, float*) {
  for (int64_t m = 0; m < rows; ++m) {
    float* cm = c + m * kCols;
    std::fill(cm, cm + kCols, 0.f);
    for (int64_t k = 0; k < 2 * pairs; ++k) {
      const bf16* w = wp + (k / 2) * kPairRow + (k % 2);
      for (int64_t j = 0; j < kCols; ++j) cm[j] = std::fma(x[m * xs + k], static_cast<float>(w[2 * j]), cm[j]);
    }
  }
}
#endif

}  // namespace

bool panel_wide_fast() {
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

// x: [M, K] float32 (rows may be strided), panels from panel_pack (bf16, pairs), n: output columns.
at::Tensor panel_matmul_wide(at::Tensor x, at::Tensor panels, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat,
              "x must be [M, K] float32 with contiguous rows");
  TORCH_CHECK(panels.dim() == 4 && panels.size(2) == kCols && panels.size(3) == 2 && panels.is_contiguous() &&
                  panels.scalar_type() == at::kBFloat16,
              "panels: panel_pack's of a bfloat16 weight");
  TORCH_CHECK(panels.size(1) * 2 == x.size(1), "K mismatch");
  TORCH_CHECK(n > 0 && n <= panels.size(0) * kCols, "n out of range");
  const int64_t M = x.size(0), K = x.size(1), pairs = K / 2, xs = x.stride(0);
  auto y = at::empty({M, n}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const bf16* w = panels.data_ptr<bf16>();
  float* yp = y.data_ptr<float>();
  const int64_t count = (n + kCols - 1) / kCols;
  for (int64_t r0 = 0; r0 < M; r0 += kSweepRows) {
    const int64_t rows = std::min(kSweepRows, M - r0);
    at::parallel_for(0, count, panel_grain(pairs), [&](int64_t begin, int64_t end) {
      // 64-byte aligned: the sweep's outputs, and (more rows than the register path takes) a widened panel.
      std::vector<float> mem(rows * kCols + (rows > kFlyRows ? K * kCols : 0) + 16);
      float* c = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(mem.data()) + 63) & ~uintptr_t{63});
      float* buf = c + rows * kCols;
      for (int64_t p = begin; p < end; ++p) {
        wide_panel(xp + r0 * xs, xs, w + p * pairs * kPairRow, pairs, rows, c, buf);
        const int64_t n0 = p * kCols, cols = std::min(kCols, n - n0);
        for (int64_t m = 0; m < rows; ++m) std::memcpy(yp + (r0 + m) * n + n0, c + m * kCols, cols * sizeof(float));
      }
    });
  }
  return y;
}
