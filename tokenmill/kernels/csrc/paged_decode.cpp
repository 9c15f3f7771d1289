// Paged decode attention for CPUs: one query token per sequence attends to its cached keys/values,
// read in place through its block table (no gather copy), with the softmax in float32.
// The query heads of a GQA group share each K/V read.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec_math.h"

// Ask for the cache lines of [p, p + bytes) ahead of use.
static inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
}

// nh query heads (rows q_stride_h apart) as float32, times the softmax scale, into qf [nh, D].
template <typename T>
static void load_scaled_q(const T* q, int64_t q_stride_h, int64_t nh, int64_t D, float scale, float* qf) {
  for (int64_t h = 0; h < nh; ++h) {
    load_f32(q + h * q_stride_h, qf + h * D, D);
    for (int64_t d = 0; d < D; ++d) qf[h * D + d] *= scale;
  }
}

// Each of the nh rows of L scores becomes exp(score - row max) in place; inv[h] = 1 / the row's sum
// (the normalization is applied to the value sums, once per head rather than once per token).
static void softmax_rows(float* s, int64_t nh, int64_t L, float* inv) {
  for (int64_t h = 0; h < nh; ++h) {
    float* sh = s + h * L;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < L; ++t) mx = std::max(mx, sh[t]);
    float l = 0.f;
#pragma omp simd reduction(+ : l)
    for (int64_t t = 0; t < L; ++t) {
      sh[t] = exp_approx(sh[t] - mx);
      l += sh[t];
    }
    inv[h] = l > 0.f ? 1.f / l : 0.f;
  }
}

// Per sequence, three passes, each a plain loop the compiler vectorizes: scores of every query head
// against every cached key, a softmax over each score row, then the value sum. A sequence's blocks are
// read whole (all kv heads at once, contiguous), and while one block is read the next one is
// prefetched a token row at a time: the blocks of a sequence lie anywhere in the pool and hardware
// prefetchers do not follow a block table. At 32 sequences of ~175 tokens this reads KV at ~8 GB/s,
// against ~5 GB/s for one pass per (sequence, kv head) with an online softmax.
template <typename T>
static void decode_kernel(
    const T* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* ctx, T* out,
    int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t bs, int64_t max_blocks, float scale,
    int64_t q_stride_b, int64_t q_stride_h) {
  const int64_t G = H / Hkv, W = Hkv * D;  // W: one token's keys (or values), all kv heads
  // A work item is one sequence and a range of its kv heads: all of them when there are sequences
  // enough to keep every thread busy, else one each (a single long sequence still uses every core).
  const int64_t parts = B >= 2 * at::get_num_threads() ? 1 : Hkv;
  const int64_t heads_per_part = Hkv / parts;
  at::parallel_for(0, B * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * D), acc(H * D), row(W), s;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / parts, g0 = (item % parts) * heads_per_part;
      const int64_t off = g0 * D, w = heads_per_part * D;  // this item's slice of a token row
      const int64_t h0 = g0 * G, nh = heads_per_part * G;  // and its query heads
      const int64_t L = ctx[b];
      const int64_t* table = bt + b * max_blocks;
      const int64_t nblocks = (L + bs - 1) / bs;
      load_scaled_q(q + b * q_stride_b + h0 * q_stride_h, q_stride_h, nh, D, scale, qf.data());
      s.resize(nh * L);
      for (int64_t i = 0; i < std::min(bs, L); ++i) prefetch(kc + (table[0] * bs + i) * W + off, w * sizeof(T));
      for (int64_t blk = 0; blk < nblocks; ++blk) {
        const T* next = (blk + 1 < nblocks ? kc + table[blk + 1] * bs * W : vc + table[0] * bs * W) + off;
        const T* base = kc + table[blk] * bs * W + off;
        const int64_t t0 = blk * bs, n = std::min(bs, L - t0);
        for (int64_t i = 0; i < n; ++i) {
          prefetch(next + i * W, w * sizeof(T));
          load_f32(base + i * W, row.data(), w);
          for (int64_t h = 0; h < nh; ++h) {
            const float* qh = &qf[h * D];
            const float* kh = &row[(h / G) * D];
            float dot = 0.f;
            // omp simd: lets the compiler reorder this float sum into vector lanes (no -ffast-math).
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qh[d] * kh[d];
            s[h * L + t0 + i] = dot;
          }
        }
      }
      float inv[256];
      softmax_rows(s.data(), nh, L, inv);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t blk = 0; blk < nblocks; ++blk) {
        const T* next = blk + 1 < nblocks ? vc + table[blk + 1] * bs * W + off : nullptr;
        const T* base = vc + table[blk] * bs * W + off;
        const int64_t t0 = blk * bs, n = std::min(bs, L - t0);
        for (int64_t i = 0; i < n; ++i) {
          if (next) prefetch(next + i * W, w * sizeof(T));
          load_f32(base + i * W, row.data(), w);
          for (int64_t h = 0; h < nh; ++h) {
            float* a = &acc[h * D];
            const float* vh = &row[(h / G) * D];
            const float p = s[h * L + t0 + i];
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += p * vh[d];
          }
        }
      }
      for (int64_t h = 0; h < nh; ++h) {
        for (int64_t d = 0; d < D; ++d) acc[h * D + d] *= inv[h];
      }
      store_f32(acc.data(), out + (b * H + h0) * D, nh * D);
    }
  });
}

