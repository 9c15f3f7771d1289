// 4-bit weights (quantization="int4"), y[M, N] = x[M, K] @ W^T, with W stored as panels of 32 output
// columns like the bf16 panel matmul's (panel_matmul.cpp), so a thread's share is one contiguous stream
// read once, with the same software prefetch into L2 (panels::panel_prefetch).
//
// The format is a Q4_0/Q4_1 GGUF block's: groups of 32 k per column, w = q * scale + lo, q in 0..15. Per
// panel and group: 8 k quads of 64 bytes, byte 4j + t holding the code of column j (low nibble) and of
// column 16 + j (high nibble) at k = 4 * quad + t; then the group's 32 scales and 32 minima in float16
// (as a Q4_1 block holds them, so its weights come back exactly; bfloat16's 8 bits cost +0.33 points of perplexity):
// 640 bytes for 1024 weights, 5 bits a weight, as in Q4_1. Weights whose minimum is -8 scale in every
// group (a Q4_0 block's, w = (q - 8) scale) leave the minima out: 576 bytes, 4.5 bits a weight as in
// Q4_0, and one stream 10% shorter for a step that reads every weight once; the bf16-activation paths
// take the minimum as -8 scale, the value the other form would hold, so both forms give the same bits
// there (W4A8's differ: below). Built by
// models/ops.py (q4_pack) with plain torch ops. One AND and one shift split a quad into the two halves' codes, one byte a code, four k of a
// column in each 32-bit lane: the layout of vpdpbusd; a lane's two 16-bit words give vdpbf16ps's pairs.
//
// For any number of rows (AVX512-BF16 builds only, which have VNNI), so the model needs no bf16 copy of
// these weights; rows are taken 256 at a time (they stay in L2 while the weights stream):
// - steps of up to `exact_rows` rows (quantization="int4", W4A16): the activations as they are, in bf16.
//   - Up to 16 rows each code becomes the bf16 number 128 + q by one vpternlogd (its nibble OR-ed into
//     128's mantissa), and vdpbf16ps multiplies those by the row's x values paired the same way: exact
//     products, float32 sums per group, then y += scale * sum(x (128 + q)) + (lo - 128 scale) * sum(x).
//   - Above, where redoing that per 4 rows and the per-group scaling cost most (0.70-0.76x the bf16 dot
//     loops at 32-256 rows on AMD Zen 4), each panel is dequantized once a 256-row sweep into a bf16
//     panel in L2, w =
//     q * scale + lo rounded to bf16 (the weights a dequantized bf16 copy would hold), and the bf16 dot
//     loops run over it: 0.84-0.89x the bf16 model's linears there (the dequantization is the rest).
// - steps above exact_rows (int4_activations="int8", W4A8: above 2 rows): the activations quantized to int8 per row
//   and group of 32 k (one float32 scale each, the block of a Q8_0 tensor, which is what llama.cpp
//   multiplies its Q4 weights by), and vpdpbusd (64 multiply-adds an instruction, twice vdpbf16ps's)
//   sums the weight codes (unsigned) times the activation codes (signed) exactly in int32, per group;
//   y += scale * x_scale * sum + lo * x_scale * sum(x codes): the weights times the rounded activations,
//   as llama.cpp's Q4_1 x Q8_1 product. 1.0-1.3x the bf16 model's linears at 5-512 rows on Zen 4 (head
//   included), for a small accuracy cost (+0.16% perplexity against W4A16's +0.04%; docs/history/benchmarks.md).
//   Without minima the int32 sums start at -8 x the row's code sum, so they end as sum(x codes (q - 8))
//   and y += scale * x_scale * sum: one scaling a group rather than two terms, as llama.cpp's Q4_0 x
//   Q8_0, and 1.08-1.11x faster at 8-128 rows on Zen 4 (the minima's term was a tenth of the arithmetic).
// Every path sums each row in an order that does not depend on the other rows, so a row's result is the
// same in any step that takes the same path (1-16 rows, 17 or more; above exact_rows with int8).
#include "tensor.h"
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "group_quant.h"
#include "panels.h"

