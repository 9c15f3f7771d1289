// Paged decode attention for CPUs: one query token per sequence attends to its cached keys/values,
// read in place through its block table (no gather copy), with the softmax in float32.
// The query heads of a GQA group share each K/V read.
#include "tensor.h"
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "kv_rows.h"
#include "vec_math.h"

// Ask for the cache lines of [p, p + bytes) ahead of use, into L2 (prefetcht1). Into L1 (prefetcht0)
// each request held one of the core's few L1 miss buffers until its line arrived, so a core had ~20
// lines in flight and read KV at ~7 GB/s whatever the prefetch distance; the L2 keeps many more in
// flight. AMD Zen 4, `benchmarks/decode_attention.py`, bf16: 64 sequences of ~300 tokens 30.5 -> 18.3
// ms a step, 32 of ~175 9.6 -> 6.3 ms, one of 2000 6.5 -> 2.7 ms; int8 16.3 -> 11.9 ms.
static inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 2);
}

// nh query heads (rows q_stride_h apart) as float32, times the softmax scale, into qf [nh, D].
template <typename T>
static void load_scaled_q(const T* q, int64_t q_stride_h, int64_t nh, int64_t D, float scale, float* qf) {
  for (int64_t h = 0; h < nh; ++h) {
    load_f32(q + h * q_stride_h, qf + h * D, D);
    for (int64_t d = 0; d < D; ++d) qf[h * D + d] *= scale;
  }
}

// body(begin, end) over the work items [0, n) (tokens(i): the tokens item i reads), one contiguous range
// per thread, cut where the tokens summed so far reach an equal share. at::parallel_for cuts by item
// count, which left one thread waiting at the barrier when its half of the batch held the longer
// sequences (offline serving mixes prompts of 32 to 512 tokens).
template <typename Tokens, typename F>
static void parallel_by_context(int64_t n, const Tokens& tokens, const F& body) {
  const int64_t T = at::get_num_threads();
  if (T <= 1 || n <= 1 || at::in_parallel_region()) {
    body(0, n);
    return;
  }
  constexpr int64_t kItemCost = 32;  // an item's fixed work (query, softmax set-up) in token units
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) total += tokens(i) + kItemCost;
  std::vector<int64_t> cuts(T + 1, n);
  cuts[0] = 0;
  int64_t acc = 0, k = 1;
  for (int64_t i = 0; i < n && k < T; ++i) {
    acc += tokens(i) + kItemCost;
    while (k < T && acc * T >= total * k) cuts[k++] = i + 1;
  }
  at::parallel_for(0, T, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
      if (cuts[t] < cuts[t + 1]) body(cuts[t], cuts[t + 1]);
  });
}

// A decode step's work items, for both kernels below: a sequence's range of kv heads (all of them when
// there are sequences enough to keep every thread busy, else one each) over a chunk of its context.
// Contexts longer than kChunkTokens are cut into chunks, each with its own softmax, merged after (the
// online softmax's rescaling, once a chunk). So a few long sequences share the threads evenly: one
// sequence of SmolLM2's 3 kv heads had split 2:1 over two threads (`benchmarks/decode_attention.py`, one
// sequence of ~2000 tokens, AMD Zen 5: 2.02-2.21 ms a step, median 2.16, against 1.61-1.99, median 1.67,
// on the AVX-512 kernel; 8 or 32 sequences unchanged). The chunks depend on the context length alone, so
// a sequence's result is the same in a batch of any size.
class StepItems {
 public:
  static constexpr int64_t kChunkTokens = 512;
  struct Item {
    int64_t b, g0, chunk, chunks, blk0, blk1, t0, t1;  // blocks [blk0, blk1) and tokens [t0, t1) of b's
  };

