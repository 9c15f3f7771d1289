// bfloat16 matrix-vector products for decode steps of a few rows: y[M, N] = x[M, K] @ W^T.
//
// A step of one to three rows is bound by reading the weights once. W is stored as column panels
// [N/16][K][16], so a thread's share of the panels is one contiguous stream read front to back, and
// every weight is widened to float32 once for all M rows.
//
// What set the speed, measured in the model (SmolLM2-135M, one stream, Intel Xeon with AMX, 2 cores,
// docs/benchmarks.md): oneDNN's packed matmul 18.7 ms a token; these loops without software prefetch
// 17.8; prefetching 8 KB ahead into L1 (T0) 17.9, 16 KB ahead 16.3; into L2 (T1) 8 KB ahead 14.4-14.8,
// 16-128 KB ahead 15.0-15.6; non-temporal (NTA) 20.7-21.9. The hardware prefetchers stop at each 4 KB
// page and ramp up again after every call's first misses; a software prefetch a few pages ahead keeps
// the stream going, and into L2 rather than L1 it leaves L1 to the loads of the moment.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <vector>

#include "vec_math.h"

namespace {

constexpr int64_t kPanel = 16;          // output columns a panel holds (one AVX-512 register of floats)
constexpr int64_t kAheadBytes = 8192;   // how far ahead of the loads the prefetch runs
constexpr int64_t kLine = 64;

// Into L2 (GCC's locality 2 is prefetcht1 on x86; other targets take their nearest equivalent).
static inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

// Independent partial sums along K: two per row up to four rows (one accumulator chain per row ran at
// the FMA latency rather than at the memory's pace; four per row at one row measured 9% slower than
// two, all of SmolLM2's linears), one per row above (eight rows' chains are already independent).
template <int M>
constexpr int partial_sums() { return M <= 4 ? 2 : 1; }

#if defined(__AVX512F__)
// The accumulators live in registers: GCC kept the plain loops' ones in memory (11 GB/s at one row).
template <typename T, int M>
void panels_avx512(const float* xf, const c10::BFloat16* w, T* y, int64_t K, int64_t N, int64_t ys,
                   int64_t begin, int64_t end) {
  constexpr int UK = partial_sums<M>();
  for (int64_t p = begin; p < end; ++p) {
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(w + p * K * kPanel);
    const char* ahead = reinterpret_cast<const char*>(wp) + kAheadBytes;
    __m512 acc[UK][M];
    for (int u = 0; u < UK; ++u)
      for (int m = 0; m < M; ++m) acc[u][m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + UK <= K; k += UK) {
      // UK k-steps read UK * 32 bytes: one prefetch per 64-byte line (past the panel is the next one,
      // contiguous; past the thread's last panel a prefetch is only a wasted hint, never a fault).
      for (int64_t b = 0; b < UK * kPanel * 2; b += kLine) prefetch_l2(ahead + k * kPanel * 2 + b);
      for (int u = 0; u < UK; ++u) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + (k + u) * kPanel));
        const __m512 wv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        for (int m = 0; m < M; ++m) acc[u][m] = _mm512_fmadd_ps(_mm512_set1_ps(xf[m * K + k + u]), wv, acc[u][m]);
      }
    }
    for (; k < K; ++k) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + k * kPanel));
      const __m512 wv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      for (int m = 0; m < M; ++m) acc[0][m] = _mm512_fmadd_ps(_mm512_set1_ps(xf[m * K + k]), wv, acc[0][m]);
    }
    const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
    for (int m = 0; m < M; ++m) {
      __m512 s = acc[0][m];
      for (int u = 1; u < UK; ++u) s = _mm512_add_ps(s, acc[u][m]);
      alignas(64) float sum[kPanel];
      _mm512_store_ps(sum, s);
      store_f32(sum, y + m * ys + n0, cols);
    }
  }
}
#endif

