"""The C++ decode step (tokenmill/models/decode_step.py, kernels/csrc/decode_step.cpp) against the Python
layer loop it replaces: the same kernels in the same order, so every logit and every byte written to
the KV cache must be equal, bit for bit, on each kernel build this CPU runs, for each linear kernel the
step calls (bf16 panels, 4-bit panels in both activation settings, int8 group and per-channel panels,
fp8 panels), for plain and 8-bit caches, with biases and grouped kv heads; and models it cannot take
keep the Python loop."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.kernels.isa import all_levels
from tokenmill.models.attention.backend import AttentionMetadata, PrefillSegment
from tokenmill.models.attention.registry import get_backend
from tokenmill.models.config import ModelConfig
from tokenmill.models.decode_step import (
    DOT,
    F8,
    G8,
    G8WIDE,
    I8,
    Q4,
    Q4WIDE,
    VECTOR,
    WIDE,
    DecodeStep,
    decode_step_for,
)
from tokenmill.models.linear import onednn_packing_available
from tokenmill.models.llama import build_model
from tokenmill.models.ops import CpuFusedOps
from tokenmill.models.quant import QuantConfig
from tokenmill.models.wide_linear import WIDENING_LEVELS

LEVELS = [lv.name for lv in all_levels() if lv.supported()]
needs_kernels = pytest.mark.skipif(not LEVELS, reason="no kernel build runs on this CPU (it has no AVX2)")
# The bf16 panels sit beside oneDNN's packed copy of each weight (or, where they take every row count,
# alone); oneDNN packs bf16 weights only on AVX-512 CPUs. On an AVX2-only CPU the bf16 linears stay
# plain PyTorch matmuls, which the C++ step does not call: it keeps the Python loop there.
BF16_PANELS = onednn_packing_available(torch.zeros(1, dtype=torch.bfloat16))
NO_BF16_PANELS = "oneDNN packs no bf16 weights on this CPU (it needs AVX-512): the bf16 linears stay plain"


def _no_panels_keeps_the_python_loop(model: torch.nn.Module) -> None:
    """Where the bf16 linears stay plain, the step must keep the Python loop; the rest of a test that
    compares the C++ step with it has nothing to run."""
    assert _loop(model) is None, "plain bf16 linears have no kernel the C++ step calls"
    pytest.skip(NO_BF16_PANELS)


def _loop(model: torch.nn.Module) -> DecodeStep | None:
    """The C++ step a runner gives the model (worker/model_runner.py), set as its layer loop."""
    model.layer_loop = decode_step_for(model)  # type: ignore[assignment]
    return model.layer_loop  # type: ignore[return-value]


# Qwen2-like: biases on q/k/v, 4 query heads on 2 kv heads.
QWEN = ModelConfig("qwen2", 64, 64, 128, 2, 4, 2, 16, attention_bias=True)


def _weights(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    h, i = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    sd = {"embed_tokens.weight": rnd(cfg.vocab_size, h, scale=1), "norm.weight": 1 + rnd(h)}
    sd["lm_head.weight"] = rnd(cfg.vocab_size, h)
    for n in range(cfg.num_layers):
        sd |= {
            f"layers.{n}.self_attn.qkv_proj.weight": rnd(qkv, h),
            f"layers.{n}.self_attn.qkv_proj.bias": rnd(qkv),
            f"layers.{n}.self_attn.o_proj.weight": rnd(h, cfg.num_heads * cfg.head_dim),
            f"layers.{n}.mlp.gate_up_proj.weight": rnd(2 * i, h),
            f"layers.{n}.mlp.down_proj.weight": rnd(h, i),
            f"layers.{n}.input_layernorm.weight": 1 + rnd(h),
            f"layers.{n}.post_attention_layernorm.weight": 1 + rnd(h),
        }
    return {k: v.bfloat16() for k, v in sd.items()}


def _run(model: torch.nn.Module, level: str, kv_format: str | None, rows: int) -> tuple[torch.Tensor, ...]:
    """Prompts of `rows` requests (different lengths), then 5 decode steps of all of them: every step's
    logits and the cache at the end."""
    backend = get_backend(level, "cpu", kv_format)
    cfg, block, cpu = model.config, 16, torch.device("cpu")
    lens = [9 + 5 * r for r in range(rows)]
    per_req = 3  # blocks a request: its prompt and 5 decoded tokens fit
    width = cfg.head_dim + 4 if kv_format else cfg.head_dim
    kv = torch.zeros(
        cfg.num_layers,
        2,
        rows * per_req,
        block,
        cfg.num_kv_heads,
        width,
        dtype=torch.uint8 if kv_format else model.layers[0].input_layernorm.weight.dtype,
    )
    g = torch.Generator().manual_seed(rows)
    out = []
    tables = [list(range(r * per_req, (r + 1) * per_req)) for r in range(rows)]
    for r, n in enumerate(lens):  # each prompt alone (the Python loop's path)
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=g)
        seg = PrefillSegment(0, n, 0, torch.tensor(tables[r]), first_block=tables[r][0])
        slots = [tables[r][p // block] * block + p % block for p in range(n)]
        meta = AttentionMetadata.of(slots, [], [], [seg], block, cpu)
        out.append(model(ids, torch.arange(n), kv, meta, backend, torch.tensor([n - 1])))
    for step in range(5):
        pos = [n + step for n in lens]
        slots = [tables[r][p // block] * block + p % block for r, p in enumerate(pos)]
        meta = AttentionMetadata.of(slots, tables, [p + 1 for p in pos], [], block, cpu)
        ids = torch.randint(0, cfg.vocab_size, (rows,), generator=g)
        out.append(model(ids, torch.tensor(pos), kv, meta, backend, torch.arange(rows)))
    return (*out, kv)


def _counted(step: DecodeStep) -> list[int]:
    """Counts the steps the C++ loop runs."""
    calls = [0]
    run = step.run

    def counted(*a: object, **k: object) -> torch.Tensor:
        calls[0] += 1
        return run(*a, **k)  # type: ignore[arg-type]

    step.run = counted  # type: ignore[method-assign]
    return calls


@needs_kernels
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("kv_format", [None, "int8", "fp8"])
def test_step_gives_the_python_loops_bits(level: str, kv_format: str | None) -> None:
    """bf16 panels (the dot loops on AVX512-BF16, the vector loops on the other builds), q/k/v biases and
    grouped kv heads; 1 and 3 rows a step."""
    model = build_model(QWEN, _weights(QWEN), torch.bfloat16, torch.device("cpu"), 64, level)
    if not BF16_PANELS:
        _no_panels_keeps_the_python_loop(model)
    step = _loop(model)
    assert step is not None, "every linear is on the bf16 panels"
    # The dot loops where they take every row count (AVX512-BF16 without AMX), else the vector loops.
    assert step.kinds == ({DOT} if model.ops.panels_take_every_row() else {VECTOR})
    for rows in (1, 3):
        calls = _counted(step)
        fast = _run(model, level, kv_format, rows)
        assert calls[0] == 5, "every decode step ran in C++, no prompt did"
        model.layer_loop = None
        slow = _run(model, level, kv_format, rows)
        model.layer_loop = step
        for a, b in zip(fast, slow, strict=True):
            assert torch.equal(a, b)


WIDENING = [lv for lv in LEVELS if lv in WIDENING_LEVELS]


@pytest.mark.skipif(not WIDENING, reason="no kernel build without the BF16 loops runs on this CPU")
@pytest.mark.parametrize("level", WIDENING)
@pytest.mark.parametrize("kv_format", [None, "int8"])
def test_step_on_widened_bf16_panels_gives_the_python_loops_bits(level: str, kv_format: str | None) -> None:
    """A float32 model whose linears keep bf16 panels (models/wide_linear.py: CPUs without BF16
    instructions): every linear on the widening kernel, every row count, the Python loop's bits."""
    model = build_model(
        QWEN, _weights(QWEN), torch.float32, torch.device("cpu"), 64, level, QuantConfig(bf16_weights=True)
    )
    step = _loop(model)
    assert step is not None and step.kinds == {WIDE} and step.max_rows is None
    _same_bits_with_the_step(model, step, level, kv_format, (1, 3, 6))


