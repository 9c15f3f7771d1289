// A step's keys and values into an 8-bit paged KV cache: each (token, kv head) row quantized with its
// own scale and stored at its slot, in one pass (kv_rows.h). As PyTorch ops this was six ops per layer
// and a temporary per op, for a few thousand values.
#include "tensor.h"
#include <ATen/Parallel.h>
#include <vector>

#include "kv_rows.h"

template <typename T, bool FP8>
static void write_rows(const T* x, int64_t sx0, int64_t sx1, uint8_t* cache, const int64_t* slots, int64_t n,
                       int64_t Hkv, int64_t D) {
  const int64_t W = Q8Rows<FP8>::width(D);
  at::parallel_for(0, n * Hkv, grain_for(D), [&](int64_t b, int64_t e) {
    std::vector<float> buf(D);
    for (int64_t r = b; r < e; ++r) {
      const int64_t t = r / Hkv, h = r % Hkv;
      load_f32(x + t * sx0 + h * sx1, buf.data(), D);
      Q8Rows<FP8>::store(buf.data(), D, cache + (slots[t] * Hkv + h) * W);
    }
  });
}

// k, v: [T, Hkv, D] (rows may be strided, D contiguous); caches: [num_blocks, block_size, Hkv, D + 4]
// uint8, contiguous; slots: [T] int64 (block * block_size + offset).
void kv_write_q8(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
                 at::Tensor slots, bool fp8) {
  TORCH_CHECK(k.dim() == 3 && k.stride(2) == 1 && v.dim() == 3 && v.stride(2) == 1, "k, v: [T, Hkv, D]");
  TORCH_CHECK(v.scalar_type() == k.scalar_type() && v.sizes() == k.sizes(), "k and v must match");
  TORCH_CHECK(k_cache.scalar_type() == at::kByte && v_cache.scalar_type() == at::kByte, "uint8 caches");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == k.size(0));
  const int64_t n = k.size(0), Hkv = k.size(1), D = k.size(2);
  TORCH_CHECK(k_cache.size(2) == Hkv && k_cache.size(3) == D + 4, "cache rows must be D + 4 bytes");
  auto sl = slots.contiguous();
  const int64_t capacity = k_cache.size(0) * k_cache.size(1);
  const int64_t* s = sl.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) TORCH_CHECK(s[t] >= 0 && s[t] < capacity, "slot out of range");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "kv_write_q8", [&] {
    for (int side = 0; side < 2; ++side) {
      const at::Tensor& x = side ? v : k;
      uint8_t* c = (side ? v_cache : k_cache).data_ptr<uint8_t>();
      auto fn = fp8 ? &write_rows<scalar_t, true> : &write_rows<scalar_t, false>;
      fn(x.data_ptr<scalar_t>(), x.stride(0), x.stride(1), c, s, n, Hkv, D);
    }
  });
}
