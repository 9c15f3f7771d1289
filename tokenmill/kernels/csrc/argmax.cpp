// Greedy decoding's pick: the index of each row's largest logit, as PyTorch's max(dim=-1).indices
// gives it (the first maximum; a NaN counts as the largest, its first occurrence). Rows in parallel;
// each row converted to float32 once, then one pass for the maximum (and whether there is a NaN) and a
// vectorized search for its first index. PyTorch's reduction took ~3.4 ms a step at 256 rows of a
// 49k vocabulary, a single-threaded 2.5% of an offline run.
#include "tensor.h"
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

#include "vec_math.h"

namespace {

// The first i with x[i] == v (v not NaN), or the first NaN when nan is set.
int64_t first_index(const float* x, int64_t n, float v, bool nan) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 vv = _mm512_set1_ps(v);
  for (; i + 16 <= n; i += 16) {
    const __m512 a = _mm512_loadu_ps(x + i);
    const __mmask16 hit = nan ? _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(a, vv, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
#elif defined(__AVX2__)
  const __m256 vv = _mm256_set1_ps(v);
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_loadu_ps(x + i);
    const int hit = _mm256_movemask_ps(nan ? _mm256_cmp_ps(a, a, _CMP_UNORD_Q) : _mm256_cmp_ps(a, vv, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < n; ++i)
    if (nan ? std::isnan(x[i]) : x[i] == v) return i;
  return -1;
}

// Whether x holds a NaN. GCC keeps a plain loop of this scalar; 16 at a time here.
bool any_nan(const float* x, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  __mmask16 seen = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 a = _mm512_loadu_ps(x + i);
    seen |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
  }
  if (seen) return true;
#elif defined(__AVX2__)
  __m256 seen = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_loadu_ps(x + i);
    seen = _mm256_or_ps(seen, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  }
  if (_mm256_movemask_ps(seen)) return true;
#endif
  for (; i < n; ++i)
    if (std::isnan(x[i])) return true;
  return false;
}

template <typename T>
void argmax_kernel(const T* x, int64_t R, int64_t V, int64_t stride, int64_t* out) {
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(V);
    for (int64_t r = begin; r < end; ++r) {
      load_f32(x + r * stride, row.data(), V);
      const bool nan = any_nan(row.data(), V);
      out[r] = first_index(row.data(), V, nan ? 0.f : max_of(row.data(), V), nan);
    }
  });
}

}  // namespace

// logits: [R, V] float32/bfloat16/float16 (rows may be strided, vocab contiguous), V > 0. Returns [R]
// int64.
at::Tensor argmax_rows(at::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits must be [R, V] with a contiguous vocab");
  TORCH_CHECK(logits.size(1) > 0, "an empty vocabulary has no maximum");
  const int64_t R = logits.size(0), V = logits.size(1);
  auto out = at::empty({R}, logits.options().dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "argmax_rows", [&] {
    argmax_kernel<scalar_t>(logits.data_ptr<scalar_t>(), R, V, logits.stride(0), out.data_ptr<int64_t>());
  });
  return out;
}