@pytest.mark.skipif(not WIDENING, reason="no kernel build without the BF16 loops runs on this CPU")
@pytest.mark.parametrize("level", WIDENING)
def test_step_on_the_avx2_4bit_loops_gives_the_python_loops_bits(level: str) -> None:
    """int4 in a float32 model of bf16 weights: every layer's linears on the AVX2 4-bit loops (W4A8) up
    to 4 rows, the Python loop's bits; 5 rows keep the Python loop (the widened copies)."""
    model = build_model(
        QWEN,
        _weights(QWEN),
        torch.float32,
        torch.device("cpu"),
        64,
        level,
        QuantConfig("int4", bf16_weights=True),
    )
    step = _loop(model)
    assert step is not None and step.kinds == {Q4WIDE} and step.max_rows == 4
    _same_bits_with_the_step(model, step, level, None, (1, 3))
    calls = _counted(step)
    _run(model, level, None, 5)
    assert calls[0] == 0


@pytest.mark.skipif(not WIDENING, reason="no kernel build without the BF16 loops runs on this CPU")
@pytest.mark.parametrize("level", WIDENING)
@pytest.mark.parametrize("kv_format", [None, "int8"])
def test_step_on_the_avx2_8bit_loops_gives_the_python_loops_bits(level: str, kv_format: str | None) -> None:
    """int8 in a float32 model of bf16 weights: every layer's linears in groups of 32 on the AVX2 8-bit
    loops (W8A8) at every row count, the Python loop's bits."""
    quant = QuantConfig("int8", bf16_weights=True)
    model = build_model(QWEN, _weights(QWEN), torch.float32, torch.device("cpu"), 64, level, quant)
    step = _loop(model)
    assert step is not None and step.kinds == {G8WIDE} and step.max_rows is None
    _same_bits_with_the_step(model, step, level, kv_format, (1, 3, 6))


