// What the panel matmuls share (panel_matmul.cpp: bf16 weights; panel_q4.cpp: 4-bit; panel_q8.cpp: 8-bit
// weight-only; panel_g8.cpp: 8-bit groups, Q8_0's; panel_i8.cpp: W8A8; panel_f8.cpp: fp8 e4m3): weights
// stored as panels of 32 output columns, so that a thread's share of a matmul is one contiguous stream
// read front to back, with a software prefetch a few pages ahead into L2.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec_math.h"

namespace panels {

constexpr int64_t kCols = 32;          // output columns a panel holds
constexpr int64_t kAheadBytes = 8192;  // how far ahead of the loads the prefetch runs
constexpr int64_t kPairRow = kCols * 2;  // values of one k pair across a panel

// Whether this build has the AVX512-BF16 loops: the bf16 dot loops and the 4-bit, 8-bit and fp8 panels.
#if defined(TM_AVX512_BF16)
constexpr bool kBf16Loops = true;
#else
constexpr bool kBf16Loops = false;
#endif

// Into L2 (prefetcht1 on x86; other targets take GCC's nearest equivalent, locality 2). Into L2 rather
// than L1 it leaves L1 to the loads of the moment (measured in panel_matmul.cpp's header). On x86 an asm
// statement, which the compiler keeps: GCC took a loop of __builtin_prefetch calls (PassPrefetch::step)
// for a loop without effects and dropped it, prefetches and all.
static inline void prefetch_l2(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// A pass's share of a prefetch into L2: `bytes` from `from`, split evenly among `passes` passes over a
// panel, pass `pass` taking its share's lines a few at a time over its `units` steps (k pairs, quads or
// groups: step() once each). Default-constructed, or from null, it prefetches nothing.
class PassPrefetch {
 public:
  PassPrefetch() = default;
  PassPrefetch(const void* from, int64_t bytes, int64_t units, int64_t pass, int64_t passes)
      : units_(std::max<int64_t>(units, 1)) {
    if (!from) return;
    lines_ = ((bytes + 63) / 64 + passes - 1) / passes;
    at_ = static_cast<const char*>(from) + pass * lines_ * 64;
  }
  __attribute__((always_inline)) inline void step() {
    due_ += lines_;
    for (; due_ >= units_; due_ -= units_, at_ += 64) prefetch_l2(at_);
  }

 private:
  const char* at_ = nullptr;
  int64_t lines_ = 0, units_ = 1, due_ = 0;
};

// The prefetch of pass `pass` of `passes` over a panel read from memory (`bytes` at `panel`), `units`
// steps a pass. One pass streams the panel itself, kAheadBytes ahead of its loads. More passes (more rows
// than a pass holds) find the panel in L2, as the passes over the panel before it prefetched it, and each
// prefetches its share of the next panel (past a thread's last panel a prefetch is only a wasted hint,
// never a fault): so the memory keeps streaming while every pass computes. Prefetching in the first pass
// alone left it idle through the others: the bf16 dot loops took 12.5-12.7 ms for SmolLM2-135M's 121
// linears at 32 rows, 10.1-10.3 ms with this (AMD Zen 5, benchmarks/panel_matmul.py, docs/history/benchmarks.md).
// `filled`: the passes read a copy of the panel (widened or dequantized into a buffer) whose filling
// streamed it, so one pass prefetches nothing.
inline PassPrefetch panel_prefetch(const void* panel, int64_t bytes, int64_t units, int64_t pass, int64_t passes,
                                   bool filled = false) {
  const char* p = static_cast<const char*>(panel);
  if (passes == 1) return filled ? PassPrefetch() : PassPrefetch(p + kAheadBytes, bytes, units, 0, 1);
  return PassPrefetch(p + bytes, bytes, units, pass, passes);
}

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

// Calls f(std::integral_constant<int, m>{}) with m = rows (1 to 8; larger counts take 8): the row count
// of an unrolled pass as a compile-time constant.
template <typename F>
inline void with_rows(int64_t rows, const F& f) {
  switch (rows) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

// The same for passes of up to 4 rows (the int8-activation panels: two accumulators a row, two sums).
template <typename F>
inline void with_rows4(int64_t rows, const F& f) {
  switch (rows) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    default: return f(std::integral_constant<int, 4>{});
  }
}

#if defined(TM_AVX512_BF16)
// One pass of the dot loops over a panel for M <= 8 rows: 16 accumulators, 2 per row (the panel's two
// halves of 16 columns), each row summed over k in the same order whatever M is, so a row's result does
// not depend on the rows beside it (seeded sampling stays reproducible in any batch).
// pair(kp, v0, v1) gives the panel's k pair kp as bf16 (columns 0-15, 16-31): loaded as stored (bf16
// panels) or widened from one-byte codes (panel_f8.cpp), so every caller shares these sums and their
// order. Inlined and unrolled on purpose: as a function of its own GCC mirrored the accumulators on the
// stack, 16 stores every k pair, and the loops ran 2.6x slower.
template <int M, typename Pair>
__attribute__((always_inline)) inline void dot_pass(const at::BFloat16* x, int64_t xs, int64_t pairs, float* c,
                                                    const Pair& pair) {
  __m512 acc[M][2];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < pairs; ++kp) {
    __m512bh v0, v1;
    pair(kp, v0, v1);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      int32_t xp;  // the row's k pair, paired as the panel pairs k
      std::memcpy(&xp, x + m * xs + 2 * kp, sizeof(xp));
      const __m512bh xm = (__m512bh)_mm512_set1_epi32(xp);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xm, v0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xm, v1);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) {
    _mm512_store_ps(c + m * kCols, acc[m][0]);
    _mm512_store_ps(c + m * kCols + 16, acc[m][1]);
  }
}