  StepItems(const int64_t* ctx, int64_t B, int64_t Hkv, int64_t G, int64_t D, int64_t bs)
      : parts(B >= 2 * at::get_num_threads() ? 1 : Hkv),
        heads_per_part(Hkv / parts),
        nh(heads_per_part * G),
        ctx_(ctx),
        B_(B),
        D_(D),
        bs_(bs),
        chunk_blocks_(std::max<int64_t>(1, kChunkTokens / bs)),
        stride_(nh * D + 2 * nh),
        first_(B + 1, 0) {
    bool chunked = false;
    for (int64_t b = 0; b < B; ++b) {
      first_[b + 1] = first_[b] + parts * chunks_of(b);
      chunked |= chunks_of(b) > 1;
    }
    // Not zeroed (every slot the merge reads is written first): a step of many chunked sequences would
    // otherwise clear ~1 MB a layer for nothing.
    if (chunked) partial_.reset(new float[count() * stride_]);
  }

  int64_t count() const { return first_[B_]; }

  Item locate(int64_t item) const {
    Item it;
    it.b = std::upper_bound(first_.begin(), first_.end(), item) - first_.begin() - 1;
    it.chunks = chunks_of(it.b);
    const int64_t r = item - first_[it.b], L = ctx_[it.b];
    it.g0 = (r / it.chunks) * heads_per_part;
    it.chunk = r % it.chunks;
    it.blk0 = it.chunk * chunk_blocks_;
    it.blk1 = std::min((L + bs_ - 1) / bs_, it.blk0 + chunk_blocks_);
    it.t0 = it.blk0 * bs_;
    it.t1 = std::min(L, it.blk1 * bs_);
    return it;
  }

  int64_t tokens(int64_t item) const {
    const Item it = locate(item);
    return it.t1 - it.t0;
  }

  // Where a chunk leaves its value sums (nh rows of D, before the softmax's normalization), then its
  // heads' maxima and sums (nh each), for the merge; null for a sequence of one chunk, which its kernel
  // normalizes and stores itself.
  float* partial(int64_t item, const Item& it) const { return it.chunks > 1 ? &partial_[item * stride_] : nullptr; }

  // The chunks of each chunked sequence's head ranges into out [B, H, D]: weights e^(chunk max - max) on
  // each chunk's value sums and softmax sums, then one division.
  template <typename T>
  void merge(T* out, int64_t H) const {
    if (!partial_) return;
    const int64_t D = D_, G = nh / heads_per_part;
    std::vector<float> merged(nh * D);
    for (int64_t b = 0; b < B_; ++b) {
      const int64_t nc = chunks_of(b);
      if (nc == 1) continue;
      for (int64_t pt = 0; pt < parts; ++pt) {
        const float* p0 = &partial_[(first_[b] + pt * nc) * stride_];
        const int64_t h0 = pt * heads_per_part * G;
        for (int64_t h = 0; h < nh; ++h) {
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t c = 0; c < nc; ++c) mx = std::max(mx, p0[c * stride_ + nh * D + h]);
          float l = 0.f;
          float* o = &merged[h * D];
          std::fill(o, o + D, 0.f);
          for (int64_t c = 0; c < nc; ++c) {
            const float* pc = p0 + c * stride_;
            const float w = std::exp(pc[nh * D + h] - mx);
            l += w * pc[nh * D + nh + h];
            for (int64_t d = 0; d < D; ++d) o[d] += w * pc[h * D + d];
          }
          const float inv = l > 0.f ? 1.f / l : 0.f;
          for (int64_t d = 0; d < D; ++d) o[d] *= inv;
        }
        store_f32(merged.data(), out + (b * H + h0) * D, nh * D);
      }
    }
  }

  const int64_t parts, heads_per_part, nh;  // items a sequence's kv heads split into; kv and query heads an item

 private:
  int64_t chunks_of(int64_t b) const {
    return std::max<int64_t>(1, ((ctx_[b] + bs_ - 1) / bs_ + chunk_blocks_ - 1) / chunk_blocks_);
  }

  const int64_t* ctx_;
  int64_t B_, D_, bs_, chunk_blocks_, stride_;
  std::vector<int64_t> first_;  // each sequence's first item
  std::unique_ptr<float[]> partial_;
};

