// Fused element-wise ops for the CPU path of the Llama block. Each replaces several PyTorch ops (and
// several passes over memory, and several thread-pool fork/joins) with one loop computed in float32.
// Rows are split across threads only when there are enough of them: a decode step of one token runs
// on the calling thread, which measured faster than waking the pool for 576 numbers.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "vec_math.h"

static inline int64_t grain_for(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_elems, 1)); }

template <typename T>
static inline float f(T x) { return static_cast<float>(x); }

// out = x * rsqrt(mean(x^2) + eps) * w, per row. If residual is given: residual += x first (stored in
// T, as an unfused add would round it), and the normalized value is taken of the new residual.
template <typename T>
static void rms_norm_rows(const T* x, T* residual, const T* w, T* out, int64_t rows, int64_t n,
                          int64_t x_stride, float eps) {
  at::parallel_for(0, rows, grain_for(n), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(n);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      float ss = 0.f;
      if (residual) {
        T* rr = residual + r * n;
        for (int64_t i = 0; i < n; ++i) {
          T s = static_cast<T>(f(rr[i]) + f(xr[i]));
          rr[i] = s;
          buf[i] = f(s);
        }
      } else {
        for (int64_t i = 0; i < n; ++i) buf[i] = f(xr[i]);
      }
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < n; ++i) ss += buf[i] * buf[i];
      const float inv = 1.f / std::sqrt(ss / n + eps);
      T* o = out + r * n;
      for (int64_t i = 0; i < n; ++i) o[i] = static_cast<T>(buf[i] * inv * f(w[i]));
    }
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && w.is_contiguous());
  auto out = torch::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), nullptr, w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            x.size(0), x.size(1), x.stride(0), static_cast<float>(eps));
  });
  return out;
}

// residual += x (in place); returns rms_norm(residual).
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && residual.is_contiguous() && w.is_contiguous());
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type());
  auto out = torch::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), x.size(0), x.size(1), x.stride(0),
                            static_cast<float>(eps));
  });
  return out;
}

// [T, 2I] (gate | up) -> [T, I] = silu(gate) * up
torch::Tensor silu_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.is_contiguous() && gu.size(1) % 2 == 0);
  const int64_t rows = gu.size(0), n = gu.size(1) / 2;
  auto out = torch::empty({rows, n}, gu.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gu.scalar_type(), "silu_mul", [&] {
    const scalar_t* in = gu.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_for(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* g = in + r * 2 * n;
        const scalar_t* u = g + n;
        for (int64_t i = 0; i < n; ++i) {
          const float x = f(g[i]);
          o[r * n + i] = static_cast<scalar_t>(x / (1.f + exp_approx(-x)) * f(u[i]));
        }
      }
    });
  });
  return out;
}

// In place on the first `heads` heads of each row of qkv ([T, >= heads * D], row-strided):
// x <- x * cos + roll(x, D/2) * sin_signed, with cos/sin rows picked by position.
void rope_(torch::Tensor qkv, int64_t heads, int64_t D, torch::Tensor positions, torch::Tensor cos,
           torch::Tensor sin_signed) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && cos.is_contiguous() && sin_signed.is_contiguous());
  TORCH_CHECK(positions.scalar_type() == torch::kLong && cos.scalar_type() == torch::kFloat);
  auto pos = positions.contiguous();
  const int64_t rows = qkv.size(0), half = D / 2, stride = qkv.stride(0);
  const int64_t* p = pos.data_ptr<int64_t>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin_signed.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_", [&] {
    scalar_t* base = qkv.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_for(heads * D), [&](int64_t begin, int64_t end) {
      std::vector<float> x(D);
      for (int64_t r = begin; r < end; ++r) {
        const float* cr = c + p[r] * D;
        const float* sr = s + p[r] * D;
        for (int64_t h = 0; h < heads; ++h) {
          scalar_t* v = base + r * stride + h * D;
          for (int64_t d = 0; d < D; ++d) x[d] = f(v[d]);
          for (int64_t d = 0; d < D; ++d) {
            const float rolled = x[d < half ? d + half : d - half];
            v[d] = static_cast<scalar_t>(x[d] * cr[d] + rolled * sr[d]);
          }
        }
      }
    });
  });
}