// All M rows against one bf16 panel, 8 at a time (passes of 8 rows). `src` is the panel in memory the
// rows' products come from (`src_bytes` of it), for the prefetch (panel_prefetch): wp itself, or the
// panel a buffer at wp was filled from (`filled`); null for none.
inline void dot_rows(const at::BFloat16* x, int64_t xs, const at::BFloat16* wp, int64_t pairs, float* c, int64_t M,
                     const void* src, int64_t src_bytes, bool filled) {
  const int64_t passes = (M + 7) / 8;
  for (int64_t m0 = 0, g = 0; m0 < M; m0 += 8, ++g) {
    PassPrefetch ahead = src ? panel_prefetch(src, src_bytes, pairs, g, passes, filled) : PassPrefetch();
    auto pair = [&](int64_t kp, __m512bh& v0, __m512bh& v1) {
      ahead.step();
      v0 = (__m512bh)_mm512_loadu_si512(wp + kp * kPairRow);
      v1 = (__m512bh)_mm512_loadu_si512(wp + kp * kPairRow + 32);
    };
    with_rows(M - m0, [&](auto rows) { dot_pass<decltype(rows)::value>(x + m0 * xs, xs, pairs, c + m0 * kCols, pair); });
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

constexpr int64_t kSweepRows = 256;  // rows a sweep of the weights (256 x 1536 bf16: 768 KB, in a 1 MB L2)

// f(r0, rows) for each sweep of up to kSweepRows rows from row r0: a kernel reads all its weights once a
// sweep, the sweep's rows staying in L2 while the weights stream, so that any number of rows (a prompt's
// chunk as well as a decode step) runs on the panels, and no second copy of the weights is needed for
// big steps.
template <typename F>
inline void for_each_sweep(int64_t M, const F& f) {
  for (int64_t r0 = 0; r0 < M; r0 += kSweepRows) f(r0, std::min(kSweepRows, M - r0));
}

// Every panel of an N-column output for M rows, kSweepRows rows a sweep of the weights and passes of
// up to 4 rows (the group panels: panel_q4.cpp, panel_g8.cpp): pass(four, r, wp, c, ahead) with `four`
// the pass's row count as a compile-time constant (with_rows4), r its first row, wp the panel's bytes
// (panel_bytes from w), c the pass's rows of the panel's float32 output, and `ahead` the pass's prefetch
// (panel_prefetch), stepped once a group of the panel's `groups`.
template <typename T, typename Pass>
void sweep_rows4(int64_t N, int64_t M, int64_t grain, const uint8_t* w, int64_t panel_bytes, int64_t groups, T* y,
                 const Pass& pass) {
  for_each_sweep(M, [&](int64_t r0, int64_t rows) {
    const int64_t passes = (rows + 3) / 4;
    for_each_panel(N, rows, grain, y + r0 * N, [&](int64_t p, float* c) {
      const uint8_t* wp = w + p * panel_bytes;
      for (int64_t m0 = 0, g = 0; m0 < rows; m0 += 4, ++g) {
        PassPrefetch ahead = panel_prefetch(wp, panel_bytes, groups, g, passes);
        with_rows4(rows - m0, [&](auto four) { pass(four, r0 + m0, wp, c + m0 * kCols, ahead); });
      }
    });
  });
}

}  // namespace panels
