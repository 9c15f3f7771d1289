// A pure decode step's decoder layers as one C++ call (decode_step.cpp), declared for the bindings.
#pragma once

#include <optional>
#include <vector>

#include "tensor.h"

namespace tm_decode {

// Which kernel a linear runs (models/decode_step.py's kinds); `param` is its last integer argument and
// `extra` its other tensors (I8: the code-sum offsets and column scales; F8: the column scales).
enum Kind : int64_t { kDot = 0, kVector = 1, kQ4 = 2, kG8 = 3, kI8 = 4, kF8 = 5, kWide = 6, kQ4Wide = 7,
                      kG8Wide = 8 };

// A linear's LoRA slots (lora/layer.py's LoRALinear: A^T, B per part, each part's first column, which
// parts each slot adapts), shared with the Python wrapper: an adapter read into a slot is seen here.
struct Lora {
  at::Tensor a;
  std::vector<at::Tensor> bs;
  std::vector<int64_t> lo;
  at::Tensor active;
};

struct Linear {
  int64_t kind, n, param;
  at::Tensor panels;
  std::optional<at::Tensor> bias;
  std::vector<at::Tensor> extra;
  std::optional<Lora> lora;

  at::Tensor operator()(const at::Tensor& x) const;
  // The linear, then its LoRA deltas for the step's segments ([S, 3]; none: none).
  at::Tensor with_lora(const at::Tensor& x, const at::Tensor& segments) const;
};

class DecodeLayers {
 public:
  // Per layer four linears (qkv, o, gate_up, down) in `kinds`, `panels`, `ns`, `params` and `biases`;
  // `norms`: layer 0's input norm, then per layer its post-attention norm and the next layer's input norm
  // (none after the last): 2 L weights.
  DecodeLayers(std::vector<int64_t> kinds, std::vector<at::Tensor> panels, std::vector<int64_t> ns,
               std::vector<int64_t> params, std::vector<std::optional<at::Tensor>> biases,
               std::vector<std::vector<at::Tensor>> extras, std::vector<at::Tensor> norms, int64_t heads,
               int64_t kv_heads, int64_t head_dim, double eps);

  int64_t num_layers() const { return static_cast<int64_t>(linears_.size() / 4); }

  // Linear `index` (layer * 4 + qkv, o, gate_up, down) takes LoRA deltas from these slots.
  void set_lora(int64_t index, at::Tensor a, std::vector<at::Tensor> bs, std::vector<int64_t> lo,
                at::Tensor active);

  // residual [T, hidden] (updated in place, as the Python loop does) -> the last layer's MLP output,
  // which the caller adds to the residual. kv_caches: [L, 2, blocks, block_size, Hkv, width], contiguous.
  at::Tensor run(at::Tensor residual, at::Tensor positions, at::Tensor cos, at::Tensor sin_signed,
                    at::Tensor kv_caches, at::Tensor slots, at::Tensor block_tables,
                    at::Tensor context_lens, double scale, int64_t kv_format,
                    at::Tensor lora_segments) const;

 private:
  std::vector<Linear> linears_;
  std::vector<at::Tensor> norms_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_;
};


}  // namespace tm_decode
