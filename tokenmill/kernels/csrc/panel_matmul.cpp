// bfloat16 matmuls of decode steps, y[M, N] = x[M, K] @ W^T, for the few to a few hundred rows where a
// step is bound by reading the weights once, or where oneDNN's matmul leaves speed on the table.
//
// W is stored once, as panels of 32 output columns in the VNNI-2 layout oneDNN's brgemm micro-kernel
// takes ([N/32][K/2][32][2]: the two weights of a k pair side by side), so a thread's share of the
// panels is one contiguous stream read front to back. Three ways through it:
// - up to 4 rows, vector loops (any x86 level): each weight widened to float32 once for all rows, with a
//   software prefetch 8 KB ahead into L2;
// - on CPUs with AVX512-BF16 but no AMX (AMD Zen 4), any number of rows (256 a sweep of the weights),
//   dot loops: vdpbf16ps takes a k pair of the panel as it is and the row's bf16 pair, 32 multiply-adds
//   an instruction, nothing widened;
// - more rows (up to 96), on CPUs with AMX: oneDNN's brgemm micro-kernel (at::native::cpublas) on one
//   panel at a time, faster at these sizes than oneDNN's own matmul over its packed weights (below).
//
// Measured (SmolLM2-135M, Intel Xeon with AMX, 2 cores, docs/history/benchmarks.md): in the model at one stream
// oneDNN's matmul took 18.7-20.2 ms a token; the vector loops without software prefetch 17.8; prefetching
// into L1 (T0) 8 KB ahead 17.9, 16 KB ahead 16.3; into L2 (T1) 8 KB ahead 14.3-14.8, 16-128 KB ahead
// 15.0-15.6; non-temporal (NTA) 20.7-21.9; brgemm per panel at one row 15.5. The hardware prefetchers
// stop at each 4 KB page and ramp up again after every call's first misses; a software prefetch a few
// pages ahead keeps the stream going, and into L2 rather than L1 it leaves L1 to the loads of the moment.
// All 121 linears at 8-32 rows (same process): brgemm per 32-column panel 11.8-14.6 ms against oneDNN's
// 16.0-19.2; 64-column panels 12.0-16.9, 128: 14.3-17.7, 16: 12.8-17.0; a prefetch of the next panel
// before each brgemm call did not help (12.2-15.3). Against oneDNN at more rows: 1.18x at 80, 1.11x at
// 96, 1.05-1.08x at 104-120, 0.96x at 128, 0.87x at 256 (hence at most 96).
// AMD EPYC Zen 4 (no AMX), all 121 linears against oneDNN's avx512_core_bf16 matmul: the dot loops
// 1.8-2.0x at 1-8 rows, 1.3-1.6x at 16-32, 1.2-1.3x at 64, 1.1-1.2x at 96-128, 1.08x at 256; oneDNN's
// brgemm per panel 1.05-1.6x (less at every size); the float32 vector loops in groups of 4 rows lose
// from 16 rows on (0.7x), as they widen every weight once per group. A prompt's chunk in sweeps of 256
// rows: 1.07x at 512 rows, 1.03x at 1024, 1.02x at 2048, so on such CPUs the panels are the only copy
// of the weights (models/linear.py PackedLinear).
#include "tensor.h"
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "panels.h"

namespace {

using panels::kAheadBytes;
using panels::kCols;
using panels::prefetch_l2;

using panels::kPairRow;  // bf16 values of one k pair across a panel (128 bytes)
constexpr int64_t kMaxVectorRows = 4;
constexpr int64_t kMaxBrgemmRows = 96;

using bf16 = at::BFloat16;

#if defined(__AVX512F__)
// Per row four accumulators (two column halves x the pair's two weights, panels::fma_pair): one chain per
// row ran at the FMA latency rather than at the memory's pace. In registers: GCC kept the plain loops'
// accumulators in memory (11 GB/s at one row).
template <typename T, int M>
void panels_avx512(const float* xf, int64_t xs, const bf16* w, T* y, int64_t pairs, int64_t N, int64_t ys,
                   int64_t begin, int64_t end) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t p = begin; p < end; ++p) {
    const bf16* wp = w + p * pairs * kPairRow;
    const char* ahead = reinterpret_cast<const char*>(wp) + kAheadBytes;
    __m512 acc[M][4];
    for (int m = 0; m < M; ++m)
      for (int a = 0; a < 4; ++a) acc[m][a] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < pairs; ++kp) {
      // Past the panel is the next one, contiguous; past the thread's last panel a prefetch is only a
      // wasted hint, never a fault.
      prefetch_l2(ahead + kp * kPairRow * 2);
      prefetch_l2(ahead + kp * kPairRow * 2 + 64);
      const __m512i v0 = _mm512_loadu_si512(wp + kp * kPairRow);
      const __m512i v1 = _mm512_loadu_si512(wp + kp * kPairRow + 32);
      // A pair's first weight is the low half of its 32 bits, the second the high half: as float32,
      // the bf16 bits shifted up, and the high half with the low one cleared.
      const __m512 e0 = _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16));
      const __m512 o0 = _mm512_castsi512_ps(_mm512_and_si512(v0, high));
      const __m512 e1 = _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16));
      const __m512 o1 = _mm512_castsi512_ps(_mm512_and_si512(v1, high));
      panels::fma_pair<M>(xf, xs, kp, e0, o0, e1, o1, acc);
    }
    const int64_t n0 = p * kCols, cols = std::min(kCols, N - n0);
    for (int m = 0; m < M; ++m) {
      alignas(64) float sum[kCols];
      _mm512_store_ps(sum, _mm512_add_ps(acc[m][0], acc[m][1]));
      _mm512_store_ps(sum + 16, _mm512_add_ps(acc[m][2], acc[m][3]));
      store_f32(sum, y + m * ys + n0, cols);
    }
  }
}
#endif

