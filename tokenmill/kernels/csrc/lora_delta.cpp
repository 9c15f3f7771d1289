// The LoRA deltas of one linear for a step's segments (tokenmill/lora/layer.py): for each segment of rows
// on one adapter slot and each part the slot adapts, y[rows, part] += (x[rows] A_slot^T) B_slot, in
// float32 over float32 A^T ([slots, K, parts * R]) and B (per part [slots, R, width], scaling folded in).
//
// PyTorch's matmuls for these shapes (a few rows, an inner dimension of the rank) took ~35 us each on a
// 2-core AMD Zen 3, mostly dispatch and the thread pool's wake-up, and a linear took one plus one per part
// per segment: 13% of a 32-stream decode step on one adapter, 23% on four. Here it is one call a linear,
// blocks of four rows of one slot in parallel: their shrink reads each row of A^T once for the four (two
// registers of eight columns each, accumulated in registers), their expand runs sixteen columns of the
// four rows at a time over B's rank rows (each load of B serving the four). (Loops the compiler vectorized on its own were slower than
// PyTorch: their accumulators went through memory, a dependent load-add-store per step.)
#include "tensor.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec_math.h"

namespace {

// Eight floats in a register (GCC's vector extension: AVX at the AVX2 and AVX-512 levels), so that the
// accumulators below stay in registers instead of a load-add-store chain through memory per step.
typedef float v8 __attribute__((vector_size(32)));

inline v8 ld(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void st(float* p, v8 v) { std::memcpy(p, &v, sizeof(v)); }

constexpr int64_t kRows = 4;  // rows of one slot whose shrink is computed together (A^T read once)

// sh[i][0:PR] = x[i] A^T for n <= kRows rows (x as float32, K each): columns sixteen at a time with
// 2 kRows accumulators, then the rest one by one.
void shrink_rows(const float* x, int64_t n, int64_t K, const float* at, int64_t PR, float* sh) {
  int64_t c = 0;
  for (; c + 16 <= PR; c += 16) {
    v8 a0[kRows] = {}, a1[kRows] = {};
    for (int64_t k = 0; k < K; ++k) {
      const v8 w0 = ld(at + k * PR + c), w1 = ld(at + k * PR + c + 8);
      for (int64_t i = 0; i < n; ++i) {
        const float v = x[i * K + k];
        a0[i] += v * w0;
        a1[i] += v * w1;
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      st(sh + i * PR + c, a0[i]);
      st(sh + i * PR + c + 8, a1[i]);
    }
  }
  for (; c < PR; ++c)
    for (int64_t i = 0; i < n; ++i) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += x[i * K + k] * at[k * PR + c];
      sh[i * PR + c] = acc;
    }
}

// y[i][0:W] += sum_r sh[i][r] B[r][0:W] for n <= kRows rows (float32, `ys` apart; sh rows `ss` apart):
// sixteen columns at a time in 2 kRows accumulators, each of B's loads serving every row.
void expand_rows(float* y, int64_t ys, int64_t n, const float* sh, int64_t ss, const float* b, int64_t R,
                 int64_t W) {
  int64_t j = 0;
  for (; j + 16 <= W; j += 16) {
    v8 a0[kRows], a1[kRows];
    for (int64_t i = 0; i < n; ++i) {
      a0[i] = ld(y + i * ys + j);
      a1[i] = ld(y + i * ys + j + 8);
    }
    for (int64_t r = 0; r < R; ++r) {
      const v8 w0 = ld(b + r * W + j), w1 = ld(b + r * W + j + 8);
      for (int64_t i = 0; i < n; ++i) {
        const float v = sh[i * ss + r];
        a0[i] += v * w0;
        a1[i] += v * w1;
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      st(y + i * ys + j, a0[i]);
      st(y + i * ys + j + 8, a1[i]);
    }
  }
  for (; j < W; ++j)
    for (int64_t i = 0; i < n; ++i) {
      float acc = y[i * ys + j];
      for (int64_t r = 0; r < R; ++r) acc += sh[i * ss + r] * b[r * W + j];
      y[i * ys + j] = acc;
    }
}

struct Block {
  int64_t row, n, slot;  // first row of y, rows (at most kRows), the slot they run on
};

template <typename T>
void delta(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const std::vector<at::Tensor>& bs,
           const std::vector<int64_t>& lo, const std::vector<Block>& blocks, const uint8_t* active) {
  const int64_t K = x.size(1), PR = a.size(2), P = static_cast<int64_t>(bs.size()), R = PR / P;
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const int64_t xs = x.stride(0), ys = y.stride(0);
  const float* ap = a.data_ptr<float>();
  int64_t widest = 0;
  for (const auto& b : bs) widest = std::max<int64_t>(widest, b.size(2));
  const int64_t work = kRows * (K * PR + R * widest * P);
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), std::max<int64_t>(1, 65536 / std::max<int64_t>(1, work)),
                   [&](int64_t b0, int64_t b1) {
    std::vector<float> xf(kRows * K), sh(kRows * PR), acc(kRows * widest);
    for (int64_t bi = b0; bi < b1; ++bi) {
      const Block& blk = blocks[bi];
      for (int64_t i = 0; i < blk.n; ++i) load_f32(xp + (blk.row + i) * xs, xf.data() + i * K, K);
      shrink_rows(xf.data(), blk.n, K, ap + blk.slot * K * PR, PR, sh.data());
      for (int64_t p = 0; p < P; ++p) {
        if (!active[blk.slot * P + p]) continue;
        const int64_t W = bs[p].size(2);
        const float* bp = bs[p].data_ptr<float>() + blk.slot * R * W;
        if constexpr (std::is_same_v<T, float>) {
          expand_rows(yp + blk.row * ys + lo[p], ys, blk.n, sh.data() + p * R, PR, bp, R, W);
        } else {
          for (int64_t i = 0; i < blk.n; ++i) load_f32(yp + (blk.row + i) * ys + lo[p], acc.data() + i * W, W);
          expand_rows(acc.data(), W, blk.n, sh.data() + p * R, PR, bp, R, W);
          for (int64_t i = 0; i < blk.n; ++i) store_f32(acc.data() + i * W, yp + (blk.row + i) * ys + lo[p], W);
        }
      }
    }
  });
}

}  // namespace

