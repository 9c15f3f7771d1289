// Fused element-wise ops for the CPU path of the Llama block. Each replaces several PyTorch ops (and
// several passes over memory, and several thread-pool fork/joins) with one loop computed in float32.
// Rows are split across threads only when there are enough of them: a decode step of one token runs
// on the calling thread, which measured faster than waking the pool for 576 numbers.
#include "tensor.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "vec_math.h"


// out = x * rsqrt(mean(x^2) + eps) * w, per row. If residual is given: residual += x first (stored in
// T, as an unfused add would round it), and the normalized value is taken of the new residual.
template <typename T>
static void rms_norm_rows(const T* x, T* residual, const T* w, T* out, int64_t rows, int64_t n,
                          int64_t x_stride, float eps) {
  std::vector<float> wf(n);
  load_f32(w, wf.data(), n);
  at::parallel_for(0, rows, grain_for(n), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(n), xf(n);
    for (int64_t r = begin; r < end; ++r) {
      load_f32(x + r * x_stride, buf.data(), n);
      if (residual) {
        // The sum is rounded to T and stored, as an unfused add would; the norm is of the rounded sum.
        T* rr = residual + r * n;
        load_f32(rr, xf.data(), n);
        for (int64_t i = 0; i < n; ++i) xf[i] += buf[i];
        store_f32(xf.data(), rr, n);
        load_f32(rr, buf.data(), n);
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < n; ++i) ss += buf[i] * buf[i];
      const float inv = 1.f / std::sqrt(ss / n + eps);
      for (int64_t i = 0; i < n; ++i) buf[i] = buf[i] * inv * wf[i];
      store_f32(buf.data(), out + r * n, n);
    }
  });
}

at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && w.is_contiguous());
  auto out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), nullptr, w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            x.size(0), x.size(1), x.stride(0), static_cast<float>(eps));
  });
  return out;
}

// residual += x (in place); returns rms_norm(residual).
at::Tensor add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && residual.is_contiguous() && w.is_contiguous());
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type());
  auto out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), x.size(0), x.size(1), x.stride(0),
                            static_cast<float>(eps));
  });
  return out;
}

// [T, 2I] (gate | up) -> [T, I] = silu(gate) * up
at::Tensor silu_mul(at::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.is_contiguous() && gu.size(1) % 2 == 0);
  const int64_t rows = gu.size(0), n = gu.size(1) / 2;
  auto out = at::empty({rows, n}, gu.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gu.scalar_type(), "silu_mul", [&] {
    const scalar_t* in = gu.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_for(n), [&](int64_t begin, int64_t end) {
      std::vector<float> g(n), u(n);
      for (int64_t r = begin; r < end; ++r) {
        load_f32(in + r * 2 * n, g.data(), n);
        load_f32(in + r * 2 * n + n, u.data(), n);
        for (int64_t i = 0; i < n; ++i) g[i] = g[i] / (1.f + exp_approx(-g[i])) * u[i];
        store_f32(g.data(), o + r * n, n);
      }
    });
  });
  return out;
}

// In place on the first `heads` heads of each row of qkv ([T, >= heads * D], row-strided):
// x <- x * cos + roll(x, D/2) * sin_signed, with cos/sin rows picked by position.
void rope_(at::Tensor qkv, int64_t heads, int64_t D, at::Tensor positions, at::Tensor cos,
           at::Tensor sin_signed) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && cos.is_contiguous() && sin_signed.is_contiguous());
  TORCH_CHECK(positions.scalar_type() == at::kLong && cos.scalar_type() == at::kFloat);
  auto pos = positions.contiguous();
  const int64_t rows = qkv.size(0), half = D / 2, stride = qkv.stride(0);
  const int64_t* p = pos.data_ptr<int64_t>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin_signed.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_", [&] {
    scalar_t* base = qkv.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_for(heads * D), [&](int64_t begin, int64_t end) {
      std::vector<float> x(D), y(D);
      for (int64_t r = begin; r < end; ++r) {
        const float* cr = c + p[r] * D;
        const float* sr = s + p[r] * D;
        for (int64_t h = 0; h < heads; ++h) {
          scalar_t* v = base + r * stride + h * D;
          load_f32(v, x.data(), D);
          for (int64_t d = 0; d < half; ++d) y[d] = x[d] * cr[d] + x[d + half] * sr[d];
          for (int64_t d = half; d < D; ++d) y[d] = x[d] * cr[d] + x[d - half] * sr[d];
          store_f32(y.data(), v, D);
        }
      }
    });
  });
}

// float32 -> bfloat16 through the kernels' own store (store_f32), exposed so tests can hold every
// instruction-set build's rounding against PyTorch's.
at::Tensor to_bf16(at::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous());
  auto out = at::empty(x.sizes(), x.options().dtype(at::kBFloat16));
  store_f32(x.data_ptr<float>(), out.data_ptr<c10::BFloat16>(), x.numel());
  return out;
}