namespace {

using panels::kAheadBytes;
using panels::kCols;
using panels::prefetch_l2;

constexpr int64_t kGroup = 32;                              // k per scale
constexpr int64_t kQuadBytes = kCols * 4 / 2;               // one k quad of a panel's codes: 64 bytes
constexpr int64_t kQuads = kGroup / 4;                      // quads in a group
constexpr int64_t kCodeBytes = kQuads * kQuadBytes;         // 512
// A group's bytes: codes and float16 scales, then (unless symmetric) float16 minima: 640, or 576.
template <bool Sym>
constexpr int64_t kGroupBytes = kCodeBytes + (Sym ? 1 : 2) * kCols * 2;
constexpr int64_t kDequantRows = 16;  // above: the panel dequantized to bf16 once, the dot loops over it

using bf16 = at::BFloat16;

#if defined(TM_AVX512_BF16)
// 16 float16 values (a group's scales or minima) as float32: exact.
static inline __m512 f16x16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The group's ten (symmetric: nine) cache lines, kAheadBytes ahead (dequantize_panel, which streams the
// panel from memory; the passes take panels::panel_prefetch's).
template <bool Sym>
static inline void prefetch_group(const uint8_t* wg) {
#pragma GCC unroll 10
  for (int64_t i = 0; i < kGroupBytes<Sym>; i += 64) prefetch_l2(wg + kAheadBytes + i);
}

// A group's scales and minima for columns 0-15 and 16-31, as float32; symmetric, the minima are -8
// scale (exact: a power of two times a float16).
template <bool Sym>
static inline void group_scales(const uint8_t* wg, __m512& s0, __m512& s1, __m512& lo0, __m512& lo1) {
  const uint16_t* sc = reinterpret_cast<const uint16_t*>(wg + kCodeBytes);
  s0 = f16x16(sc);
  s1 = f16x16(sc + 16);
  if constexpr (Sym) {
    const __m512 minus8 = _mm512_set1_ps(-8.f);
    lo0 = _mm512_mul_ps(s0, minus8);
    lo1 = _mm512_mul_ps(s1, minus8);
  } else {
    lo0 = f16x16(sc + 32);
    lo1 = f16x16(sc + 48);
  }
}

// The codes of one 16-bit word's low nibble (after the shift) as the bf16 number 128 + q: 0x4300 is 128,
// whose last mantissa bit is worth 1, so OR-ing q (0..15) into the mantissa adds it. One vpternlogd:
// (v & 0x000F) | 0x4300 in every word.
static inline __m512bh q4_words(__m512i v, __m512i nibble, __m512i bias) {
  return (__m512bh)_mm512_ternarylogic_epi32(v, nibble, bias, 0xEA);  // (A & B) | C
}

// Up to 4 bf16 rows against one panel. x: the rows with each quad's values reordered (x0, x2, x1, x3), as
// 32-bit pairs, so that pair 2q is (x0, x2) and 2q + 1 is (x1, x3), matching the words' lanes. The
// products are x (128 + q), exact in float32; the 128 sum(x) they carry comes off with the minimum's
// term: y += scale * sum(x (128 + q)) + (lo - 128 scale) * sum(x).
template <bool Sym, int M>
__attribute__((always_inline)) inline void exact_panel(const uint32_t* x, int64_t xs, const float* xsum,
                                                       int64_t groups, const uint8_t* wp, float* c,
                                                       panels::PassPrefetch& ahead) {
  const __m512i nibble = _mm512_set1_epi32(0x000F000F), bias = _mm512_set1_epi32(0x43004300);
  __m512 y[M][2];
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) y[m][0] = y[m][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = wp + g * kGroupBytes<Sym>;
    ahead.step();
    __m512 acc[M][2];
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int64_t q = 0; q < kQuads; ++q) {
      // A lane's words hold bytes (0, 1) and (2, 3): their low nibbles are columns 0-15 at k0 and k2, the
      // nibbles 4, 8 and 12 bits up columns 16-31 at k0 and k2, columns 0-15 at k1 and k3, columns 16-31
      // at k1 and k3.
      const __m512i v = _mm512_loadu_si512(wg + q * kQuadBytes);
      const __m512bh a0 = q4_words(v, nibble, bias), a1 = q4_words(_mm512_srli_epi16(v, 4), nibble, bias);
      const __m512bh b0 = q4_words(_mm512_srli_epi16(v, 8), nibble, bias);
      const __m512bh b1 = q4_words(_mm512_srli_epi16(v, 12), nibble, bias);
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) {
        const uint32_t* xq = x + m * xs + g * (kGroup / 2) + 2 * q;
        const __m512bh xa = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(xq[0]));
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(xq[1]));
        acc[m][0] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[m][0], xa, a0), xb, b0);
        acc[m][1] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[m][1], xa, a1), xb, b1);
      }
    }
    __m512 s0, s1, lo0, lo1;
    group_scales<Sym>(wg, s0, s1, lo0, lo1);
    const __m512 minus128 = _mm512_set1_ps(-128.f);
    lo0 = _mm512_fmadd_ps(s0, minus128, lo0);
    lo1 = _mm512_fmadd_ps(s1, minus128, lo1);
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      const __m512 xg = _mm512_set1_ps(xsum[m * groups + g]);
      y[m][0] = _mm512_fmadd_ps(acc[m][0], s0, _mm512_fmadd_ps(lo0, xg, y[m][0]));
      y[m][1] = _mm512_fmadd_ps(acc[m][1], s1, _mm512_fmadd_ps(lo1, xg, y[m][1]));
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) {
    _mm512_store_ps(c + m * kCols, y[m][0]);
    _mm512_store_ps(c + m * kCols + 16, y[m][1]);
  }
}