#if defined(__AVX512F__)
#include <immintrin.h>

// Sixteen values of T as float32 in one register.
template <typename T>
static inline __m512 ld16(const T* p);
template <>
inline __m512 ld16<float>(const float* p) {
  return _mm512_loadu_ps(p);
}
template <>
inline __m512 ld16<c10::BFloat16>(const c10::BFloat16* p) {  // bfloat16 is a float32's top half
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
template <>
inline __m512 ld16<c10::Half>(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// r[i] = sum of v[i]'s sixteen lanes, for sixteen vectors at once: ~3 instructions a sum where one
// horizontal sum alone takes ~8. Pairs are folded within 128-bit lanes (unpack ps, then pd), then the
// four lanes across vectors (shuffle_f32x4), so that vector 4m + j ends in lane 4m + j.
static inline __m512 hsum16(const __m512* v) {
  __m512 a[8], b[4];
  for (int k = 0; k < 8; ++k)
    a[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {
    const __m512d x = _mm512_castps_pd(a[2 * k]), y = _mm512_castps_pd(a[2 * k + 1]);
    b[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// The same three passes as decode_kernel, written for AVX-512 registers with the head size fixed
// (NC registers of 16 floats a head): the query heads of a kv head are held in registers, each key
// row is converted once for all of them, sixteen tokens' dot products are summed in one hsum16, and
// the value sums accumulate in registers over a block. The plain loops above measured ~12 GB/s with the
// cache hot (compute-bound: one horizontal sum per head and token, value accumulators in memory).
template <typename T, int NC>
static void decode_kernel_avx512(
    const T* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* ctx, T* out,
    int64_t B, int64_t H, int64_t Hkv, int64_t bs, int64_t max_blocks, float scale,
    int64_t q_stride_b, int64_t q_stride_h) {
  constexpr int64_t D = NC * 16;
  constexpr int MAXH = 16 / NC;  // query heads whose registers fit beside the key row's
  const int64_t G = H / Hkv, W = Hkv * D;
  const int64_t parts = B >= 2 * at::get_num_threads() ? 1 : Hkv;
  const int64_t heads_per_part = Hkv / parts;
  at::parallel_for(0, B * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * D), acc(H * D), s;
    alignas(64) __m512 part[MAXH][16];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / parts, g0 = (item % parts) * heads_per_part;
      const int64_t h0 = g0 * G, nh = heads_per_part * G;
      const int64_t L = ctx[b];
      const int64_t* table = bt + b * max_blocks;
      const int64_t nblocks = (L + bs - 1) / bs;
      load_scaled_q(q + b * q_stride_b + h0 * q_stride_h, q_stride_h, nh, D, scale, qf.data());
      s.resize(nh * L);
      // A block lies anywhere in the pool, where no hardware prefetcher looks: the next block is asked
      // for while this one is read, each kv head's slice of a token row during that head's pass, so
      // the requests are spread over the whole block's work (all of a block at once overflowed the
      // line fill buffers; a whole row per token in the first head's pass only was 10-20% slower).
      const int64_t slice = heads_per_part * D * sizeof(T);
      for (int64_t i = 0; i < std::min(bs, L); ++i) prefetch(kc + (table[0] * bs + i) * W + g0 * D, slice);
      for (int64_t blk = 0; blk < nblocks; ++blk) {
        const int64_t t0 = blk * bs, n = std::min(bs, L - t0);
        const T* next = (blk + 1 < nblocks ? kc + table[blk + 1] * bs * W : vc + table[0] * bs * W) + g0 * D;
        for (int64_t g = 0; g < heads_per_part; ++g) {
          const T* base = kc + table[blk] * bs * W + (g0 + g) * D;
          for (int64_t hc = 0; hc < G; hc += MAXH) {
            const int64_t m = std::min<int64_t>(MAXH, G - hc);
            const float* qg = &qf[(g * G + hc) * D];
            __m512 qv[MAXH][NC];
            for (int hh = 0; hh < MAXH; ++hh)
              for (int c = 0; c < NC; ++c) qv[hh][c] = hh < m ? _mm512_loadu_ps(qg + hh * D + c * 16) : _mm512_setzero_ps();
            for (int64_t i0 = 0; i0 < n; i0 += 16) {
              const int64_t cnt = std::min<int64_t>(16, n - i0);
              for (int64_t i = 0; i < 16; ++i) {
                if (i >= cnt) {
                  for (int hh = 0; hh < MAXH; ++hh) part[hh][i] = _mm512_setzero_ps();
                  continue;
                }
                if (hc == 0) prefetch(next + (i0 + i) * W + g * D, D * sizeof(T));
                __m512 k[NC];
                for (int c = 0; c < NC; ++c) k[c] = ld16(base + (i0 + i) * W + c * 16);
                for (int hh = 0; hh < MAXH; ++hh) {
                  __m512 a = _mm512_mul_ps(qv[hh][0], k[0]);
                  for (int c = 1; c < NC; ++c) a = _mm512_fmadd_ps(qv[hh][c], k[c], a);
                  part[hh][i] = a;
                }
              }
              const __mmask16 keep = static_cast<__mmask16>((1u << cnt) - 1u);
              for (int hh = 0; hh < m; ++hh)
                _mm512_mask_storeu_ps(&s[(g * G + hc + hh) * L + t0 + i0], keep, hsum16(part[hh]));
            }
          }
        }
      }
      float inv[256];
      softmax_rows(s.data(), nh, L, inv);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t blk = 0; blk < nblocks; ++blk) {
        const int64_t t0 = blk * bs, n = std::min(bs, L - t0);
        const T* next = blk + 1 < nblocks ? vc + table[blk + 1] * bs * W + g0 * D : nullptr;
        for (int64_t g = 0; g < heads_per_part; ++g) {
          const T* base = vc + table[blk] * bs * W + (g0 + g) * D;
          for (int64_t hc = 0; hc < G; hc += MAXH) {
            const int64_t m = std::min<int64_t>(MAXH, G - hc);
            float* ag = &acc[(g * G + hc) * D];
            const float* sg = &s[(g * G + hc) * L + t0];
            __m512 av[MAXH][NC];
            for (int hh = 0; hh < MAXH; ++hh)
              for (int c = 0; c < NC; ++c) av[hh][c] = hh < m ? _mm512_loadu_ps(ag + hh * D + c * 16) : _mm512_setzero_ps();
            for (int64_t i = 0; i < n; ++i) {
              if (next && hc == 0) prefetch(next + i * W + g * D, D * sizeof(T));
              __m512 v[NC];
              for (int c = 0; c < NC; ++c) v[c] = ld16(base + i * W + c * 16);
              for (int hh = 0; hh < MAXH; ++hh) {
                if (hh >= m) break;
                const __m512 p = _mm512_set1_ps(sg[hh * L + i]);
                for (int c = 0; c < NC; ++c) av[hh][c] = _mm512_fmadd_ps(p, v[c], av[hh][c]);
              }
            }
            for (int hh = 0; hh < m; ++hh)
              for (int c = 0; c < NC; ++c) _mm512_storeu_ps(ag + hh * D + c * 16, av[hh][c]);
          }
        }
      }
      for (int64_t h = 0; h < nh; ++h) {
        for (int64_t d = 0; d < D; ++d) acc[h * D + d] *= inv[h];
      }
      store_f32(acc.data(), out + (b * H + h0) * D, nh * D);
    }
  });
}
#endif

// q: [B, H, D] (rows may be strided), caches: [num_blocks, block_size, Hkv, D] contiguous,
// block_tables: [B, max_blocks] int64, context_lens: [B] int64. Returns [B, H, D].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [B, H, D] with contiguous D");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong);
  auto bt = block_tables.contiguous();
  auto ctx = context_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(H % Hkv == 0 && k_cache.size(3) == D);
  TORCH_CHECK(H <= 256, "at most 256 query heads");
  auto out = torch::empty({B, H, D}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
#if defined(__AVX512F__)
    if constexpr (!std::is_same_v<scalar_t, double>) {
      auto fast = D == 64 ? &decode_kernel_avx512<scalar_t, 4> : D == 128 ? &decode_kernel_avx512<scalar_t, 8> : nullptr;
      if (fast) {
        fast(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
             bt.data_ptr<int64_t>(), ctx.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), B, H, Hkv, bs, bt.size(1),
             static_cast<float>(scale), q.stride(0), q.stride(1));
        return;
      }
    }
#endif
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                            v_cache.data_ptr<scalar_t>(), bt.data_ptr<int64_t>(), ctx.data_ptr<int64_t>(),
                            out.data_ptr<scalar_t>(), B, H, Hkv, D, bs, bt.size(1),
                            static_cast<float>(scale), q.stride(0), q.stride(1));
  });
  return out;
}
