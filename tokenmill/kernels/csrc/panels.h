// What the panel matmuls share (panel_matmul.cpp: bf16 weights; panel_q4.cpp: 4-bit; panel_q8.cpp: 8-bit):
// weights stored as panels of 32 output columns, so that a thread's share of a matmul is one contiguous
// stream read front to back, with a software prefetch a few pages ahead into L2.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vec_math.h"

namespace panels {

constexpr int64_t kCols = 32;          // output columns a panel holds
constexpr int64_t kAheadBytes = 8192;  // how far ahead of the loads the prefetch runs

// Whether this build has the AVX512-BF16 loops: the bf16 dot loops and the 4-bit and 8-bit panels.
#if defined(TM_AVX512_BF16)
constexpr bool kBf16Loops = true;
#else
constexpr bool kBf16Loops = false;
#endif

// Into L2 (GCC's locality 2 is prefetcht1 on x86; other targets take their nearest equivalent). Into L2
// rather than L1 it leaves L1 to the loads of the moment (measured in panel_matmul.cpp's header).
static inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

#if defined(__AVX512F__)
// One k pair of a panel into M rows' float32 sums: the pair's weights as float32 vectors (e0/o0: the even
// and odd k of columns 0-15, e1/o1: of columns 16-31), each row's two x values broadcast, four FMAs a row
// into four accumulators (one chain per accumulator, so consecutive FMAs do not wait on each other). The
// bf16 vector loops and the 8-bit panels differ only in how they widen the weights before this.
template <int M>
__attribute__((always_inline)) inline void fma_pair(const float* xf, int64_t xs, int64_t kp, __m512 e0, __m512 o0,
                                                    __m512 e1, __m512 o1, __m512 (&acc)[M][4]) {
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) {
    const __m512 x0 = _mm512_set1_ps(xf[m * xs + 2 * kp]), x1 = _mm512_set1_ps(xf[m * xs + 2 * kp + 1]);
    acc[m][0] = _mm512_fmadd_ps(x0, e0, acc[m][0]);
    acc[m][1] = _mm512_fmadd_ps(x1, o0, acc[m][1]);
    acc[m][2] = _mm512_fmadd_ps(x0, e1, acc[m][2]);
    acc[m][3] = _mm512_fmadd_ps(x1, o1, acc[m][3]);
  }
}
#endif

struct NoFinish {
  void operator()() const {}
};

// For every panel of an N-column output, in parallel (at least `grain` panels a task): compute(p, c)
// leaves the panel's M rows x 32 columns in c (float32, 64-byte aligned, rows kCols apart), which are
// rounded into y's rows (N apart; the last panel's columns past N dropped). finish() runs once at the
// end of each task (brgemm's release of its per-thread state).
template <typename T, typename Compute, typename Finish = NoFinish>
void for_each_panel(int64_t N, int64_t M, int64_t grain, T* y, const Compute& compute, const Finish& finish = {}) {
  const int64_t count = (N + kCols - 1) / kCols;
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(M * kCols + 16);
    float* c = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
    for (int64_t p = begin; p < end; ++p) {
      compute(p, c);
      const int64_t n0 = p * kCols, cols = std::min(kCols, N - n0);
      for (int64_t m = 0; m < M; ++m) store_f32(c + m * kCols, y + m * N + n0, cols);
    }
    finish();
  });
}

}  // namespace panels