// Up to 4 rows of int8 activation codes (xq, rows K apart; xa: their scales; xsum: the sums of the values
// the codes stand for; both per row and group) against one panel. `ahead`: the pass's prefetch
// (panels::panel_prefetch), a step a group.
template <bool Sym, int M>
__attribute__((always_inline)) inline void int8_pass(const int8_t* xq, int64_t K, const float* xa, const float* xsum,
                                                     const int32_t* isum, int64_t groups, const uint8_t* wp, float* c,
                                                     panels::PassPrefetch& ahead) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 y[M][2];
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) y[m][0] = y[m][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = wp + g * kGroupBytes<Sym>;
    ahead.step();
    __m512i acc[M][2];
    // Without minima (Sym) the weight is (q - 8) scale: the sums start at -8 x the row's code sum, so they
    // end as sum(codes x (q - 8)), exact in int32, and the group needs one scaling, not a minimum's term.
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m)
      acc[m][0] = acc[m][1] = Sym ? _mm512_set1_epi32(-8 * isum[m * groups + g]) : _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int64_t q = 0; q < kQuads; ++q) {
      const __m512i v = _mm512_loadu_si512(wg + q * kQuadBytes);
      const __m512i c0 = _mm512_and_si512(v, low), c1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) {
        int32_t quad;  // the row's four codes at this quad's k
        std::memcpy(&quad, xq + m * K + g * kGroup + 4 * q, sizeof(quad));
        const __m512i xm = _mm512_set1_epi32(quad);
        // Unsigned weight codes (0..15) times signed activation codes (-127..127): |sum| < 2^16, exact.
        acc[m][0] = _mm512_dpbusd_epi32(acc[m][0], c0, xm);
        acc[m][1] = _mm512_dpbusd_epi32(acc[m][1], c1, xm);
      }
    }
    if constexpr (Sym) {
      const uint16_t* sc = reinterpret_cast<const uint16_t*>(wg + kCodeBytes);
      const __m512 s0 = f16x16(sc), s1 = f16x16(sc + 16);
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) {
        const __m512 r = _mm512_set1_ps(xa[m * groups + g]);
        y[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][0]), _mm512_mul_ps(s0, r), y[m][0]);
        y[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][1]), _mm512_mul_ps(s1, r), y[m][1]);
      }
    } else {
      __m512 s0, s1, lo0, lo1;
      group_scales<Sym>(wg, s0, s1, lo0, lo1);
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) {
        const __m512 r = _mm512_set1_ps(xa[m * groups + g]), xg = _mm512_set1_ps(xsum[m * groups + g]);
        const __m512 p0 = _mm512_cvtepi32_ps(acc[m][0]), p1 = _mm512_cvtepi32_ps(acc[m][1]);
        y[m][0] = _mm512_fmadd_ps(p0, _mm512_mul_ps(s0, r), _mm512_fmadd_ps(lo0, xg, y[m][0]));
        y[m][1] = _mm512_fmadd_ps(p1, _mm512_mul_ps(s1, r), _mm512_fmadd_ps(lo1, xg, y[m][1]));
      }
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) {
    _mm512_store_ps(c + m * kCols, y[m][0]);
    _mm512_store_ps(c + m * kCols + 16, y[m][1]);
  }
}

