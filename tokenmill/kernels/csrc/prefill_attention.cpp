// Causal attention of whole prompts (prefill segments that start at position 0, so a segment's own keys
// and values are its whole context), bf16 in and out, float32 scores and softmax. The two products run on
// oneDNN's batch-reduce GEMM micro-kernel as PyTorch exposes it (at::native::cpublas::brgemm: AMX tiles
// on CPUs that have them, vdpbf16ps on AVX512-BF16 ones).
//
// Why not PyTorch's flash attention for CPU: in bf16 it calls a full oneDNN matmul per block of 64
// queries x 512 keys (a primitive's set-up each time), computes the whole key block even where the
// causal mask hides it (for prompts under 512 tokens, twice the work), and reads each key and value
// once per query head. Here each (segment, kv head) packs its keys and values once into the layout the
// micro-kernel wants, the query heads that share that kv head reuse them, and a block of queries only
// multiplies the key panels its causal bound reaches.
#include "tensor.h"

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <vector>

#include "kv_rows.h"
#include "vec_math.h"

namespace {

constexpr int64_t kKeyPanel = 64;  // keys per packed panel: the causal bound is kept to this grain
constexpr int64_t kQueryBlock = 64;  // query rows per work item

using bf16 = at::BFloat16;

// Keys [n, D] (rows `stride` elements apart) as transposed panels for S = Q K^T: panel p holds keys
// p*64.. in the VNNI-2 layout of a [D, 64] matrix ([D/2][64][2]: the two halves of a dimension pair
// side by side), zeros past the last key.
void pack_keys(const bf16* k, int64_t n, int64_t stride, int64_t D, bf16* out) {
  if (n % kKeyPanel)  // the last panel's columns past the last key are zero
    std::memset(static_cast<void*>(out + (n / kKeyPanel) * kKeyPanel * D), 0, sizeof(bf16) * kKeyPanel * D);
  for (int64_t j = 0; j < n; ++j) {
    bf16* panel = out + (j / kKeyPanel) * kKeyPanel * D;
    const int64_t col = j % kKeyPanel;
    const bf16* row = k + j * stride;
    for (int64_t d = 0; d < D; ++d) panel[(d / 2) * kKeyPanel * 2 + col * 2 + (d % 2)] = row[d];
  }
}

// Values [n, D] in the VNNI-2 layout of a [keys, D] matrix ([keys/2][D][2]) for O = P V, padded with
// zero rows to whole panels.
void pack_values(const bf16* v, int64_t n, int64_t stride, int64_t D, bf16* out) {
  const int64_t padded = (n + kKeyPanel - 1) / kKeyPanel * kKeyPanel;
  const int64_t from = n / 2 * 2;  // the pair holding the last odd key, and every pair after it, zeroed
  std::memset(static_cast<void*>(out + from * D), 0, sizeof(bf16) * (padded - from) * D);
  for (int64_t j = 0; j < n; ++j) {
    const bf16* row = v + j * stride;
    bf16* dst = out + (j / 2) * D * 2 + (j % 2);
    for (int64_t d = 0; d < D; ++d) dst[d * 2] = row[d];
  }
}

// One query row's softmax over the first `seen` of its scores, which lie in panels `panel_stride` floats
// apart, 64 a panel: weights exp((s - max) * sc) stored as bf16 in `panels` panels (the block's: zeros
// past `seen`), and 1 / the sum of the float weights returned (the normalization, applied to the
// output row).
float softmax_row(const float* s, int64_t panel_stride, int64_t panels, int64_t seen, float sc, bf16* w) {
#if defined(__AVX512F__)
  // Sixteen lanes at a time with masks, the horizontal reductions once per row: GCC left the plain
  // loop scalar (the select between the exponential and zero and the rounding to bf16 kept it from
  // vectorizing), three quarters of the kernel's time.
  auto mask = [&](int64_t j) {
    const int64_t left = seen - j;
    return left >= 16 ? static_cast<__mmask16>(0xFFFF)
           : left <= 0 ? static_cast<__mmask16>(0)
                       : static_cast<__mmask16>((1u << left) - 1u);
  };
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t p = 0; p * kKeyPanel < seen; ++p)
    for (int64_t j = 0; j < kKeyPanel; j += 16)
      vmax = _mm512_mask_max_ps(vmax, mask(p * kKeyPanel + j), vmax, _mm512_loadu_ps(s + p * panel_stride + j));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax)), c = _mm512_set1_ps(sc);
  __m512 acc = _mm512_setzero_ps();
  alignas(64) float e16[kKeyPanel];
  for (int64_t p = 0; p < panels; ++p) {
    for (int64_t j = 0; j < kKeyPanel; j += 16) {
      const __m512 x = _mm512_loadu_ps(s + p * panel_stride + j);
      const __m512 e = _mm512_maskz_mov_ps(mask(p * kKeyPanel + j), exp_approx16(_mm512_mul_ps(_mm512_sub_ps(x, m), c)));
      acc = _mm512_add_ps(acc, e);
      _mm512_store_ps(e16 + j, e);
    }
    store_f32(e16, w + p * panel_stride, kKeyPanel);  // the shared bf16 rounding (vcvtneps2bf16 where built)
  }
  return 1.f / _mm512_reduce_add_ps(acc);