// Each of the nh rows of L scores becomes exp(score - row max) in place; inv[h] = 1 / the row's sum
// (the normalization is applied to the value sums, once per head rather than once per token). With
// mx and sum (a chunk of a longer context), each row's max and sum go there too, for the merge.
static void softmax_rows(float* s, int64_t nh, int64_t L, float* inv, float* mx_out = nullptr,
                         float* sum_out = nullptr) {
  for (int64_t h = 0; h < nh; ++h) {
    float* sh = s + h * L;
    const float mx = max_of(sh, L);
    float l = 0.f;
#if defined(__AVX512F__)
    // Sixteen at a time with a masked tail: GCC's own vector loop left up to fifteen elements a row to
    // a scalar remainder, a third of this function's time at contexts of a few hundred tokens.
    const __m512 m = _mm512_set1_ps(mx);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t t = 0; t < L; t += 16) {
      const __mmask16 k = L - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (L - t)) - 1u);
      const __m512 e = exp_approx16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sh + t), m));
      _mm512_mask_storeu_ps(sh + t, k, e);
      acc = _mm512_mask_add_ps(acc, k, acc, e);
    }
    l = _mm512_reduce_add_ps(acc);
#else
#pragma omp simd reduction(+ : l)
    for (int64_t t = 0; t < L; ++t) {
      sh[t] = exp_approx(sh[t] - mx);
      l += sh[t];
    }
#endif
    inv[h] = l > 0.f ? 1.f / l : 0.f;
    if (mx_out) {
      mx_out[h] = mx;
      sum_out[h] = l;
    }
  }
}

#if defined(__AVX2__)
// r[j] = the sum of v[j]'s eight lanes, for eight vectors at once (lane j depends on v[j] alone).
static inline __m256 hsum8(const __m256* v) {
  const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}
#endif

// The scores of nh query heads (qf: their scaled rows, D apart; head h reads kv head h / G) against a
// block's n key rows (rows: n rows of w floats, the item's kv heads side by side; on AVX2 readable up
// to n rounded up to 8, finite): into s (rows L apart). On AVX2 eight tokens at a time, the eight dot
// products summed in one hsum8, where a vector loop over d alone ends each token in a horizontal sum.
static void block_scores(const float* rows, int64_t n, int64_t w, const float* qf, int64_t nh, int64_t G,
                         int64_t D, float* s, int64_t L) {
#if defined(__AVX2__)
  if (D % 8 == 0) {
    for (int64_t h = 0; h < nh; ++h) {
      const float* qh = qf + h * D;
      const float* kh = rows + (h / G) * D;
      for (int64_t i0 = 0; i0 < n; i0 += 8) {
        __m256 acc[8];
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 qv = _mm256_loadu_ps(qh + d);
          for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kh + (i0 + j) * w + d), acc[j]);
        }
        const int64_t cnt = std::min<int64_t>(8, n - i0);
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        _mm256_maskstore_ps(s + h * L + i0, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cnt)), lane),
                            hsum8(acc));
      }
    }
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t h = 0; h < nh; ++h) {
      const float* qh = qf + h * D;
      const float* kh = rows + i * w + (h / G) * D;
      float dot = 0.f;
      // omp simd: lets the compiler reorder this float sum into vector lanes (no -ffast-math).
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qh[d] * kh[d];
      s[h * L + i] = dot;
    }
  }
}

#if defined(__AVX2__)
// acc (NV vectors) += the n rows at v (w apart) times their weights p, the sums in registers (NV a
// compile-time count: with a run-time one GCC kept the sums on the stack, a load and a store each).
template <int NV>
static inline void weighted_rows(const float* v, int64_t w, const float* p, int64_t n, float* acc) {
  __m256 a[NV];
  for (int c = 0; c < NV; ++c) a[c] = _mm256_loadu_ps(acc + 8 * c);
  for (int64_t i = 0; i < n; ++i) {
    const __m256 pv = _mm256_set1_ps(p[i]);
    for (int c = 0; c < NV; ++c) a[c] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i * w + 8 * c), a[c]);
  }
  for (int c = 0; c < NV; ++c) _mm256_storeu_ps(acc + 8 * c, a[c]);
}
#endif

