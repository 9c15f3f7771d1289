// A pure decode step's decoder layers as one C++ call (models/decode_step.py builds the plan).
//
// At one stream a layer is ten small kernels: the Python between them (argument parsing, views, the
// backend's dispatch) was ~30% of the main thread's step on SmolLM2-135M, and the pool's other thread
// spun through it. Here the same kernels run in the same order on the same tensors, so a step gives
// the Python loop's bits (tests/test_decode_step.py); only the glue is gone.
#include "tensor.h"

#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "decode_step.h"
#include "kernels.h"

namespace tm_decode {

namespace {

// The step's keys or values into a plain (unquantized) cache at their slots: index_copy_'s bytes without
// its TensorIterator set-up, which cost more than the copy of a few rows.
void write_plain(const at::Tensor& x, const at::Tensor& cache, const int64_t* slots) {
  const int64_t T = x.size(0), Hkv = x.size(1), D = x.size(2);
  const int64_t bytes = D * x.element_size();
  const auto* src = static_cast<const char*>(x.data_ptr());
  auto* dst = static_cast<char*>(cache.data_ptr());
  const int64_t s0 = x.stride(0) * x.element_size(), s1 = x.stride(1) * x.element_size();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < Hkv; ++h) std::memcpy(dst + (slots[t] * Hkv + h) * bytes, src + t * s0 + h * s1, bytes);
}

}  // namespace

at::Tensor Linear::operator()(const at::Tensor& x) const {
  at::Tensor y;
  switch (kind) {
    case kDot: y = panel_matmul_dot(x, panels, n); break;
    case kVector: y = panel_matmul(x, panels, n, param); break;
    case kQ4: y = q4_matmul(x, panels, n, param); break;
    case kG8: y = g8_matmul(x, panels, n, param); break;
    case kI8: {  // W8A8 per channel: the rows quantized as Int8Linear does (ops.quantize_rows_u8)
      auto q = quantize_rows_u8(x);
      y = i8_matmul(q[0], q[1], panels, extra[0], extra[1], n);
      break;
    }
    case kF8: {  // fp8: the rows as e4m3 codes, as Fp8Linear does (ops.e4m3_rows)
      auto q = e4m3_rows_bf16(x);
      y = f8_matmul(q[0], q[1], panels, extra[0], n);
      break;
    }
    case kWide: y = panel_matmul_wide(x, panels, n); break;  // float32 rows, bf16 panels
    case kQ4Wide: {  // 4-bit panels by the AVX2 loops (W4A8), float32 out: in the rows' dtype, as in Python
      y = q4_matmul_wide(x, panels, n);
      if (y.scalar_type() != x.scalar_type()) y = y.to(x.scalar_type());
      break;
    }
    case kG8Wide: {  // int8 group panels by the AVX2 loops (W8A8), float32 out: in the rows' dtype
      y = g8_matmul_wide(x, panels, n);
      if (y.scalar_type() != x.scalar_type()) y = y.to(x.scalar_type());
      break;
    }
    default: TORCH_CHECK(false, "unknown linear kind ", kind);
  }
  if (bias) y.add_(*bias);
  return y;
}

at::Tensor Linear::with_lora(const at::Tensor& x, const at::Tensor& segments) const {
  at::Tensor y = (*this)(x);
  if (lora && segments.size(0) > 0) lora_delta_(y, x, lora->a, lora->bs, lora->lo, segments, lora->active);
  return y;
}

void DecodeLayers::set_lora(int64_t index, at::Tensor a, std::vector<at::Tensor> bs, std::vector<int64_t> lo,
                            at::Tensor active) {
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(linears_.size()), "no linear ", index);
  linears_[index].lora = Lora{std::move(a), std::move(bs), std::move(lo), std::move(active)};
}