// The same arithmetic as plain loops, which the compiler vectorizes at the AVX2 level (a laptop's) and
// elsewhere.
template <typename T, int M>
void panels_plain(const float* xf, int64_t xs, const bf16* w, T* y, int64_t pairs, int64_t N, int64_t ys,
                  int64_t begin, int64_t end) {
  for (int64_t p = begin; p < end; ++p) {
    const bf16* wp = w + p * pairs * kPairRow;
    const char* ahead = reinterpret_cast<const char*>(wp) + kAheadBytes;
    float acc[M][2][kCols] = {};
    float wf[kPairRow];
    for (int64_t kp = 0; kp < pairs; ++kp) {
      prefetch_l2(ahead + kp * kPairRow * 2);
      prefetch_l2(ahead + kp * kPairRow * 2 + 64);
      load_f32(wp + kp * kPairRow, wf, kPairRow);
      for (int m = 0; m < M; ++m) {
        const float x0 = xf[m * xs + 2 * kp], x1 = xf[m * xs + 2 * kp + 1];
#pragma omp simd
        for (int64_t j = 0; j < kCols; ++j) {
          acc[m][0][j] += x0 * wf[2 * j];
          acc[m][1][j] += x1 * wf[2 * j + 1];
        }
      }
    }
    const int64_t n0 = p * kCols, cols = std::min(kCols, N - n0);
    for (int m = 0; m < M; ++m) {
      float sum[kCols];
      for (int64_t j = 0; j < kCols; ++j) sum[j] = acc[m][0][j] + acc[m][1][j];
      store_f32(sum, y + m * ys + n0, cols);
    }
  }
}

// ~64 KB of weights a task at least: small enough to share the threads fairly, large enough that a
// thread's stream outlasts the prefetch's start-up.
int64_t panel_grain(int64_t pairs) { return std::max<int64_t>(1, 1024 / std::max<int64_t>(pairs, 1)); }

template <typename T, int M>
void vector_rows(const float* xf, int64_t xs, const bf16* w, T* y, int64_t pairs, int64_t N, int64_t ys) {
  const int64_t panels = (N + kCols - 1) / kCols;
  at::parallel_for(0, panels, panel_grain(pairs), [&](int64_t begin, int64_t end) {
#if defined(__AVX512F__)
    panels_avx512<T, M>(xf, xs, w, y, pairs, N, ys, begin, end);
#else
    panels_plain<T, M>(xf, xs, w, y, pairs, N, ys, begin, end);
#endif
  });
}

template <typename T>
void vector_matmul(const float* xf, int64_t xs, const bf16* w, T* y, int64_t M, int64_t pairs, int64_t N) {
  switch (M) {
    case 1: return vector_rows<T, 1>(xf, xs, w, y, pairs, N, N);
    case 2: return vector_rows<T, 2>(xf, xs, w, y, pairs, N, N);
    case 3: return vector_rows<T, 3>(xf, xs, w, y, pairs, N, N);
    case 4: return vector_rows<T, 4>(xf, xs, w, y, pairs, N, N);
    default: TORCH_CHECK(false, "the vector loops take up to 4 rows");
  }
}

void brgemm_matmul(const bf16* x, int64_t lda, const bf16* w, bf16* y, int64_t M, int64_t K, int64_t N) {
  panels::for_each_panel(
      N, M, panel_grain(K / 2), y,
      [&](int64_t p, float* c) {
        at::native::cpublas::brgemm(M, kCols, K, lda, kCols, kCols, false, x, w + p * K * kCols, c);
      },
      [] { at::native::cpublas::brgemm_release(); });
}