// acc (nh rows of D) += each of a block's n value rows (rows, as block_scores reads them) times its
// softmax weight (s: rows L apart). On AVX2 a head's sums stay in registers over the block, 64 values
// at a time, where the plain loop loads and stores them for every token.
static void block_values(const float* rows, int64_t n, int64_t w, const float* s, int64_t L, int64_t nh,
                         int64_t G, int64_t D, float* acc) {
#if defined(__AVX2__)
  if (D % 8 == 0) {
    for (int64_t h = 0; h < nh; ++h) {
      for (int64_t d0 = 0; d0 < D; d0 += 64) {
        const float* v = rows + (h / G) * D + d0;
        float* a = acc + h * D + d0;
        switch (std::min<int64_t>(64, D - d0) / 8) {
          case 1: weighted_rows<1>(v, w, s + h * L, n, a); break;
          case 2: weighted_rows<2>(v, w, s + h * L, n, a); break;
          case 3: weighted_rows<3>(v, w, s + h * L, n, a); break;
          case 4: weighted_rows<4>(v, w, s + h * L, n, a); break;
          case 5: weighted_rows<5>(v, w, s + h * L, n, a); break;
          case 6: weighted_rows<6>(v, w, s + h * L, n, a); break;
          case 7: weighted_rows<7>(v, w, s + h * L, n, a); break;
          default: weighted_rows<8>(v, w, s + h * L, n, a); break;
        }
      }
    }
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t h = 0; h < nh; ++h) {
      float* a = acc + h * D;
      const float* vh = rows + i * w + (h / G) * D;
      const float p = s[h * L + i];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += p * vh[d];
    }
  }
}

// Per work item (StepItems), three passes: scores of every query head against every cached key, a
// softmax over each score row, then the value sum, a block of rows at a time (block_scores,
// block_values). A sequence's blocks are read whole (all kv heads at once, contiguous), and while one
// block is read the next one is prefetched a token row at a time: the blocks of a sequence lie anywhere
// in the pool and hardware prefetchers do not follow a block table. R: how the cache stores a row
// (kv_rows.h); rows are converted to float32 (and scaled, for 8-bit rows) as they are read. This is the
// kernel of the AVX2 build, and of head sizes the AVX-512 kernel below does not take.
template <typename T, typename R>
static void decode_kernel(
    const T* q, const typename R::elem* kc, const typename R::elem* vc, const int64_t* bt, const int64_t* ctx,
    T* out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t bs, int64_t max_blocks, float scale,
    int64_t q_stride_b, int64_t q_stride_h) {
  using E = typename R::elem;
  const int64_t G = H / Hkv, RW = R::width(D), W = Hkv * RW;  // W: one token's keys (or values), all kv heads
  const StepItems plan(ctx, B, Hkv, G, D, bs);
  const int64_t heads_per_part = plan.heads_per_part, nh = plan.nh;
  const int64_t wf = heads_per_part * D;  // an item's share of a token row, as floats
  parallel_by_context(plan.count(), [&](int64_t i) { return plan.tokens(i); }, [&](int64_t begin, int64_t end) {
    // rows: one block's rows as floats; zeroed, so rows past a block's last (read, never stored, by
    // block_scores's groups of eight) are finite.
    std::vector<float> qf(H * D), acc(H * D), rows((bs + 7) / 8 * 8 * wf, 0.f), s;
    for (int64_t item = begin; item < end; ++item) {
      const StepItems::Item it = plan.locate(item);
      const int64_t b = it.b, g0 = it.g0;
      const int64_t off = g0 * RW, w = heads_per_part * RW;  // this item's slice of a token row
      const int64_t h0 = g0 * G;  // and its first query head
      const int64_t L = it.t1 - it.t0, nblocks = it.blk1 - it.blk0;  // this chunk's tokens and blocks
      const int64_t* table = bt + b * max_blocks + it.blk0;
      load_scaled_q(q + b * q_stride_b + h0 * q_stride_h, q_stride_h, nh, D, scale, qf.data());
      s.resize(nh * L);
      // The block's rows as floats, the next block's (or the first value block's) asked for meanwhile.
      auto convert = [&](const E* base, const E* next, int64_t n) {
        for (int64_t i = 0; i < n; ++i) {
          if (next) prefetch(next + i * W, w * sizeof(E));
          for (int64_t g = 0; g < heads_per_part; ++g) R::load(base + i * W + g * RW, D, &rows[i * wf + g * D]);
        }
      };
      for (int64_t i = 0; i < std::min(bs, L); ++i) prefetch(kc + (table[0] * bs + i) * W + off, w * sizeof(E));
      for (int64_t blk = 0; blk < nblocks; ++blk) {
        const int64_t t0 = blk * bs, n = std::min(bs, L - t0);
        convert(kc + table[blk] * bs * W + off,
                (blk + 1 < nblocks ? kc + table[blk + 1] * bs * W : vc + table[0] * bs * W) + off, n);
        block_scores(rows.data(), n, wf, qf.data(), nh, G, D, s.data() + t0, L);
      }
      float inv[256];
      float* part = plan.partial(item, it);
      softmax_rows(s.data(), nh, L, inv, part ? part + nh * D : nullptr, part ? part + nh * D + nh : nullptr);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t blk = 0; blk < nblocks; ++blk) {
        const int64_t t0 = blk * bs, n = std::min(bs, L - t0);
        convert(vc + table[blk] * bs * W + off, blk + 1 < nblocks ? vc + table[blk + 1] * bs * W + off : nullptr, n);
        block_values(rows.data(), n, wf, s.data() + t0, L, nh, G, D, acc.data());
      }
      if (part) {
        std::copy(acc.begin(), acc.begin() + nh * D, part);
        continue;
      }
      for (int64_t h = 0; h < nh; ++h) {
        for (int64_t d = 0; d < D; ++d) acc[h * D + d] *= inv[h];
      }
      store_f32(acc.data(), out + (b * H + h0) * D, nh * D);
    }
  });
  plan.merge(out, H);
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