def _same_bits_with_the_step(
    model: torch.nn.Module, step: DecodeStep, level: str, kv_format: str | None, row_counts: tuple[int, ...]
) -> None:
    for rows in row_counts:
        calls = _counted(step)
        fast = _run(model, level, kv_format, rows)
        assert calls[0] == 5, "every decode step ran in C++, no prompt did"
        model.layer_loop = None
        slow = _run(model, level, kv_format, rows)
        model.layer_loop = step
        for a, b in zip(fast, slow, strict=True):
            assert torch.equal(a, b)


@needs_kernels
def test_vector_loops_take_only_their_rows() -> None:
    """Where the bf16 panels keep oneDNN's copy for larger steps (the vector loops: up to 4 rows; brgemm
    with AMX: up to 96), a step above that keeps the Python loop."""
    level = next((lv for lv in LEVELS if lv != "avx512_bf16"), None)
    if level is None:
        pytest.skip("every kernel build this CPU runs has the dot loops (no vector-loop build)")
    model = build_model(QWEN, _weights(QWEN), torch.bfloat16, torch.device("cpu"), 64, level)
    if not BF16_PANELS:
        _no_panels_keeps_the_python_loop(model)
    step = _loop(model)
    assert step is not None and step.kinds == {VECTOR} and step.max_rows in (4, 96)
    meta = AttentionMetadata.of([0], [[0]], [1], [], 16, torch.device("cpu"))
    backend, kv = get_backend(level), torch.zeros(2, 2, 1, 16, 2, 16, dtype=torch.bfloat16)
    assert step.takes(1, meta, backend, kv)
    meta.num_decode = step.max_rows + 1
    assert not step.takes(step.max_rows + 1, meta, backend, kv)
    if step.max_rows == 4:  # a real step of 5 rows: oneDNN's copy runs it, in Python
        calls = _counted(step)
        _run(model, level, None, 5)
        assert calls[0] == 0


def test_plain_ops_and_float32_keep_the_python_loop() -> None:
    sd = _weights(QWEN)
    assert decode_step_for(build_model(QWEN, sd, torch.bfloat16, torch.device("cpu"), 64, "torch")) is None
    if LEVELS:
        f32 = build_model(QWEN, sd, torch.float32, torch.device("cpu"), 64, LEVELS[-1])
        assert decode_step_for(f32) is None


def _record_logits(llm: LLM) -> list[torch.Tensor]:
    """Every head output of the engine's model from now on, in a list."""
    model = llm.engine.executor.worker.model  # type: ignore[attr-defined]
    seen: list[torch.Tensor] = []
    head = model._lm_head

    def recorded(h: torch.Tensor) -> torch.Tensor:
        y = head(h)
        seen.append(y.clone())
        return y

    model._lm_head = recorded
    return seen


# The embedded model's quantized forms on the kernels this CPU takes them with.
QUANTIZED = [
    ({"quantization": "int4"}, Q4),  # W4A8 from 3 rows
    ({"quantization": "int4", "int4_activations": "bf16"}, Q4),
    ({"quantization": "int8", "int8_scales": "group"}, G8),
    ({"quantization": "int8"}, I8),  # per channel (SmoothQuant) on this Q4_1 file
    ({"quantization": "fp8"}, F8),
    ({"kv_cache_dtype": "int8"}, DOT),
]
IDS = ["int4", "int4-a16", "int8-groups", "int8-channel", "fp8", "bf16-kv-int8"]


@pytest.mark.parametrize(("kw", "kind"), QUANTIZED, ids=IDS)
def test_engine_steps_match_the_python_loop(kw: dict[str, str], kind: int) -> None:
    """The real model in the engine: 4 requests of different lengths, so steps of 4, 3, 2 and 1 rows
    (both sides of int4's W8A8 threshold), each logit equal with the C++ step and without."""
    llm = LLM(max_model_len=256, enable_prefix_caching=False, **kw)
    model = llm.engine.executor.worker.model  # type: ignore[attr-defined]
    ops, step = model.ops, model.layer_loop  # the runner's choice
    if isinstance(ops, CpuFusedOps) and ops.panels_take_every_row():  # AVX512-BF16 without AMX
        assert step is not None and kind in step.kinds
    if step is None:
        pytest.skip("this CPU's kernels for the model are not all ones the C++ step calls")
    calls = _counted(step)
    prompts = ["The capital of France is", "Count: one, two,", "A haiku about the sea:", "def fib(n):"]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 5, 7, 9)]
    seen = _record_logits(llm)
    fast = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    fast_logits = list(seen)
    assert calls[0] >= 5, "the decode steps ran in C++"
    seen.clear()
    model.layer_loop = None
    slow = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert fast == slow
    assert len(fast_logits) == len(seen)
    for a, b in zip(fast_logits, seen, strict=True):
        assert torch.equal(a, b)
