// Python bindings of tokenmill's CPU kernels (one extension module, several sources). The one file that
// includes torch's Python side, and of it only pybind11 with torch's casters (Tensor, dtype) rather than
// <torch/extension.h>, whose C++ frontend took ~100 s of a build to parse; the kernels include tensor.h.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <optional>

#include <string>
#include <vector>

#include "decode_step.h"
#include "kernels.h"

// Which build this is, from the compiler's own macros (checked against the level asked for at load).
static std::string isa_level() {
#if defined(TM_AVX512_BF16)
  return "avx512_bf16";
#elif defined(__x86_64__) && defined(__AVX512F__)
  return "avx512";
#elif defined(__x86_64__) && defined(__AVX2__)
  return "avx2";
#else
  return "native";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa_level", &isa_level, "the instruction-set level this build was compiled for");
  m.def("paged_decode", &paged_decode, "decode attention through block tables", py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"),
        py::arg("kv_format") = 0);
  m.def("kv_write_q8", &kv_write_q8, "keys and values into an 8-bit paged cache, a scale per row");
  m.def("rms_norm", &rms_norm, "RMSNorm of rows");
  m.def("add_rms_norm", &add_rms_norm, "residual += x; RMSNorm(residual)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a [T, 2I] gate|up tensor");
  m.def("to_bf16", &to_bf16, "float32 -> bfloat16 with the kernels' own rounding");
  m.def("rope_", &rope_, "rotary embedding in place on the first heads of each row");
  m.def("quantize_rows_u8", &quantize_rows_u8, "rows as q + 128 (q in [-127, 127]) and a float32 scale each");
  m.def("e4m3_rows_bf16", &e4m3_rows_bf16, "rows as float8 e4m3 codes (held in bf16) and a float32 scale each");
  m.def("scale_rows_cols", &scale_rows_cols, "y * row scale * column scale, in float32, rounded once");
  m.def("scale_rows_", &scale_rows_, "y[r, :] *= scales[r] in place, in float32, rounded once");
  m.def("panel_pack", &panel_pack,
        "[N, K] bfloat16 weight or int8 codes as [N/32, K/g, 32, g] panels (g = 2: panel_matmul, q8_matmul, "
        "f8_matmul; g = 4: i8_matmul)",
        py::arg("weight"), py::arg("group") = 2);
  m.def("panel_matmul", &panel_matmul, "x @ W^T for a few rows (vector loops) or a few dozen (brgemm)");
  m.def("panel_dot_available", &panel_dot_available, "whether this build has the AVX512-BF16 loops (bf16 dot loops; 4-bit, 8-bit, W8A8 and fp8 panels)");
  m.def("panel_matmul_dot", &panel_matmul_dot, "x @ W^T for bfloat16 rows by vdpbf16ps (AVX512-BF16), 256 a sweep");
  m.def("panel_matmul_wide", &panel_matmul_wide,
        "x @ W^T for float32 rows and bfloat16 panels, widened to float32 in the kernel (any number of rows)");
  m.def("panel_wide_fast", &panel_wide_fast, "whether panel_matmul_wide has this build's vector loops (AVX2 + FMA)");
  m.def("q4_matmul_wide", &q4_matmul_wide,
        "W4A8 by vpmaddubsw (AVX2): float32 or bfloat16 rows, quantized per group of 32, x 4-bit panels, as float32");
  m.def("q4_wide_available", &q4_wide_available, "whether this build has the AVX2 4-bit loops");
  m.def("g8_matmul_wide", &g8_matmul_wide,
        "W8A8 by vpmaddubsw (AVX2): float32 or bfloat16 rows, quantized per group of 32, x int8 group panels, as float32");
  m.def("g8_wide_available", &g8_wide_available, "whether this build has the AVX2 8-bit loops");
  m.def("q4_matmul", &q4_matmul, "x @ W^T for bfloat16 rows, W in 4-bit panels (Q4Panels): bf16 activations up to exact_rows rows, int8 above");
  m.def("g8_matmul", &g8_matmul,
        "W8A8 in groups of 32: bfloat16 rows quantized per group of 32 x int8 panels with a scale per group "
        "(G8Panels, a Q8_0 block's form), as bfloat16; steps of up to wide_rows rows quantized to 16 bits");
  m.def("q8_matmul", &q8_matmul, "x @ W^T * scale for up to 4 bfloat16 rows, W in int8 panels (Q8Panels)");
  m.def("i8_matmul", &i8_matmul,
        "W8A8: uint8 rows (q + 128) x int8 panels (group 4), 256 rows a sweep, scaled per row and column, "
        "as bfloat16");
  m.def("f8_matmul", &f8_matmul,
        "fp8: e4m3 codes (in bf16) x e4m3 panels (bytes, group 2), 256 rows a sweep, scaled per row and "
        "column, as bfloat16");
  m.def("sample_rows", &sample_rows, "a token per row of logits at temperature T, by inverse CDF at u");
  m.def("prefill_attention", &prefill_attention,
        "causal attention of whole prompts (segments from position 0) on oneDNN's brgemm micro-kernel");
  m.def("prefill_attention_cached", &prefill_attention_cached,
        "causal attention of prompt chunks after a cached context, read through block tables");
  m.def("argmax_rows", &argmax_rows, "each row's first maximum (a NaN counts as the largest)");
  m.def("lora_delta_", &lora_delta_,
        "y[rows, part] += (x[rows] A_slot^T) B_slot for each segment (start, end, slot) and adapted part "
        "(lora/layer.py), in float32");
  using tm_decode::DecodeLayers;
  // Local to each build's module: a process that loads two instruction-set builds registers it twice.
  py::class_<DecodeLayers, std::shared_ptr<DecodeLayers>>(
      m, "DecodeLayers", py::module_local(), "a pure decode step's decoder layers as one call (models/decode_step.py)")
      .def(py::init<std::vector<int64_t>, std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>,
                    std::vector<std::optional<at::Tensor>>, std::vector<std::vector<at::Tensor>>,
                    std::vector<at::Tensor>, int64_t, int64_t, int64_t, double>())
      .def_property_readonly("num_layers", &DecodeLayers::num_layers)
      .def("set_lora", &DecodeLayers::set_lora)
      // No Python object is touched inside: the engine's other threads (its I/O) run meanwhile.
      .def("run", &DecodeLayers::run, py::call_guard<py::gil_scoped_release>());
}