// Sixteen codes of an 8-bit row as floats, before its scale. int8: sign-extended and converted. fp8
// e4m3: its bits moved into a float16's (sign to bit 15, exponent and mantissa below it), which reads
// the code's value divided by 2^8 (the two exponent biases differ by 8), subnormals included; Q8 below
// puts the 2^8 back into the row's scale.
template <bool FP8>
static inline __m512 ld16_q8(const uint8_t* p) {
  const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (FP8) {
    const __m256i w = _mm256_cvtepu8_epi16(c);
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8);
    const __m256i mag = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7);
    return _mm512_cvtph_ps(_mm256_or_si256(sign, mag));
  } else {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c));
  }
}

// A row format's sixteen-value loads and the factor its scale carries on this path.
template <typename R>
struct Avx512Rows;
template <typename T>
struct Avx512Rows<PlainRows<T>> {
  static __m512 ld(const T* p) { return ld16(p); }
  static float scale(const T*, int64_t) { return 1.f; }
};
template <bool FP8>
struct Avx512Rows<Q8Rows<FP8>> {
  static __m512 ld(const uint8_t* p) { return ld16_q8<FP8>(p); }
  static float scale(const uint8_t* p, int64_t D) { return Q8Rows<FP8>::scale(p, D) * (FP8 ? 256.f : 1.f); }
};

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

// f(std::integral_constant<int, m>{}) for 1 <= m <= MAXH. The per-row loops below are compiled for
// each count of query heads, so that their accumulators stay in registers: with a count known only at
// run time GCC kept the value sums on the stack, a load and a store around every multiply-add.
template <int MAXH, int M = 1, typename F>
static inline void with_heads(int64_t m, const F& f) {
  if (m == M)
    f(std::integral_constant<int, M>{});
  else if constexpr (M < MAXH)
    with_heads<MAXH, M + 1>(m, f);
}