// The same arithmetic as plain loops over 16-float arrays, which the compiler vectorizes at the AVX2
// level (a laptop's) and elsewhere.
template <typename T, int M>
void panels_plain(const float* xf, const c10::BFloat16* w, T* y, int64_t K, int64_t N, int64_t ys,
                  int64_t begin, int64_t end) {
  constexpr int UK = partial_sums<M>();
  float wf[UK][kPanel];
  for (int64_t p = begin; p < end; ++p) {
    const c10::BFloat16* wp = w + p * K * kPanel;
    const char* ahead = reinterpret_cast<const char*>(wp) + kAheadBytes;
    float acc[UK][M][kPanel] = {};
    int64_t k = 0;
    for (; k + UK <= K; k += UK) {
      for (int64_t b = 0; b < UK * kPanel * 2; b += kLine) prefetch_l2(ahead + k * kPanel * 2 + b);
      for (int u = 0; u < UK; ++u) load_f32(wp + (k + u) * kPanel, wf[u], kPanel);
      for (int u = 0; u < UK; ++u) {
        for (int m = 0; m < M; ++m) {
          const float xv = xf[m * K + k + u];
#pragma omp simd
          for (int64_t j = 0; j < kPanel; ++j) acc[u][m][j] += xv * wf[u][j];
        }
      }
    }
    for (; k < K; ++k) {
      load_f32(wp + k * kPanel, wf[0], kPanel);
      for (int m = 0; m < M; ++m) {
        const float xv = xf[m * K + k];
#pragma omp simd
        for (int64_t j = 0; j < kPanel; ++j) acc[0][m][j] += xv * wf[0][j];
      }
    }
    const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
    for (int m = 0; m < M; ++m) {
      float sum[kPanel];
      for (int64_t j = 0; j < kPanel; ++j) {
        float s = acc[0][m][j];
        for (int u = 1; u < UK; ++u) s += acc[u][m][j];
        sum[j] = s;
      }
      store_f32(sum, y + m * ys + n0, cols);
    }
  }
}

template <typename T, int M>
void gemv_rows(const float* xf, const c10::BFloat16* w, T* y, int64_t K, int64_t N, int64_t ys) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  // ~64 KB of weights a task at least: small enough to share the threads fairly, large enough that a
  // thread's stream outlasts the prefetch's start-up.
  const int64_t grain = std::max<int64_t>(1, 2048 / std::max<int64_t>(K, 1));
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
#if defined(__AVX512F__)
    panels_avx512<T, M>(xf, w, y, K, N, ys, begin, end);
#else
    panels_plain<T, M>(xf, w, y, K, N, ys, begin, end);
#endif
  });
}

template <typename T>
void gemv_dispatch(const float* xf, const c10::BFloat16* w, T* y, int64_t M, int64_t K, int64_t N, int64_t ys) {
  switch (M) {
    case 1: return gemv_rows<T, 1>(xf, w, y, K, N, ys);
    case 2: return gemv_rows<T, 2>(xf, w, y, K, N, ys);
    case 3: return gemv_rows<T, 3>(xf, w, y, K, N, ys);
    case 4: return gemv_rows<T, 4>(xf, w, y, K, N, ys);
    case 5: return gemv_rows<T, 5>(xf, w, y, K, N, ys);
    case 6: return gemv_rows<T, 6>(xf, w, y, K, N, ys);
    case 7: return gemv_rows<T, 7>(xf, w, y, K, N, ys);
    case 8: return gemv_rows<T, 8>(xf, w, y, K, N, ys);
    default: break;
  }
  for (int64_t m0 = 0; m0 < M; m0 += 8) {  // more rows: eight at a time (each pass reads W again)
    const int64_t r = std::min<int64_t>(8, M - m0);
    gemv_dispatch<T>(xf + m0 * K, w, y + m0 * ys, r, K, N, ys);
  }
}

}  // namespace

// [N, K] bfloat16 weight -> [ceil(N/16), K, 16] panels (columns past N are zero).
torch::Tensor gemv_pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "weight must be [N, K] bfloat16");
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + kPanel - 1) / kPanel;
  auto padded = torch::zeros({panels * kPanel, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({panels, kPanel, K}).transpose(1, 2).contiguous();
}

// x: [M, K] (bfloat16 or float32, rows may be strided), panels from gemv_pack, n: output columns.
torch::Tensor gemv(torch::Tensor x, torch::Tensor panels, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous(), "panels: gemv_pack's");
  TORCH_CHECK(panels.scalar_type() == at::kBFloat16 && panels.size(1) == x.size(1), "K mismatch");
  TORCH_CHECK(n > 0 && n <= panels.size(0) * kPanel, "n out of range");
  const int64_t M = x.size(0), K = x.size(1);
  auto y = torch::empty({M, n}, x.options());
  if (M == 0) return y;
  std::vector<float> xf(M * K);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "gemv", [&] {
    for (int64_t m = 0; m < M; ++m) load_f32(x.data_ptr<scalar_t>() + m * x.stride(0), &xf[m * K], K);
    gemv_dispatch<scalar_t>(xf.data(), panels.data_ptr<c10::BFloat16>(), y.data_ptr<scalar_t>(), M, K, n, n);
  });
  return y;
}
