// Paged decode attention for CPUs: one query token per sequence attends to its cached keys/values,
// read in place through its block table (no gather copy), with an online softmax in float32.
// Work is split over (sequence, kv head); the query heads of a GQA group share each K/V read.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cmath>
#include <limits>
#include <vector>

template <typename T>
static inline float to_f(T x) { return static_cast<float>(x); }

template <typename T>
static void decode_kernel(
    const T* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* ctx, T* out,
    int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t bs, int64_t max_blocks, float scale,
    int64_t q_stride_b, int64_t q_stride_h) {
  const int64_t G = H / Hkv;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), m(G), l(G), s(G);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / Hkv, g = w % Hkv;
      for (int64_t j = 0; j < G; ++j) {
        const T* qp = q + b * q_stride_b + (g * G + j) * q_stride_h;
        for (int64_t d = 0; d < D; ++d) qf[j * D + d] = to_f(qp[d]) * scale;
        m[j] = -std::numeric_limits<float>::infinity();
        l[j] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const int64_t L = ctx[b];
      for (int64_t t = 0; t < L; ++t) {
        const int64_t slot = bt[b * max_blocks + t / bs] * bs + t % bs;
        const T* kp = kc + (slot * Hkv + g) * D;
        const T* vp = vc + (slot * Hkv + g) * D;
        for (int64_t j = 0; j < G; ++j) {
          float dot = 0.f;
          const float* qj = &qf[j * D];
          // omp simd: lets the compiler reorder this float sum into vector lanes (no -ffast-math).
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qj[d] * to_f(kp[d]);
          s[j] = dot;
        }
        for (int64_t j = 0; j < G; ++j) {
          float* a = &acc[j * D];
          if (s[j] > m[j]) {  // new maximum: rescale what was accumulated so far
            const float c = std::exp(m[j] - s[j]);
            l[j] *= c;
            for (int64_t d = 0; d < D; ++d) a[d] *= c;
            m[j] = s[j];
          }
          const float p = std::exp(s[j] - m[j]);
          l[j] += p;
          for (int64_t d = 0; d < D; ++d) a[d] += p * to_f(vp[d]);
        }
      }
      for (int64_t j = 0; j < G; ++j) {
        T* op = out + (b * H + g * G + j) * D;
        const float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;
        for (int64_t d = 0; d < D; ++d) op[d] = static_cast<T>(acc[j * D + d] * inv);
      }
    }
  });
}

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
  auto out = torch::empty({B, H, D}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                            v_cache.data_ptr<scalar_t>(), bt.data_ptr<int64_t>(), ctx.data_ptr<int64_t>(),
                            out.data_ptr<scalar_t>(), B, H, Hkv, D, bs, bt.size(1),
                            static_cast<float>(scale), q.stride(0), q.stride(1));
  });
  return out;
}