// The key pass of M query heads (qg: their scaled float32 rows, D apart) over n key rows (base, W
// apart): their scores into sg (rows L apart). Sixteen tokens' dot products are summed in one hsum16;
// an 8-bit row's scale multiplies its token's sums after that. pf: rows to prefetch meanwhile.
template <typename R, int NC, int M>
static inline void key_rows(const typename R::elem* base, int64_t W, int64_t n, const float* qg, float* sg,
                            int64_t L, const typename R::elem* pf, int64_t pf_bytes) {
  using A = Avx512Rows<R>;
  constexpr int64_t D = NC * 16;
  __m512 qv[M][NC];
  for (int hh = 0; hh < M; ++hh)
    for (int c = 0; c < NC; ++c) qv[hh][c] = _mm512_loadu_ps(qg + hh * D + c * 16);
  alignas(64) __m512 part[M][16];
  alignas(64) float ks[16] = {};
  for (int64_t i0 = 0; i0 < n; i0 += 16) {
    const int64_t cnt = std::min<int64_t>(16, n - i0);
    for (int64_t i = 0; i < 16; ++i) {
      if (i >= cnt) {
        for (int hh = 0; hh < M; ++hh) part[hh][i] = _mm512_setzero_ps();
        continue;
      }
      if (pf) prefetch(pf + (i0 + i) * W, pf_bytes);
      const typename R::elem* kr = base + (i0 + i) * W;
      if constexpr (R::scaled) ks[i] = A::scale(kr, D);
      __m512 k[NC];
      for (int c = 0; c < NC; ++c) k[c] = A::ld(kr + c * 16);
      for (int hh = 0; hh < M; ++hh) {
        __m512 a = _mm512_mul_ps(qv[hh][0], k[0]);
        for (int c = 1; c < NC; ++c) a = _mm512_fmadd_ps(qv[hh][c], k[c], a);
        part[hh][i] = a;
      }
    }
    const __mmask16 keep = static_cast<__mmask16>((1u << cnt) - 1u);
    for (int hh = 0; hh < M; ++hh) {
      __m512 dots = hsum16(part[hh]);
      if constexpr (R::scaled) dots = _mm512_mul_ps(dots, _mm512_load_ps(ks));
      _mm512_mask_storeu_ps(sg + hh * L + i0, keep, dots);
    }
  }
}

// The value pass of M query heads over n value rows (base, W apart): acc (M rows of D floats) +=
// weight x row, the weights from sg (rows L apart) times an 8-bit row's scale, the sums in registers.
template <typename R, int NC, int M>
static inline void value_rows(const typename R::elem* base, int64_t W, int64_t n, const float* sg, int64_t L,
                              float* acc, const typename R::elem* pf, int64_t pf_bytes) {
  using A = Avx512Rows<R>;
  constexpr int64_t D = NC * 16;
  __m512 av[M][NC];
  for (int hh = 0; hh < M; ++hh)
    for (int c = 0; c < NC; ++c) av[hh][c] = _mm512_loadu_ps(acc + hh * D + c * 16);
  for (int64_t i = 0; i < n; ++i) {
    if (pf) prefetch(pf + i * W, pf_bytes);
    const typename R::elem* vr = base + i * W;
    const float sv = A::scale(vr, D);
    __m512 v[NC];
    for (int c = 0; c < NC; ++c) v[c] = A::ld(vr + c * 16);
    for (int hh = 0; hh < M; ++hh) {
      const __m512 p = _mm512_set1_ps(sg[hh * L + i] * sv);
      for (int c = 0; c < NC; ++c) av[hh][c] = _mm512_fmadd_ps(p, v[c], av[hh][c]);
    }
  }
  for (int hh = 0; hh < M; ++hh)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + hh * D + c * 16, av[hh][c]);
}