void lora_delta_(at::Tensor y, at::Tensor x, at::Tensor a, std::vector<at::Tensor> bs, std::vector<int64_t> lo,
                 at::Tensor segments, at::Tensor active) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "x [T, K], y [T, N]");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "x and y: contiguous rows");
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "x and y: one dtype");
  TORCH_CHECK(a.scalar_type() == at::kFloat && a.dim() == 3 && a.is_contiguous() && a.size(1) == x.size(1),
              "a: [slots, K, parts * rank] float32 (A transposed), contiguous");
  const int64_t L = a.size(0), P = static_cast<int64_t>(bs.size());
  TORCH_CHECK(P > 0 && a.size(2) % P == 0 && static_cast<int64_t>(lo.size()) == P, "one B and offset a part");
  const int64_t R = a.size(2) / P;
  for (int64_t p = 0; p < P; ++p) {
    const auto& b = bs[p];
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.dim() == 3 && b.is_contiguous() && b.size(0) == L &&
                    b.size(1) == R && lo[p] >= 0 && lo[p] + b.size(2) <= y.size(1),
                "b: [slots, rank, width] float32, contiguous, within y");
  }
  TORCH_CHECK(active.scalar_type() == at::kByte && active.numel() == L * P && active.is_contiguous(),
              "active: [slots, parts] uint8");
  TORCH_CHECK(segments.scalar_type() == at::kLong && segments.dim() == 2 && segments.size(1) == 3 &&
                  segments.is_contiguous(),
              "segments: [S, 3] long (start, end, slot)");
  const int64_t* sg = segments.data_ptr<int64_t>();
  std::vector<Block> blocks;
  for (int64_t i = 0; i < segments.size(0); ++i) {
    const int64_t start = sg[3 * i], end = sg[3 * i + 1], slot = sg[3 * i + 2];
    TORCH_CHECK(0 <= start && start <= end && end <= x.size(0) && 0 <= slot && slot < L, "segment out of range");
    for (int64_t t = start; t < end; t += kRows) blocks.push_back({t, std::min(kRows, end - t), slot});
  }
  if (blocks.empty()) return;
  const uint8_t* act = active.data_ptr<uint8_t>();
  if (x.scalar_type() == at::kFloat) {
    delta<float>(y, x, a, bs, lo, blocks, act);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "x: float32 or bfloat16");
    delta<c10::BFloat16>(y, x, a, bs, lo, blocks, act);
  }
}