DecodeLayers::DecodeLayers(std::vector<int64_t> kinds, std::vector<at::Tensor> panels, std::vector<int64_t> ns,
             std::vector<int64_t> params, std::vector<std::optional<at::Tensor>> biases,
             std::vector<std::vector<at::Tensor>> extras, std::vector<at::Tensor> norms, int64_t heads,
             int64_t kv_heads, int64_t head_dim, double eps)
    : norms_(std::move(norms)), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps) {
  const size_t n = kinds.size();
  TORCH_CHECK(n % 4 == 0 && panels.size() == n && ns.size() == n && params.size() == n && biases.size() == n &&
                  extras.size() == n,
              "four linears a layer");
  TORCH_CHECK(n > 0 && norms_.size() == n / 2, "at least one layer, two norms a layer");
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(kinds[i] >= kDot && kinds[i] <= kG8Wide, "unknown linear kind ", kinds[i]);
    const size_t wanted = kinds[i] == kI8 ? 2 : kinds[i] == kF8 ? 1 : 0;
    TORCH_CHECK(extras[i].size() == wanted, "linear kind ", kinds[i], " takes ", wanted, " extra tensors");
    linears_.push_back(Linear{kinds[i], ns[i], params[i], panels[i], biases[i], extras[i], std::nullopt});
  }
  for (const auto& w : norms_) TORCH_CHECK(w.is_contiguous(), "norm weights must be contiguous");
}
at::Tensor DecodeLayers::run(at::Tensor residual, at::Tensor positions, at::Tensor cos, at::Tensor sin_signed,
                  at::Tensor kv_caches, at::Tensor slots, at::Tensor block_tables,
                  at::Tensor context_lens, double scale, int64_t kv_format,
                  at::Tensor lora_segments) const {
  const int64_t L = num_layers(), T = residual.size(0);
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous(), "residual: [T, hidden], contiguous");
  TORCH_CHECK(kv_caches.dim() == 6 && kv_caches.size(0) == L && kv_caches.size(1) == 2 &&
                  kv_caches.is_contiguous(),
              "kv_caches: [layers, 2, blocks, block_size, Hkv, width], contiguous");
  TORCH_CHECK(kv_caches.size(4) == kv_heads_, "the cache's kv heads");
  TORCH_CHECK(kv_format >= 0 && kv_format <= 2, "kv_format: 0 (plain), 1 (int8) or 2 (fp8)");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == T, "slots: [T] long");
  auto sl = slots.contiguous();
  const int64_t* s = sl.data_ptr<int64_t>();
  const int64_t capacity = kv_caches.size(2) * kv_caches.size(3);
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(s[t] >= 0 && s[t] < capacity, "slot out of range");
  if (kv_format == 0)
    TORCH_CHECK(kv_caches.scalar_type() == residual.scalar_type() && kv_caches.size(5) == head_dim_,
                "plain cache rows: head_dim values of the model's dtype");

  const int64_t D = head_dim_, qs = heads_ * D, kvs = kv_heads_ * D;
  at::Tensor x = rms_norm(residual, norms_[0], eps_), m;
  for (int64_t i = 0; i < L; ++i) {
    const Linear* lin = &linears_[4 * i];
    const at::Tensor& sg = lora_segments;
    at::Tensor qkv = lin[0].with_lora(x, sg);
    TORCH_CHECK(qkv.size(1) == qs + 2 * kvs, "qkv width");
    rope_(qkv, heads_ + kv_heads_, D, positions, cos, sin_signed);
    auto q = qkv.narrow(1, 0, qs).view({T, heads_, D});
    auto k = qkv.narrow(1, qs, kvs).view({T, kv_heads_, D});
    auto v = qkv.narrow(1, qs + kvs, kvs).view({T, kv_heads_, D});
    auto layer = kv_caches.select(0, i);
    auto kc = layer.select(0, 0), vc = layer.select(0, 1);
    if (kv_format == 0) {
      write_plain(k, kc, s);
      write_plain(v, vc, s);
    } else {
      kv_write_q8(k, v, kc, vc, sl, kv_format == 2);
    }
    auto o = paged_decode(q, kc, vc, block_tables, context_lens, scale, kv_format);
    auto a = lin[1].with_lora(o.reshape({T, qs}), sg);
    x = add_rms_norm(a, residual, norms_[2 * i + 1], eps_);
    m = lin[3].with_lora(silu_mul(lin[2].with_lora(x, sg)), sg);
    if (i + 1 < L) x = add_rms_norm(m, residual, norms_[2 * i + 2], eps_);
  }
  return m;
}
}  // namespace tm_decode