#else
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t p = 0; p * kKeyPanel < seen; ++p)
    mx = std::max(mx, max_of(s + p * panel_stride, std::min(kKeyPanel, seen - p * kKeyPanel)));
  float sum = 0.f;
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t j = 0; j < kKeyPanel; ++j) {
      const float ex = p * kKeyPanel + j < seen ? exp_approx((s[p * panel_stride + j] - mx) * sc) : 0.f;
      sum += ex;
      reinterpret_cast<uint16_t*>(w + p * panel_stride)[j] = bf16_bits(ex);
    }
  return 1.f / sum;
#endif
}

// v's storage, grown to at least n elements (its contents are not kept meaningful between calls).
template <typename T>
T* grown(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

// The attention itself, whatever holds the keys and values. Segment i's queries are rows
// starts[i]..starts[i]+lens[i]-1 of q (rows qs elements apart, heads D apart) at positions past[i]..;
// they see keys 0..past[i]+lens[i]-1, which pack(i, g, keys_out, values_out) writes for kv head g in the
// layouts above. out [T, H, D] contiguous.
template <typename Pack>
void attend(const bf16* qp, int64_t qs, bf16* op, int64_t H, int64_t Hkv, int64_t D, int64_t S,
            const int64_t* seg_start, const int64_t* seg_len, const int64_t* past, float sc, const Pack& pack) {
  const int64_t group = H / Hkv;
  auto padded_of = [&](int64_t s) { return (past[s] + seg_len[s] + kKeyPanel - 1) / kKeyPanel * kKeyPanel; };

  // Packed keys and values of every (segment, kv head), one buffer; offsets in elements.
  std::vector<int64_t> pack_off(S + 1, 0);
  int64_t max_padded = 0;
  for (int64_t s = 0; s < S; ++s) {
    max_padded = std::max(max_padded, padded_of(s));
    pack_off[s + 1] = pack_off[s] + Hkv * padded_of(s) * D;
  }
  // Grown, never shrunk, and not zeroed: a fresh allocation per layer call went to mmap and the kernel
  // zeroed its pages, and the packers write every element the products read.
  static thread_local std::vector<bf16> kbuf, vbuf;
  bf16* kpack = grown(kbuf, pack_off[S]);
  bf16* vpack = grown(vbuf, pack_off[S]);
  at::parallel_for(0, S * Hkv, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t s = i / Hkv, g = i % Hkv;
      const int64_t off = pack_off[s] + g * padded_of(s) * D;
      pack(s, g, kpack + off, vpack + off);
    }
  });

  // Work items: (segment, kv head, block of queries), all the group's query heads in one item.
  std::vector<int64_t> item_seg, item_block;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t m = 0; m < seg_len[s]; m += kQueryBlock) {
      item_seg.push_back(s);
      item_block.push_back(m);
    }
  const int64_t items = static_cast<int64_t>(item_seg.size()) * Hkv;
  // Costliest first (a block's cost grows with its causal bound), handed out one at a time: at::parallel_for
  // cuts the range into equal runs, which gave one thread the late, long blocks of a prompt and left the
  // other waiting (a quarter of the time spent in the pool's spin).
  std::vector<int64_t> order(items);
  for (int64_t i = 0; i < items; ++i) order[i] = i;
  auto bound = [&](int64_t i) { return past[item_seg[i / Hkv]] + item_block[i / Hkv]; };
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return bound(a) > bound(b); });
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items);

  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    // Per thread: scores [panels][64 queries][64 keys] (float), weights as bf16 in the same shape, and
    // the output accumulator [64][D].
    static thread_local std::vector<float> sbuf, abuf;
    static thread_local std::vector<bf16> wbuf;
    float* scores = grown(sbuf, max_padded * kQueryBlock);
    bf16* weights = grown(wbuf, max_padded * kQueryBlock);
    float* acc = grown(abuf, kQueryBlock * D);
    float inv[kQueryBlock];
    for (int64_t taken = next.fetch_add(1); taken < items; taken = next.fetch_add(1)) {
      const int64_t i = order[taken];
      const int64_t w = i / Hkv, g = i % Hkv;
      const int64_t s = item_seg[w], m0 = item_block[w];
      const int64_t rows = std::min(kQueryBlock, seg_len[s] - m0);
      const int64_t keys = past[s] + m0 + rows;  // the last query of the block sees keys 0..keys-1
      const int64_t panels = (keys + kKeyPanel - 1) / kKeyPanel;
      const bf16* kpanels = kpack + pack_off[s] + g * padded_of(s) * D;
      const bf16* vpacked = vpack + pack_off[s] + g * padded_of(s) * D;
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const bf16* qrow = qp + (seg_start[s] + m0) * qs + h * D;
        for (int64_t p = 0; p < panels; ++p)
          at::native::cpublas::brgemm(rows, kKeyPanel, D, qs, kKeyPanel, kKeyPanel, false, qrow,
                                      kpanels + p * kKeyPanel * D, scores + p * kQueryBlock * kKeyPanel);
        // Softmax of each query row over keys 0..past+m0+r; weights left unnormalized (1/sum applied to
        // the output row), zero past the causal bound so the padded products add nothing.
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t seen = past[s] + m0 + r + 1;
          inv[r] = softmax_row(scores + r * kKeyPanel, kQueryBlock * kKeyPanel, panels, seen, sc,
                               weights + r * kKeyPanel);
        }
        for (int64_t p = 0; p < panels; ++p)
          at::native::cpublas::brgemm(rows, D, kKeyPanel, kKeyPanel, D, D, p > 0,
                                      weights + p * kQueryBlock * kKeyPanel, vpacked + p * kKeyPanel * D,
                                      acc);
        bf16* orow = op + (seg_start[s] + m0) * H * D + h * D;
        for (int64_t r = 0; r < rows; ++r) {
          float* a = acc + r * D;
          for (int64_t d = 0; d < D; ++d) a[d] *= inv[r];
          store_f32(a, orow + r * H * D, D);
        }
      }
    }
    at::native::cpublas::brgemm_release();
  });
}