// One panel's weights dequantized, w = q * scale + lo rounded to bf16, into `out` in the bf16 panels'
// layout (panel_matmul.cpp: per k pair, columns 0-15 then 16-31, each column's two k side by side), for
// panels::dot_rows. A code becomes the float32 128 + q by one vpternlogd (its nibble moved to bits 16-19
// and OR-ed into 128's mantissa, where bit 16 is worth 1), then w = (128 + q) * scale + (lo - 128 scale).
template <bool Sym>
inline void dequantize_panel(const uint8_t* wp, int64_t groups, bf16* out) {
  const __m512i nibble = _mm512_set1_epi32(0x000F0000), bias = _mm512_set1_epi32(0x43000000);
  const __m512 minus128 = _mm512_set1_ps(-128.f);
  alignas(64) static const uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = wp + g * kGroupBytes<Sym>;
    prefetch_group<Sym>(wg);
    __m512 s0, s1, lo0, lo1;
    group_scales<Sym>(wg, s0, s1, lo0, lo1);
    lo0 = _mm512_fmadd_ps(s0, minus128, lo0);
    lo1 = _mm512_fmadd_ps(s1, minus128, lo1);
#pragma GCC unroll 8
    for (int64_t q = 0; q < kQuads; ++q) {
      const __m512i v = _mm512_loadu_si512(wg + q * kQuadBytes);
      // Column j's code at k = 4q + t sits at bit 8t of lane j (columns 0-15) or 8t + 4 (16-31).
      auto w = [&](__m512i moved, __m512 s, __m512 lo) {
        return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_ternarylogic_epi32(moved, nibble, bias, 0xEA)), s, lo);
      };
      const __m512 a0 = w(_mm512_slli_epi32(v, 16), s0, lo0), a1 = w(_mm512_slli_epi32(v, 8), s0, lo0);
      const __m512 a2 = w(v, s0, lo0), a3 = w(_mm512_srli_epi32(v, 8), s0, lo0);
      const __m512 b0 = w(_mm512_slli_epi32(v, 12), s1, lo1), b1 = w(_mm512_slli_epi32(v, 4), s1, lo1);
      const __m512 b2 = w(_mm512_srli_epi32(v, 4), s1, lo1), b3 = w(_mm512_srli_epi32(v, 12), s1, lo1);
      bf16* o = out + (g * (kGroup / 2) + 2 * q) * panels::kPairRow;
      auto store = [&](bf16* dst, __m512 even, __m512 odd) {
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, even);  // 16 even k, then 16 odd k
        _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(interleave, both));
      };
      store(o, a0, a1);
      store(o + 32, b0, b1);
      store(o + panels::kPairRow, a2, a3);
      store(o + panels::kPairRow + 32, b2, b3);
    }
  }
}

// Per row and group of 32, for the bf16 path: the sum of the bf16 values in float32. The sums go 16
// lanes wide, then across the lanes: a fixed order, so a row's sums do not depend on the
// rows beside it (summed one value after another they were a chain of dependent adds).
void group_sums(const bf16* x, int64_t xs, int64_t M, int64_t K, float* xsum) {
  const int64_t groups = K / kGroup;
  auto f32x16 = [](const bf16* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  };
  at::parallel_for(0, M, std::max<int64_t>(1, 65536 / K), [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m)
      for (int64_t g = 0; g < groups; ++g) {
        const bf16* xg = x + m * xs + g * kGroup;
        xsum[m * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(f32x16(xg), f32x16(xg + 16)));
      }
  });
}

// The W4A8 path's activations: group_quant.h's codes, and each group's sum of the values the codes
// stand for, a * sum(codes), as Q8_1 blocks carry it for llama.cpp's Q4_1 products: then the product is
// exactly that of the rounded activations with the weights, sum((q * scale + lo) * a * code). Taking
// the exact bf16 sum for the minimum's term instead leaves the rounding errors meeting q * scale, with
// q 0..15 (mean ~7.5), rather than the weight itself, which Q4 centres on zero: ~3x the error's variance
// (+1.5% perplexity against +0.4% for SmolLM2-135M, docs/history/benchmarks.md, sixteenth sitting).
// Panels without minima take the codes' integer sums instead (int8_pass).
void quantize_groups(const bf16* x, int64_t xs, int64_t M, int64_t K, int8_t* xq, float* xa, float* xsum,
                     int32_t* sums) {
  group_quant::quantize_groups(x, xs, M, K, xq, xa, sums);
  for (int64_t i = 0; i < M * (K / kGroup); ++i) xsum[i] = xa[i] * static_cast<float>(sums[i]);
}