// The same three passes as decode_kernel, written for AVX-512 registers with the head size fixed
// (NC registers of 16 floats a head): the query heads of a kv head are held in registers, each key
// row is converted once for all of them, sixteen tokens' dot products are summed in one hsum16, and
// the value sums accumulate in registers over a block. The plain loops above, per token before their
// AVX2 block passes, measured ~12 GB/s with the cache hot (compute-bound: one horizontal sum per head
// and token, value accumulators in memory).
// An 8-bit row's scale multiplies its sixteen tokens' dot products after the sum, and each token's
// softmax weight before the value sum, rather than every value.
template <typename T, typename R, int NC>
static void decode_kernel_avx512(
    const T* q, const typename R::elem* kc, const typename R::elem* vc, const int64_t* bt, const int64_t* ctx,
    T* out, int64_t B, int64_t H, int64_t Hkv, int64_t bs, int64_t max_blocks, float scale,
    int64_t q_stride_b, int64_t q_stride_h) {
  using E = typename R::elem;
  constexpr int64_t D = NC * 16;
  constexpr int MAXH = 16 / NC;  // query heads whose registers fit beside the key row's
  // Prefetch distance in block passes: 2 against 1, same-process A/B: one sequence of ~2000 tokens
  // 1.29x (bf16) and 1.33x (int8) faster, 8-64 sequences within 2% either way (Intel, into L1). Into
  // L2 on AMD Zen 4, 4 was no better than 2.
  constexpr int64_t PD = 2;
  const int64_t G = H / Hkv, RW = R::width(D), W = Hkv * RW;
  const StepItems plan(ctx, B, Hkv, G, D, bs);
  const int64_t heads_per_part = plan.heads_per_part, nh = plan.nh;
  parallel_by_context(plan.count(), [&](int64_t i) { return plan.tokens(i); }, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * D), acc(H * D), s;
    StepItems::Item it = plan.locate(begin);
    for (int64_t item = begin; item < end; ++item) {
      const StepItems::Item nx = item + 1 < end ? plan.locate(item + 1) : StepItems::Item{};
      const int64_t b = it.b, g0 = it.g0, h0 = g0 * G;
      const int64_t Lc = it.t1 - it.t0, nblocks = it.blk1 - it.blk0;  // this chunk's tokens and blocks
      const int64_t* table = bt + b * max_blocks + it.blk0;
      load_scaled_q(q + b * q_stride_b + h0 * q_stride_h, q_stride_h, nh, D, scale, qf.data());
      s.resize(nh * Lc);
      // A block lies anywhere in the pool, where no hardware prefetcher looks: the next block is asked
      // for while this one is read, each kv head's slice of a token row during that head's pass, so
      // the requests are spread over the whole block's work (all of a block at once overflowed the
      // line fill buffers; a whole row per token in the first head's pass only was 10-20% slower).
      // Block passes in order: this item's key blocks, its value blocks, then the next item's key blocks
      // (its first ones would otherwise start cold, once per item and layer). The pass PD places ahead
      // of the current one is prefetched.
      auto ahead = [&](int64_t p) -> const E* {
        if (p < nblocks) return kc + table[p] * bs * W + g0 * RW;
        if ((p -= nblocks) < nblocks) return vc + table[p] * bs * W + g0 * RW;
        p -= nblocks;
        if (item + 1 >= end || p >= nx.blk1 - nx.blk0) return nullptr;
        return kc + bt[nx.b * max_blocks + nx.blk0 + p] * bs * W + nx.g0 * RW;
      };
      if (item == begin) {
        const int64_t slice = heads_per_part * RW * sizeof(E);
        for (int64_t p = 0; p < PD; ++p)
          if (const E* blk0 = ahead(p))
            for (int64_t i = 0; i < bs; ++i) prefetch(blk0 + i * W, slice);
      }
      const int64_t row_bytes = RW * sizeof(E);
      for (int64_t blk = 0; blk < nblocks; ++blk) {
        const int64_t t0 = blk * bs, n = std::min(bs, Lc - t0);
        const E* next = ahead(blk + PD);
        for (int64_t g = 0; g < heads_per_part; ++g) {
          const E* base = kc + table[blk] * bs * W + (g0 + g) * RW;
          for (int64_t hc = 0; hc < G; hc += MAXH) {
            const E* pf = next && hc == 0 ? next + g * RW : nullptr;
            float* sg = &s[(g * G + hc) * Lc + t0];
            with_heads<MAXH>(std::min<int64_t>(MAXH, G - hc), [&](auto Mc) {
              key_rows<R, NC, Mc.value>(base, W, n, &qf[(g * G + hc) * D], sg, Lc, pf, row_bytes);
            });
          }
        }
      }
      float inv[256];
      float* part = plan.partial(item, it);
      softmax_rows(s.data(), nh, Lc, inv, part ? part + nh * D : nullptr, part ? part + nh * D + nh : nullptr);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t blk = 0; blk < nblocks; ++blk) {
        const int64_t t0 = blk * bs, n = std::min(bs, Lc - t0);
        const E* next = ahead(nblocks + blk + PD);
        for (int64_t g = 0; g < heads_per_part; ++g) {
          const E* base = vc + table[blk] * bs * W + (g0 + g) * RW;
          for (int64_t hc = 0; hc < G; hc += MAXH) {
            const E* pf = next && hc == 0 ? next + g * RW : nullptr;
            with_heads<MAXH>(std::min<int64_t>(MAXH, G - hc), [&](auto Mc) {
              value_rows<R, NC, Mc.value>(base, W, n, &s[(g * G + hc) * Lc + t0], Lc, &acc[(g * G + hc) * D], pf,
                                          row_bytes);
            });
          }
        }
      }
      if (part) {
        std::copy(acc.begin(), acc.begin() + nh * D, part);
      } else {
        for (int64_t h = 0; h < nh; ++h) {
          for (int64_t d = 0; d < D; ++d) acc[h * D + d] *= inv[h];
        }
        store_f32(acc.data(), out + (b * H + h0) * D, nh * D);
      }
      it = nx;
    }
  });
  plan.merge(out, H);
}
#endif

