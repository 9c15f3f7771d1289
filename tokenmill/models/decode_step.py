"""A pure decode step's decoder layers as one C++ call (kernels/csrc/decode_step.cpp).

At one stream a decoder layer is ten small kernels, and the Python between them (the linears' and the
attention backend's dispatch, views, argument parsing) was ~30% of the main thread's step on
SmolLM2-135M (AMD Zen 4, perf), while the thread pool's other thread spun waiting for the next kernel.
`DecodeStep` hands the whole layer loop to C++: the same kernels, in the same order, on the same
tensors, so a step gives the Python loop's bits exactly (tests/test_decode_step.py).

It takes the steps it can: decode rows only (prompts and chunks keep the Python loop), the CPU paged
attention backend of the model's own kernel build, no tensor parallelism (its all-reduces are Python
collectives), and every layer's linears on a kernel the C++ step calls (the panel kernels of bf16,
int4, int8 in both forms and fp8, and the widened bf16 panels of a float32 model); a model with any
other linear (oneDNN's or PyTorch's matmuls, as on CPUs without AVX512-BF16 for the quantized forms)
keeps the Python loop for every step. A model serving LoRA adapters has its deltas added after each
linear by the same kernel the Python loop calls (kernels/csrc/lora_delta.cpp), from the same slots.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from tokenmill.lora.layer import NO_SEGMENTS, LoRALinear
from tokenmill.models.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.models.attention.cpu_paged import CpuPagedBackend
from tokenmill.models.fp8_linear import Fp8Linear
from tokenmill.models.linear import GroupInt8Linear, Int8Linear, PackedLinear, QuantizedLinear
from tokenmill.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM
from tokenmill.models.ops import (
    CpuFusedOps,
    F8Panels,
    G8Panels,
    G8WidePanels,
    I8Panels,
    PanelMatmul,
    Q4Panels,
    Q4WidePanels,
)
from tokenmill.models.wide_linear import WideLinear

# The kernels the C++ step calls for a linear (decode_step.cpp's Kind): the bf16 dot loops, the bf16
# vector loops (or brgemm), 4-bit panels, int8 group panels, int8 per-channel panels (W8A8, the rows
# quantized by ops.quantize_rows_u8), fp8 panels (the rows as e4m3 codes by ops.e4m3_rows), bf16 panels
# widened for float32 rows (models/wide_linear.py), 4-bit panels and int8 group panels for float32 rows by
# the AVX2 loops.
DOT, VECTOR, Q4, G8, I8, F8, WIDE, Q4WIDE, G8WIDE = 0, 1, 2, 3, 4, 5, 6, 7, 8


class StepLinear(NamedTuple):
    """A linear as the C++ step runs it: which kernel, its panels, output width, last integer argument,
    bias, the most rows it takes that way (None: any), and the kernel's other tensors."""

    kind: int
    panels: torch.Tensor
    n: int
    param: int
    bias: torch.Tensor | None
    max_rows: int | None
    extra: tuple[torch.Tensor, ...] = ()


def step_linear(linear: nn.Module, ops: CpuFusedOps) -> StepLinear | None:
    """The kernel `linear` runs a decode step's rows on, as the C++ step would call it, or None where that
    is a kernel it does not call. Mirrors each class's forward for bf16 rows of a 2-D step; the rows'
    quantizers of the W8A8 and fp8 forms must be `ops`' own (the C++ step calls that build's). A LoRA
    linear is its base here; the step adds its deltas after it (decode_step_for: DecodeLayers.set_lora)."""
    if isinstance(linear, LoRALinear):
        linear = linear.base
    if isinstance(linear, WideLinear):  # float32 rows, any count
        return StepLinear(WIDE, linear.panels, linear.out_features, 0, linear.bias, None)
    if isinstance(linear, PackedLinear) and isinstance(linear.small, PanelMatmul):
        k = linear.small
        if k.dot:  # panel_matmul_dot for bf16 rows, every row count
            return StepLinear(DOT, k.panels, k.n, 0, linear.bias, None)
        # The vector loops (or brgemm) up to the kernel's rows; above them oneDNN's copy runs.
        rows = k.max_rows if linear.packed is not None else None
        return StepLinear(VECTOR, k.panels, k.n, k.vector_rows, linear.bias, rows)
    if isinstance(linear, QuantizedLinear) and isinstance(linear.small, Q4WidePanels):
        # Float32 rows up to the layer's rows (4); above them its widened bf16 copy runs, in Python.
        kw = linear.small
        return StepLinear(Q4WIDE, kw.panels, kw.n, 0, linear.bias, linear.max_rows)
    if isinstance(linear, QuantizedLinear) and isinstance(linear.small, Q4Panels):
        k4 = linear.small
        return StepLinear(Q4, k4.panels, k4.n, k4.exact_rows, linear.bias, linear.max_rows)
    if isinstance(linear, GroupInt8Linear) and isinstance(linear.kernel, G8WidePanels):
        return StepLinear(G8WIDE, linear.kernel.panels, linear.kernel.n, 0, linear.bias, None)
    if isinstance(linear, GroupInt8Linear) and isinstance(linear.kernel, G8Panels):
        k8 = linear.kernel
        return StepLinear(G8, k8.panels, k8.n, k8.wide_rows, linear.bias, None)
    if isinstance(linear, Int8Linear) and isinstance(linear.small, I8Panels):
        ki = linear.small
        if linear.quantize != ops.quantize_rows_u8:
            return None
        # Int8Linear takes the panels for bf16 rows up to their rows (None: every count).
        return StepLinear(I8, ki.panels, ki.n, 0, linear.bias, linear.small_rows, (ki.offsets, ki.scales))
    if isinstance(linear, Fp8Linear) and isinstance(linear.small, F8Panels):
        kf = linear.small
        if linear.e4m3_rows != ops.e4m3_rows:
            return None
        rows = linear.small_rows if linear.wide is not None else None
        return StepLinear(F8, kf.panels, kf.n, 0, linear.bias, rows, (kf.scales,))
    return None


