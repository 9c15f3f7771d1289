// Dynamic activation quantization for int8 matmuls: each row of a [M, K] activation becomes integers
// in [-127, 127] with one float32 scale, max|x| / 127, so the int8 matmul's int32 sums are exact and one
// multiply per output element (by row scale x column scale) restores the values. They are stored as
// uint8 with an offset of 128 (zero point 128): oneDNN has fast u8 x s8 kernels on every x86 level
// (AMX, AVX512-VNNI, AVX2) but runs s8 x s8 through its reference code without AMX (measured on Zen 4's
// instruction set: ref_int8, ~100x slower). One pass, one
// thread-pool fork at most; as plain PyTorch this was five ops and five passes per linear, which cost
// more than the int8 matmul saved.
#include "tensor.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
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
std::vector<at::Tensor> quantize_rows_u8(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
  const int64_t rows = x.size(0), n = x.size(1);
  auto q = at::empty({rows, n}, x.options().dtype(at::kByte));
  auto s = at::empty({rows, 1}, x.options().dtype(at::kFloat));
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

void scale_rows_(at::Tensor y, at::Tensor scales) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && scales.scalar_type() == at::kFloat);
  TORCH_CHECK(scales.numel() == y.size(0) && scales.is_contiguous());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "scale_rows_", [&] {
    scale_rows<scalar_t>(y.data_ptr<scalar_t>(), scales.data_ptr<float>(), y.size(0), y.size(1));
  });
}

// v rounded to the nearest float8 e4m3 value, ties to even, as PyTorch's .to(torch.float8_e4m3fn)
// rounds (|v| <= 448 here by construction; the clamp only guards the division's last bit, since e4m3fn
// has no 480). Normal values (|v| >= 2^-6) keep three mantissa bits: rounded on the float's bits.
// Below 2^-6 e4m3 is subnormal, steps of 2^-9: nearbyint of v * 512 (round half to even). Branch-free
// (a select), so a loop over it vectorizes.
static inline float round_e4m3(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  const uint32_t r = (b + 0x7FFFFu + ((b >> 20) & 1u)) & 0xFFF00000u;
  float normal;
  std::memcpy(&normal, &r, sizeof(normal));
  const float sub = std::nearbyint(v * 512.f) * (1.f / 512.f);
  return std::min(std::max(std::fabs(v) < 0.015625f ? sub : normal, -448.f), 448.f);
}

template <typename T>
static void e4m3_rows(const T* x, c10::BFloat16* codes, float* scales, int64_t rows, int64_t n, int64_t stride) {
  at::parallel_for(0, rows, grain_for(n), [&](int64_t b, int64_t e) {
    std::vector<float> buf(n);
    for (int64_t r = b; r < e; ++r) {
      load_f32(x + r * stride, buf.data(), n);
      const float m = max_of<true>(buf.data(), n);
      const float s = std::max(m / 448.f, FLT_MIN);  // FLT_MIN for an all-zero row, as for int8
      scales[r] = s;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) buf[i] = round_e4m3(buf[i] / s);
      store_f32(buf.data(), codes + r * n, n);  // exact: an e4m3 value has 4 significant bits
    }
  });
}

// x: [M, K] (rows may be strided). Returns (each row's e4m3 codes as bfloat16 [M, K], float32 scales
// [M, 1], max|x| / 448): fp8 activations for a bf16 matmul that computes what an fp8 one does.
std::vector<at::Tensor> e4m3_rows_bf16(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
  const int64_t rows = x.size(0), n = x.size(1);
  auto q = at::empty({rows, n}, x.options().dtype(at::kBFloat16));
  auto s = at::empty({rows, 1}, x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "e4m3_rows_bf16", [&] {
    e4m3_rows<scalar_t>(x.data_ptr<scalar_t>(), q.data_ptr<c10::BFloat16>(), s.data_ptr<float>(), rows, n,
                        x.stride(0));
  });
  return {q, s};
}

template <typename T>
static void scale_rows_cols_into(const c10::BFloat16* y, const float* rs, const float* cs, T* out, int64_t rows,
                                 int64_t n) {
  at::parallel_for(0, rows, grain_for(n), [&](int64_t b, int64_t e) {
    std::vector<float> buf(n);
    for (int64_t r = b; r < e; ++r) {
      load_f32(y + r * n, buf.data(), n);
      const float k = rs[r];
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) buf[i] = buf[i] * k * cs[i];
      store_f32(buf.data(), out + r * n, n);
    }
  });
}

// out[r, c] = y[r, c] * rows[r] * cols[c], computed in float32 and rounded once to out's dtype (y:
// [M, N] contiguous; rows float32 [M, 1]; cols float32 [1, N]): an fp8 matmul's scales on its sums.
at::Tensor scale_rows_cols(at::Tensor y, at::Tensor rs, at::Tensor cs, at::ScalarType out_dtype) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.scalar_type() == at::kBFloat16);
  TORCH_CHECK(rs.scalar_type() == at::kFloat && cs.scalar_type() == at::kFloat && rs.is_contiguous() &&
              cs.is_contiguous() && rs.numel() == y.size(0) && cs.numel() == y.size(1));
  const int64_t rows = y.size(0), n = y.size(1);
  auto out = at::empty({rows, n}, y.options().dtype(out_dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out_dtype, "scale_rows_cols", [&] {
    scale_rows_cols_into<scalar_t>(y.data_ptr<c10::BFloat16>(), rs.data_ptr<float>(), cs.data_ptr<float>(),
                                   out.data_ptr<scalar_t>(), rows, n);
  });
  return out;
}