// A segment's context rows [0, n) of kv head g, gathered from the paged cache through its block table
// and converted to bf16 (8-bit rows dequantized, rounded as the reference's dequantize_rows rounds),
// into dst [n, D].
template <typename R>
void gather_rows(const typename R::elem* cache, const int64_t* table, int64_t block_size, int64_t Hkv, int64_t g,
                 int64_t n, int64_t D, bf16* dst) {
  const int64_t w = R::width(D);
  std::vector<float> buf(D);
  for (int64_t j = 0; j < n; ++j) {
    const typename R::elem* row = cache + ((table[j / block_size] * block_size + j % block_size) * Hkv + g) * w;
    R::load(row, D, buf.data());
    store_f32(buf.data(), dst + j * D, D);
  }
}

template <typename R>
void attend_cached(const bf16* qp, int64_t qs, bf16* op, int64_t H, int64_t D, at::Tensor k_cache,
                   at::Tensor v_cache, int64_t S, const int64_t* seg_start, const int64_t* seg_len,
                   const int64_t* past, const int64_t* tables, int64_t table_width, float sc) {
  const int64_t block_size = k_cache.size(1), Hkv = k_cache.size(2);
  const auto* kc = reinterpret_cast<const typename R::elem*>(k_cache.data_ptr());
  const auto* vc = reinterpret_cast<const typename R::elem*>(v_cache.data_ptr());
  attend(qp, qs, op, H, Hkv, D, S, seg_start, seg_len, past, sc, [&](int64_t s, int64_t g, bf16* ko, bf16* vo) {
    const int64_t n = past[s] + seg_len[s];
    std::vector<bf16> rows(n * D);
    gather_rows<R>(kc, tables + s * table_width, block_size, Hkv, g, n, D, rows.data());
    pack_keys(rows.data(), n, D, D, ko);
    gather_rows<R>(vc, tables + s * table_width, block_size, Hkv, g, n, D, rows.data());
    pack_values(rows.data(), n, D, D, vo);
  });
}

void check_query(const at::Tensor& q, const at::Tensor& out, int64_t Hkv) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "prefill_attention: bfloat16 queries and output only");
  TORCH_CHECK(q.dim() == 3 && out.is_contiguous() && out.sizes() == q.sizes(), "prefill_attention: shapes");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "prefill_attention: heads must be contiguous in a row");
  TORCH_CHECK(q.size(1) % Hkv == 0 && q.size(2) % 32 == 0,
              "prefill_attention: head size a multiple of 32, heads a multiple of kv heads");
}

}  // namespace

