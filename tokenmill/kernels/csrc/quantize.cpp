// Dynamic activation quantization for int8 matmuls: each row of a [M, K] activation becomes integers
// in [-127, 127] with one float32 scale, max|x| / 127, so the int8 matmul's int32 sums are exact and one
// multiply per output element (by row scale x column scale) restores the values. They are stored as
// uint8 with an offset of 128 (zero point 128): oneDNN has fast u8 x s8 kernels on every x86 level
// (AMX, AVX512-VNNI, AVX2) but runs s8 x s8 through its reference code without AMX (measured on Zen 4's
// instruction set: ref_int8, ~100x slower). One pass, one
// thread-pool fork at most; as plain PyTorch this was five ops and five passes per linear, which cost
// more than the int8 matmul saved.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <vector>

#include "vec_math.h"

template <typename T>
static void quantize_rows(const T* x, uint8_t* q, float* scales, int64_t rows, int64_t n, int64_t stride) {
  at::parallel_for(0, rows, grain_for(n), [&](int64_t b, int64_t e) {
    std::vector<float> buf(n);
    for (int64_t r = b; r < e; ++r) {
      load_f32(x + r * stride, buf.data(), n);
      const float m = max_of<true>(buf.data(), n);
      // FLT_MIN for an all-zero row: its values quantize to 0 whatever the scale.
      const float s = std::max(m / 127.f, FLT_MIN);
      scales[r] = s;
      uint8_t* qr = q + r * n;
      // Round half to even (nearbyint in the default rounding mode), as torch.round does; |x| / s
      // <= 127 by construction, the clamp only guards the last bit of the division.
      // Two plain loops, each of which the compiler vectorizes (one fused loop stayed scalar).
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) buf[i] = std::min(std::max(std::nearbyint(buf[i] / s), -127.f), 127.f);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) qr[i] = static_cast<uint8_t>(static_cast<int32_t>(buf[i]) + 128);
    }
  });
}

// x: [M, K] (rows may be strided). Returns (uint8 [M, K] = q + 128, float32 scales [M, 1]).
std::vector<torch::Tensor> quantize_rows_u8(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
  const int64_t rows = x.size(0), n = x.size(1);
  auto q = torch::empty({rows, n}, x.options().dtype(torch::kByte));
  auto s = torch::empty({rows, 1}, x.options().dtype(torch::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_rows_u8", [&] {
    quantize_rows<scalar_t>(x.data_ptr<scalar_t>(), q.data_ptr<uint8_t>(), s.data_ptr<float>(), rows, n,
                            x.stride(0));
  });
  return {q, s};
}

// y[r, :] *= scales[r] in place (y: [M, N] contiguous, scales: float32 [M, 1]), computed in float32 and
// rounded once: the int8 matmul's output in the model dtype, times its rows' activation scales.
// As `y.mul_(scales)` PyTorch promoted to float32 and cast back through a second pass.
template <typename T>
static void scale_rows(T* y, const float* s, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, grain_for(n), [&](int64_t b, int64_t e) {
    std::vector<float> buf(n);
    for (int64_t r = b; r < e; ++r) {
      load_f32(y + r * n, buf.data(), n);
      const float k = s[r];
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) buf[i] *= k;
      store_f32(buf.data(), y + r * n, n);
    }
  });
}

void scale_rows_(torch::Tensor y, torch::Tensor scales) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && scales.scalar_type() == torch::kFloat);
  TORCH_CHECK(scales.numel() == y.size(0) && scales.is_contiguous());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "scale_rows_", [&] {
    scale_rows<scalar_t>(y.data_ptr<scalar_t>(), scales.data_ptr<float>(), y.size(0), y.size(1));
  });
}
