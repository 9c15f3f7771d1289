"""int4: 4-bit weights in groups of 32 (a GGUF file's own codes where it has them), the output head at 8
bits; a copy of each weight for steps above QUANT_MAX_ROWS rows where the 4-bit kernels stop there (in
the model's dtype; in a float32 model, int8 groups on the AVX2 8-bit loops, or widened bf16 panels)."""

from __future__ import annotations

import functools
from typing import ClassVar

import torch
from torch import nn

from tokenmill.models.linear import GroupInt8Linear, QuantizedLinear, WideFor, quantize_linears
from tokenmill.models.quant.codes import shard_codes
from tokenmill.models.quant.method import QuantMethod, register

# Up to this many rows per step the int4 kernel beats bf16 here (benchmarks/linear_kernels.py).
QUANT_MAX_ROWS = 4


@register
class Int4(QuantMethod):
    name = "int4"
    float32_rows = True  # the AVX2 4-bit loops take float32 rows, and so do the big-step copies

    # Whether the head may take int8's group form (benchmarks/perplexity.py turns it off to compare).
    head_in_groups: ClassVar[bool] = True
    # Whether any of its kernels quantizes a step's activations to 8 bits (W4A8), once applied.
    a8 = False

    def apply(self, wide_for: WideFor | None) -> None:
        model, quant = self.model, self.quant
        file_codes = quant.codes.int4() if quant.codes is not None else None
        # The output head stays at 8 bits: it is the embedding (Q8_0 or Q6_K in llama.cpp's Q4 files),
        # and every logit depends on it; but a file that keeps it in 4 bits too gives its own codes
        # (weights/loader.py's load_group_codes), which the head takes: the file's weights exactly, in half
        # the bytes.
        head_codes = "lm_head" in (file_codes or {})
        if not head_codes and self.head_in_groups:
            self._head_in_groups()
        a8 = quant.int4_activations == "int8"
        if wide_for is not None and a8 and model.ops.group_wide_available():
            # A float32 model's copy for big steps: the 4-bit weights in int8 groups on the AVX2 8-bit
            # loops (W8A8, as the 4-bit loops' activations) rather than widened bf16 panels: 8.5 bits a
            # weight rather than 16, and faster at every row count (benchmarks/wide_bf16.py --kernel).
            group_for = functools.partial(model.ops.group_int8_matmul_for, float32_rows=True)
            widened = wide_for

            def wide_for(linear: nn.Linear) -> nn.Module:
                return GroupInt8Linear.of(linear, group_for) or widened(linear)

        quantize_linears(
            model,
            QUANT_MAX_ROWS,
            bits_for={"lm_head": 4 if head_codes else 8},
            default_bits=4,
            quant_for=functools.partial(
                model.ops.quantized_matmul_for,
                int8_activations=a8,
                float32_rows=wide_for is not None,  # the AVX2 4-bit loops: for a float32 model's rows only
            ),
            small_for=model.ops.small_matmul_for,
            codes=shard_codes(model, file_codes) if file_codes else None,
            wide_for=wide_for,
        )
        # Any kernel that quantizes a step's activations (the 4-bit panels above 2 rows, the AVX2 4-bit
        # loops up to 4, the int8-group copies above) changes the keys and values (label()).
        layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
        self.a8 = any(
            getattr(m.small, "int8_activations", False) or isinstance(m.wide, GroupInt8Linear) for m in layers
        )

    def label(self) -> str | None:
        return "int4-a8" if self.a8 else "int4"

    def _head_in_groups(self) -> bool:
        """The 8-bit output head in int8's group form where the group panels run: a Q8_0 file's own head
        codes (FileCodes.int8_head; the embedded model's), else its weight quantized into groups of 32,
        times the activations as 16-bit codes per group at every row count (G8Panels' wide rows: the
        precision of bf16 activations). It then computes the file's weights as they are, where the
        per-channel form (Q8Panels) quantized their values again (int4's perplexity +0.12% against
        +0.22%), and faster up to 32 rows: on SmolLM2-135M's 49152 x 576 head (AMD Zen 4) 1.5x at 1 row
        in the model, 1.6-2.6x at 2-8, 1.0x at 32, 0.9x at 128 (docs/history/benchmarks.md, 23rd sitting).
        With 8-bit activation codes it would be 1.5x faster at 32-128 rows, but they cost +0.3%
        perplexity, more than all the 4-bit layers' W4A8 (benchmarks/perplexity.py). Whether it took
        the form."""
        model = self.model
        if not model.shard.last_stage or self.dtype != torch.bfloat16:
            return False
        if not model.ops.group_panels_available():
            return False
        given = self.quant.codes.int8_head() if self.quant.codes is not None else None
        head = shard_codes(model, given).get("lm_head") if given else None
        group_for = functools.partial(model.ops.group_int8_matmul_for, wide_rows=2**62)
        layer = GroupInt8Linear.of(model.lm_head, group_for, head)
        if layer is None:
            return False
        model.lm_head = layer
        return True