template <typename T, typename R>
static void run_decode(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& bt,
                       const at::Tensor& ctx, at::Tensor& out, float scale) {
  using E = typename R::elem;
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), bs = kc.size(1), Hkv = kc.size(2);
  const E* k = reinterpret_cast<const E*>(kc.data_ptr());
  const E* v = reinterpret_cast<const E*>(vc.data_ptr());
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>) {
    auto fast = D == 64 ? &decode_kernel_avx512<T, R, 4> : D == 128 ? &decode_kernel_avx512<T, R, 8> : nullptr;
    if (fast) {
      fast(q.data_ptr<T>(), k, v, bt.data_ptr<int64_t>(), ctx.data_ptr<int64_t>(), out.data_ptr<T>(), B, H, Hkv, bs,
           bt.size(1), scale, q.stride(0), q.stride(1));
      return;
    }
  }
#endif
  decode_kernel<T, R>(q.data_ptr<T>(), k, v, bt.data_ptr<int64_t>(), ctx.data_ptr<int64_t>(), out.data_ptr<T>(), B, H,
                      Hkv, D, bs, bt.size(1), scale, q.stride(0), q.stride(1));
}

// q: [B, H, D] (rows may be strided), caches: [num_blocks, block_size, Hkv, row] contiguous, where a row
// is D values of q's dtype (kv_format 0) or D 8-bit codes and a float32 scale (1: int8, 2: fp8 e4m3),
// block_tables: [B, max_blocks] int64, context_lens: [B] int64. Returns [B, H, D].
at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                           at::Tensor block_tables, at::Tensor context_lens, double scale, int64_t kv_format) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [B, H, D] with contiguous D");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong);
  TORCH_CHECK(kv_format >= 0 && kv_format <= 2, "kv_format: 0 (plain), 1 (int8) or 2 (fp8)");
  auto bt = block_tables.contiguous();
  auto ctx = context_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(2);
  TORCH_CHECK(H % Hkv == 0 && k_cache.sizes() == v_cache.sizes());
  if (kv_format == 0) {
    TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && k_cache.size(3) == D, "cache rows: D values of q's dtype");
  } else {
    TORCH_CHECK(k_cache.scalar_type() == at::kByte && k_cache.size(3) == D + 4, "8-bit cache rows: D + 4 bytes");
  }
  TORCH_CHECK(H <= 256, "at most 256 query heads");
  auto out = at::empty({B, H, D}, q.options());
  const float sc = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    if (kv_format == 1)
      run_decode<scalar_t, Q8Rows<false>>(q, k_cache, v_cache, bt, ctx, out, sc);
    else if (kv_format == 2)
      run_decode<scalar_t, Q8Rows<true>>(q, k_cache, v_cache, bt, ctx, out, sc);
    else
      run_decode<scalar_t, PlainRows<scalar_t>>(q, k_cache, v_cache, bt, ctx, out, sc);
  });
  return out;
}