// q [T, H, D], k and v [T, Hkv, D] (rows may be views of a fused qkv tensor: only the last dimension
// must be contiguous), out [T, H, D] contiguous. Segment i is rows starts[i]..starts[i]+lens[i]-1, a
// whole prompt: its own keys and values are its context.
void prefill_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor out,
                       at::Tensor starts, at::Tensor lens, double scale) {
  check_query(q, out, k.size(1));
  TORCH_CHECK(k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16 && k.dim() == 3 && v.dim() == 3 &&
                  k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(1) == v.size(2),
              "prefill_attention: bfloat16 keys and values, heads contiguous in a row");
  const int64_t H = q.size(1), Hkv = k.size(1), D = q.size(2), S = starts.numel();
  auto st = starts.contiguous().to(at::kLong);
  auto ln = lens.contiguous().to(at::kLong);
  const int64_t* seg_start = st.data_ptr<int64_t>();
  const int64_t* seg_len = ln.data_ptr<int64_t>();
  const std::vector<int64_t> past(S, 0);
  const int64_t ks = k.stride(0), vs = v.stride(0);
  const bf16* kp = k.data_ptr<at::BFloat16>();
  const bf16* vp = v.data_ptr<at::BFloat16>();
  attend(q.data_ptr<at::BFloat16>(), q.stride(0), out.data_ptr<at::BFloat16>(), H, Hkv, D, S, seg_start, seg_len,
         past.data(), static_cast<float>(scale), [&](int64_t s, int64_t g, bf16* ko, bf16* vo) {
           pack_keys(kp + seg_start[s] * ks + g * D, seg_len[s], ks, D, ko);
           pack_values(vp + seg_start[s] * vs + g * D, seg_len[s], vs, D, vo);
         });
}

// Prompt chunks that continue a cached context: segment i's queries (rows starts[i].., lens[i] of them)
// sit at positions past[i]..; its keys and values 0..past[i]+lens[i]-1, this chunk's included (the
// backend writes them first), are read from the paged cache [blocks, block_size, Hkv, width] through
// block_tables[i] (kv_format 0: bf16 rows; 1: int8, 2: fp8 e4m3 rows with their float32 scale).
void prefill_attention_cached(at::Tensor q, at::Tensor out, at::Tensor k_cache, at::Tensor v_cache,
                              at::Tensor starts, at::Tensor lens, at::Tensor past,
                              at::Tensor block_tables, double scale, int64_t kv_format) {
  TORCH_CHECK(kv_format >= 0 && kv_format <= 2, "kv_format: 0 (plain), 1 (int8) or 2 (fp8)");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              "prefill_attention_cached: caches [blocks, block_size, kv heads, width], contiguous");
  const int64_t H = q.size(1), Hkv = k_cache.size(2), D = q.size(2), S = starts.numel();
  check_query(q, out, Hkv);
  TORCH_CHECK(kv_format != 0 || (k_cache.scalar_type() == at::kBFloat16 && k_cache.size(3) == D),
              "prefill_attention_cached: a plain cache holds bf16 rows of the head size");
  TORCH_CHECK(kv_format == 0 || (k_cache.scalar_type() == at::kByte && k_cache.size(3) == D + 4),
              "prefill_attention_cached: an 8-bit cache holds rows of head-size codes and a float32 scale");
  auto st = starts.contiguous().to(at::kLong);
  auto ln = lens.contiguous().to(at::kLong);
  auto ps = past.contiguous().to(at::kLong);
  auto bt = block_tables.contiguous().to(at::kLong);
  TORCH_CHECK(bt.dim() == 2 && bt.size(0) == S, "prefill_attention_cached: a block table per segment");
  const int64_t* seg_len = ln.data_ptr<int64_t>();
  const int64_t* seg_past = ps.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s)
    TORCH_CHECK((seg_past[s] + seg_len[s] + k_cache.size(1) - 1) / k_cache.size(1) <= bt.size(1),
                "prefill_attention_cached: a block table shorter than its context");
  const bf16* qp = q.data_ptr<at::BFloat16>();
  bf16* op = out.data_ptr<at::BFloat16>();
  const float sc = static_cast<float>(scale);
  if (kv_format == 0)
    attend_cached<PlainRows<c10::BFloat16>>(qp, q.stride(0), op, H, D, k_cache, v_cache, S, st.data_ptr<int64_t>(),
                                            seg_len, seg_past, bt.data_ptr<int64_t>(), bt.size(1), sc);
  else if (kv_format == 1)
    attend_cached<Q8Rows<false>>(qp, q.stride(0), op, H, D, k_cache, v_cache, S, st.data_ptr<int64_t>(), seg_len,
                                 seg_past, bt.data_ptr<int64_t>(), bt.size(1), sc);
  else
    attend_cached<Q8Rows<true>>(qp, q.stride(0), op, H, D, k_cache, v_cache, S, st.data_ptr<int64_t>(), seg_len,
                                seg_past, bt.data_ptr<int64_t>(), bt.size(1), sc);
}