class DecodeStep:
    """The C++ layer loop of one model (or pipeline stage), built once its weights are final."""

    def __init__(self, model: LlamaForCausalLM, linears: list[StepLinear]) -> None:
        self.kernels = model.ops.k  # type: ignore[attr-defined]
        self.kinds = {s.kind for s in linears}
        limits = [s.max_rows for s in linears if s.max_rows is not None]
        self.max_rows: int | None = min(limits) if limits else None
        norms = [model.layers[0].input_layernorm.weight]
        for i, layer in enumerate(model.layers):
            norms.append(layer.post_attention_layernorm.weight)
            if i + 1 < len(model.layers):
                norms.append(model.layers[i + 1].input_layernorm.weight)
        attn = model.layers[0].self_attn
        # The shortest sliding window of its layers (0: none): a step with a longer context is not taken.
        self.window = min((w for layer in model.layers if (w := layer.self_attn.window)), default=0)
        self.scale = attn.scale
        self.rope = model.rope
        self.lora = model.lora.step if model.lora is not None else None
        self.layers = self.kernels.DecodeLayers(
            [s.kind for s in linears],
            [s.panels for s in linears],
            [s.n for s in linears],
            [s.param for s in linears],
            [s.bias for s in linears],
            [list(s.extra) for s in linears],
            [w.detach() for w in norms],
            attn.num_heads,
            attn.num_kv,
            attn.head_dim,
            model.config.rms_norm_eps,
        )

    def takes(self, rows: int, meta: AttentionMetadata, backend: AttentionBackend, kv: torch.Tensor) -> bool:
        """Whether this step is one the C++ loop runs: decode rows only, within every linear's kernel, on
        the paged backend of the same kernel build (its attention bits), over one contiguous cache."""
        return (
            meta.num_decode == rows
            and (self.max_rows is None or rows <= self.max_rows)
            and type(backend) is CpuPagedBackend
            and backend.kernels is self.kernels
            and kv.is_contiguous()
            and not (self.window and meta.longest_decode_context() > self.window)
        )

    def run(
        self,
        residual: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: torch.Tensor,
        meta: AttentionMetadata,
        backend: CpuPagedBackend,
    ) -> torch.Tensor:
        """Every layer over `residual` (updated in place); the last layer's MLP output, for the caller's
        final residual add."""
        return self.layers.run(
            residual,
            positions,
            self.rope.cos,
            self.rope.sin_signed,
            kv_caches,
            meta.slot_mapping,
            meta.decode_block_tables,
            meta.decode_context_lens,
            self.scale,
            backend.format_code,
            self.lora.tensor if self.lora is not None else NO_SEGMENTS,
        )


def decode_step_for(model: LlamaForCausalLM) -> DecodeStep | None:
    """The model's C++ decode step, or None where its steps keep the Python loop (module doc)."""
    ops = model.ops
    if not isinstance(ops, CpuFusedOps) or model.comm.tp_size > 1 or not len(model.layers):
        return None
    if model.layers[0].input_layernorm.weight.dtype not in (torch.bfloat16, torch.float32):
        return None  # the panel kernels' rows are bf16, or float32 for the widened bf16 panels
    linears = []
    wrapped: list[LoRALinear] = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        llama = type(attn) is Attention and type(mlp) is MLP and type(layer) is DecoderLayer
        if not llama or attn.rope_dim != attn.head_dim:
            return None  # the C++ step is Llama's layer; other families' steps keep the Python loop
        for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            s = step_linear(lin, ops)
            if s is None:
                return None
            linears.append(s)
            if isinstance(lin, LoRALinear):
                if lin.kernel is None:
                    return None  # deltas by PyTorch's matmuls: the Python loop runs them
                wrapped.append(lin)
    if wrapped and len(wrapped) != len(linears):
        return None
    step = DecodeStep(model, linears)
    for i, lin in enumerate(wrapped):  # the same slot tensors as the wrappers': loads are seen here
        step.layers.set_lora(i, lin.a, lin.b, lin.lo, lin.active)
    return step