#if defined(TM_AVX512_BF16)
void dot_matmul(const bf16* x, int64_t lda, const bf16* w, bf16* y, int64_t M, int64_t K, int64_t N) {
  const int64_t pairs = K / 2;
  panels::for_each_panel(N, M, panel_grain(pairs), y, [&](int64_t p, float* c) {
    const bf16* wp = w + p * pairs * kPairRow;
    panels::dot_rows(x, lda, wp, pairs, c, M, wp, pairs * kPairRow * 2, false);
  });
}
#endif

}  // namespace

// [N, K] weight -> [ceil(N/32), K/g, 32, g] panels, g consecutive k of a column side by side (columns past
// N are zero): bfloat16 weights in pairs (g = 2) for the panel matmul, int8 codes in pairs for
// panel_q8.cpp, e4m3 codes (as int8) in pairs for panel_f8.cpp, int8 codes in fours (g = 4, the layout of
// vpdpbusd) for panel_i8.cpp.
at::Tensor panel_pack(at::Tensor weight, int64_t group) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kChar),
              "weight must be [N, K] bfloat16 (or int8 codes)");
  TORCH_CHECK(group == 2 || group == 4, "group: 2 (k pairs) or 4 (k quads)");
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + kCols - 1) / kCols;
  TORCH_CHECK(K % group == 0, "K must be a multiple of the group (the layout groups k)");
  auto padded = at::zeros({panels * kCols, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({panels, kCols, K / group, group}).permute({0, 2, 1, 3}).contiguous();
}

// x: [M, K] (bfloat16 or float32, rows may be strided), panels from panel_pack, n: output columns.
// Rows up to `vector_rows` (at most 4) take the vector loops; more take brgemm (bfloat16 x, up to 96).
at::Tensor panel_matmul(at::Tensor x, at::Tensor panels, int64_t n, int64_t vector_rows) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
  TORCH_CHECK(panels.dim() == 4 && panels.size(2) == kCols && panels.size(3) == 2 && panels.is_contiguous(),
              "panels: panel_pack's");
  TORCH_CHECK(panels.scalar_type() == at::kBFloat16 && panels.size(1) * 2 == x.size(1), "K mismatch");
  TORCH_CHECK(n > 0 && n <= panels.size(0) * kCols, "n out of range");
  TORCH_CHECK(vector_rows >= 0 && vector_rows <= kMaxVectorRows, "vector_rows: 0 to 4");
  const int64_t M = x.size(0), K = x.size(1);
  auto y = at::empty({M, n}, x.options());
  if (M == 0) return y;
  const bf16* w = panels.data_ptr<bf16>();
  if (M > vector_rows) {
    TORCH_CHECK(M <= kMaxBrgemmRows && x.scalar_type() == at::kBFloat16, "brgemm path: up to 96 bfloat16 rows");
    brgemm_matmul(x.data_ptr<bf16>(), x.stride(0), w, y.data_ptr<bf16>(), M, K, n);
    return y;
  }
  std::vector<float> xf(M * K);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "panel_matmul", [&] {
    for (int64_t m = 0; m < M; ++m) load_f32(x.data_ptr<scalar_t>() + m * x.stride(0), &xf[m * K], K);
    vector_matmul<scalar_t>(xf.data(), K, w, y.data_ptr<scalar_t>(), M, K / 2, n);
  });
  return y;
}

bool panel_dot_available() { return panels::kBf16Loops; }

// The dot loops for any number of bfloat16 rows, 256 a sweep of the weights (x's rows of a sweep stay in
// L2 while the panels stream); only in builds for AVX512-BF16 (panel_dot_available).
at::Tensor panel_matmul_dot(at::Tensor x, at::Tensor panels, int64_t n) {
  TORCH_CHECK(panel_dot_available(), "the dot loops need a build for AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
  TORCH_CHECK(panels.dim() == 4 && panels.size(2) == kCols && panels.size(3) == 2 && panels.is_contiguous(),
              "panels: panel_pack's");
  TORCH_CHECK(panels.scalar_type() == at::kBFloat16 && panels.size(1) * 2 == x.size(1), "K mismatch");
  TORCH_CHECK(n > 0 && n <= panels.size(0) * kCols, "n out of range");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "dot loops: bfloat16 rows");
  const int64_t M = x.size(0), K = x.size(1);
  auto y = at::empty({M, n}, x.options());
#if defined(TM_AVX512_BF16)
  const bf16* xp = x.data_ptr<bf16>();
  panels::for_each_sweep(M, [&](int64_t r0, int64_t rows) {
    dot_matmul(xp + r0 * x.stride(0), x.stride(0), panels.data_ptr<bf16>(), y.data_ptr<bf16>() + r0 * n, rows, K, n);
  });
#endif
  return y;
}