// y = x @ W^T over panels of one form (Sym: without minima), steps as q4_matmul's header says.
template <bool Sym>
void q4_run(const at::Tensor& x, const uint8_t* w, int64_t n, int64_t exact_rows, bf16* yp) {
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t groups = K / kGroup, panel_bytes = groups * kGroupBytes<Sym>;
  const int64_t grain = std::max<int64_t>(1, 65536 / panel_bytes);  // ~64 KB of codes a task at least
  const bf16* xp = x.data_ptr<bf16>();
  if (M <= exact_rows && M > kDequantRows) {
    for (int64_t r0 = 0; r0 < M; r0 += panels::kSweepRows) {
      const int64_t rows = std::min(panels::kSweepRows, M - r0);
      panels::for_each_panel(n, rows, grain, yp + r0 * n, [&](int64_t p, float* c) {
        thread_local std::vector<bf16> buf;
        buf.resize(K * kCols);
        dequantize_panel<Sym>(w + p * panel_bytes, groups, buf.data());
        panels::dot_rows(xp + r0 * x.stride(0), x.stride(0), buf.data(), K / 2, c, rows, w + p * panel_bytes,
                         panel_bytes, true);
      });
    }
    return;
  }
  // The minima's term needs each row's sum per group (the dequantized path above carries it in w): of the
  // bf16 values here, of the values the int8 codes stand for below (quantize_groups).
  std::vector<float> xsum(M * groups);
  if (M <= exact_rows) {
    group_sums(xp, x.stride(0), M, K, xsum.data());
    // Each quad's values as (x0, x2), (x1, x3): the pairs the lookups give per lane.
    std::vector<uint32_t> pairs(M * K / 2);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; k += 4) {
        const uint16_t* s = reinterpret_cast<const uint16_t*>(xp + m * x.stride(0) + k);
        pairs[(m * K + k) / 2] = s[0] | static_cast<uint32_t>(s[2]) << 16;
        pairs[(m * K + k) / 2 + 1] = s[1] | static_cast<uint32_t>(s[3]) << 16;
      }
    panels::sweep_rows4(n, M, grain, w, panel_bytes, groups, yp,
                        [&](auto four, int64_t r, const uint8_t* wp, float* c, panels::PassPrefetch& ahead) {
      exact_panel<Sym, decltype(four)::value>(pairs.data() + r * K / 2, K / 2, xsum.data() + r * groups, groups, wp,
                                              c, ahead);
    });
    return;
  }
  std::vector<int8_t> xq(M * K);
  std::vector<float> xa(M * groups);
  std::vector<int32_t> isum(M * groups);
  quantize_groups(xp, x.stride(0), M, K, xq.data(), xa.data(), xsum.data(), isum.data());
  panels::sweep_rows4(n, M, grain, w, panel_bytes, groups, yp,
                      [&](auto four, int64_t r, const uint8_t* wp, float* c, panels::PassPrefetch& ahead) {
    int8_pass<Sym, decltype(four)::value>(xq.data() + r * K, K, xa.data() + r * groups, xsum.data() + r * groups,
                                          isum.data() + r * groups, groups, wp, c, ahead);
  });
}
#endif

}  // namespace

// x: [M, K] bfloat16 (rows may be strided), panels: [ceil(N/32), K/32, 640] uint8, or 576 without minima
// (q4_pack), n: N. Steps of up to exact_rows rows with bf16 activations, larger ones with int8
// activations (header).
at::Tensor q4_matmul(at::Tensor x, at::Tensor packed, int64_t n, int64_t exact_rows) {
  const bool sym = packed.dim() == 3 && packed.size(2) == kGroupBytes<true>;
  group_quant::check_panels(x, packed, n, sym ? kGroupBytes<true> : kGroupBytes<false>, "the 4-bit panel loops",
                            "q4_pack");
  const int64_t M = x.size(0);
  auto y = at::empty({M, n}, x.options());
  if (M == 0) return y;
#if defined(TM_AVX512_BF16)
  if (sym)
    q4_run<true>(x, packed.data_ptr<uint8_t>(), n, exact_rows, y.data_ptr<bf16>());
  else
    q4_run<false>(x, packed.data_ptr<uint8_t>(), n, exact_rows, y.data_ptr<bf16>());
#endif
  return y;
}
