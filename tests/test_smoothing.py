"""SmoothQuant for `quantization="int8"` (tokenmill/models/smoothing.py): factors that are powers of two,
folds that leave the bf16 model's outputs bit for bit (every product and sum is the original's, scaled
by an exact power of two) on the plain-PyTorch ops and on each kernel build this CPU runs, over prompt
and decode steps, and an int8 model that is nearer the float32 reference with them than without, on a
model whose activations have outlier channels. The real model's perplexity with and without smoothing
is in tests/test_quantization_accuracy.py."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tokenmill.config import EngineConfig
from tokenmill.kernels.isa import all_levels
from tokenmill.models.attention.backend import AttentionBackend, AttentionMetadata, PrefillSegment
from tokenmill.models.attention.registry import get_backend
from tokenmill.models.config import ModelConfig
from tokenmill.models.linear import int8_matmuls_available
from tokenmill.models.llama import build_model
from tokenmill.models.parallel import NoCollectives, Shard
from tokenmill.models.quant import QuantConfig
from tokenmill.models.smoothing import (
    CALIBRATION_TOKENS,
    Calibration,
    calibration_chunks,
    calibration_text,
    factors,
    maxima_key,
)

# Qwen2-like: biases on q/k/v, 4 query heads on 2 kv heads; and a Llama with a tied output head.
CFG = ModelConfig("qwen2", 64, 32, 48, 2, 4, 2, 8, attention_bias=True)
TIED = ModelConfig("llama", 64, 32, 48, 2, 4, 2, 8, tie_word_embeddings=True)
# The plain-PyTorch ops and attention, and each kernel build this CPU runs.
KERNELS = ["torch", *(lv.name for lv in all_levels() if lv.supported())]
needs_int8 = pytest.mark.skipif(
    not int8_matmuls_available(torch.device("cpu")),
    reason="int8 keeps bf16 weights on a CPU without VNNI or AMX (nothing is quantized to compare)",
)


def weights(cfg: ModelConfig = CFG, outliers: bool = True) -> dict[str, torch.Tensor]:
    """Random bf16 weights; with `outliers`, a few input channels 30-40x the rest, as a Llama's norms
    and MLP products have."""
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int, scale: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    sd = {"embed_tokens.weight": rnd(64, 32, scale=1), "norm.weight": 1 + rnd(32)}
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = rnd(64, 32)
    for i in range(cfg.num_layers):
        norms = [1 + rnd(32), 1 + rnd(32)]
        up = rnd(96, 32)
        if outliers:
            for n in norms:
                n[[3, 17]] *= 30
            up[48 + 5] *= 40
        sd |= {
            f"layers.{i}.self_attn.qkv_proj.weight": rnd(64, 32),
            f"layers.{i}.self_attn.o_proj.weight": rnd(32, 32),
            f"layers.{i}.mlp.gate_up_proj.weight": up,
            f"layers.{i}.mlp.down_proj.weight": rnd(32, 48),
            f"layers.{i}.input_layernorm.weight": norms[0],
            f"layers.{i}.post_attention_layernorm.weight": norms[1],
        }
        if cfg.attention_bias:
            sd[f"layers.{i}.self_attn.qkv_proj.bias"] = rnd(64)
    return {k: v.bfloat16() for k, v in sd.items()}


def tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed))]


CHUNKS = [tokens(40, 1), tokens(40, 2)]
CALIBRATION = Calibration.of(CHUNKS)  # measured at every build: no cache
PROMPT = tokens(24, 3)
DECODED = 4  # the prompt's last tokens, fed one decode step each


def logits(model: torch.nn.Module, ids: list[int], backend: AttentionBackend | None = None) -> torch.Tensor:
    """Logits at every position of `ids`: all but the last DECODED tokens as one prompt, then those one
    decode step at a time (paged decode attention), as the engine runs them."""
    backend = backend or get_backend("torch")
    block, cfg = 16, model.config
    blocks = -(-len(ids) // block)
    kv = torch.zeros(
        cfg.num_layers,
        2,
        blocks,
        block,
        model.num_local_kv_heads,
        cfg.head_dim,
        dtype=model.embed_tokens.weight.dtype,
    )
    cpu, table = torch.device("cpu"), list(range(blocks))
    t = len(ids) - DECODED
    seg = PrefillSegment(0, t, 0, torch.arange(blocks), first_block=0)
    meta = AttentionMetadata.of(list(range(t)), [], [], [seg], block, cpu)
    pos = torch.arange(t)
    out = [model(torch.tensor(ids[:t]), pos, kv, meta, backend, pos)]
    for p in range(t, len(ids)):
        meta = AttentionMetadata.of([p], [table], [p + 1], [], block, cpu)
        out.append(model(torch.tensor([ids[p]]), torch.tensor([p]), kv, meta, backend, torch.tensor([0])))
    return torch.cat(out).float()


def build(sd: dict[str, torch.Tensor], cfg: ModelConfig = CFG, **kw: object) -> torch.nn.Module:
    """build_model with the quantization's arguments (`quantization`, `calibration`, `smoothing_alpha`)
    given as keywords."""
    dtype = kw.pop("dtype", torch.bfloat16)
    quant = QuantConfig(
        kw.pop("quantization", None),  # type: ignore[arg-type]
        calibration=kw.pop("calibration", None),  # type: ignore[arg-type]
        smoothing_alpha=kw.pop("smoothing_alpha", 0.7),  # type: ignore[arg-type]
    )
    return build_model(cfg, sd, dtype, torch.device("cpu"), 64, quant=quant, **kw)  # type: ignore[arg-type]


def test_factors_are_powers_of_two_within_range() -> None:
    act = torch.tensor([0.0, 1e-3, 1.0, 7.0, 300.0, 1e9])
    w = torch.tensor([0.5, 0.02, 0.1, 1.0, 0.05, 1e-9])
    s = factors(act, w, 0.7)
    exponents = torch.log2(s)
    assert torch.equal(exponents, exponents.round())
    assert float(s.min()) >= 2**-16 and float(s.max()) <= 2**16
    # The largest activation against a small weight gets a large factor, the smallest a small one.
    assert float(s[4]) > 16 and float(s[1]) < 1


def test_calibration_chunks_are_spread_over_the_text() -> None:
    chunks = calibration_chunks(lambda text: [ord(c) for c in text])
    assert len(chunks) == 8 and all(len(c) == CALIBRATION_TOKENS for c in chunks)
    assert len({tuple(c) for c in chunks}) == 8


def test_calibration_text_is_the_same_under_python_oo() -> None:
    """Read from the modules' source files: `python -OO`, which drops loaded modules' docstrings, sees
    the same text."""
    code = "from tokenmill.models.smoothing import calibration_text; print(len(calibration_text()))"
    out = subprocess.run([sys.executable, "-OO", "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) == len(calibration_text()) > 20_000


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("cfg", [CFG, TIED], ids=["qwen2-bias", "llama-tied"])
def test_smoothing_leaves_the_bf16_model_bit_for_bit(kernels: str, cfg: ModelConfig) -> None:
    sd = weights(cfg)
    loaded = {k: v.clone() for k, v in sd.items()}
    plain = build(sd, cfg, ops=kernels)
    smoothed = build(sd, cfg, ops=kernels, calibration=CALIBRATION, smoothing_alpha=0.7)
    assert smoothed.quant.smoothed_alpha == 0.7 and plain.quant.smoothed_alpha is None
    # The folds did move the norms (the linears' folds: test_every_fold_moves_its_weights).
    assert not torch.equal(smoothed.layers[0].input_layernorm.weight, sd["layers.0.input_layernorm.weight"])
    assert not torch.equal(smoothed.norm.weight, sd["norm.weight"])
    # ... and the outputs are the same bits, prompt and decode steps.
    backend = get_backend(kernels)
    assert torch.equal(logits(smoothed, PROMPT, backend), logits(plain, PROMPT, backend))
    # The loaded tensors themselves are untouched (they may be a cached checkpoint's), and a tied
    # embedding keeps its values: only the head's own copy is scaled.
    assert all(torch.equal(sd[k], loaded[k]) for k in sd)
    assert torch.equal(smoothed.embed_tokens.weight, sd["embed_tokens.weight"])


class ThreadRanks:
    """Tensor-parallel collectives between threads of this process, each rank a thread: the math of
    the ranks (the rank processes and gloo are tests/test_parallel.py's). Every rank sums and
    concatenates the same tensors in the same order, so all get the same bits."""

    def __init__(self, size: int) -> None:
        # A rank left waiting (a collective the others skipped) fails the test instead of hanging it.
        self.size, self.slots = size, [torch.empty(0)] * size
        self.barrier = threading.Barrier(size, timeout=60)

    def rank(self, r: int) -> object:
        ranks = self

        class Rank:
            tp_size = ranks.size

            def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
                total = ranks.exchange(r, t.float(), lambda parts: torch.stack(parts).sum(0))
                return t.copy_(total)

            def all_gather_last_dim(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
                return ranks.exchange(
                    r, t, lambda parts: torch.cat([p[..., :n] for p, n in zip(parts, sizes, strict=True)], -1)
                )

            def any_rank(self, flag: bool) -> bool:
                return bool(ranks.exchange(r, torch.tensor([flag]), lambda parts: torch.stack(parts).any()))

        return Rank()

    def exchange(
        self, r: int, t: torch.Tensor, combine: Callable[[list[torch.Tensor]], torch.Tensor]
    ) -> torch.Tensor:
        self.slots[r] = t.clone()
        self.barrier.wait()
        out = combine(list(self.slots))
        self.barrier.wait()  # every rank has read the slots before any writes its next
        return out


class ThreadStages:
    """Pipeline stages in threads of this process (tensor parallelism 1): activations handed on through
    queues, and the one engine-wide decision (any_rank) through ThreadRanks' exchange."""

    def __init__(self, size: int) -> None:
        self.ranks = ThreadRanks(size)
        self.queues = [queue.Queue() for _ in range(size)]

    def rank(self, r: int) -> object:
        stages, everyone = self, self.ranks.rank(r)

        class Stage(NoCollectives):  # no tensor parallelism within a stage
            def any_rank(self, flag: bool) -> bool:
                return everyone.any_rank(flag)  # type: ignore[attr-defined]

            def send_activations(self, t: torch.Tensor) -> None:
                stages.queues[r + 1].put(t.clone())

            def recv_activations(
                self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
            ) -> torch.Tensor:
                t = stages.queues[r].get(timeout=60)
                assert t.shape == shape and t.dtype == dtype
                return t

        return Stage()


def on_ranks(size: int, fn: Callable[[int, object], torch.nn.Module | torch.Tensor]) -> list:
    ranks = ThreadRanks(size)
    with ThreadPoolExecutor(size) as pool:
        return list(pool.map(lambda r: fn(r, ranks.rank(r)), range(size)))


def test_tensor_parallel_ranks_smooth_together_bit_for_bit() -> None:
    """Two ranks (4 query heads, 2 kv heads: one kv head each) calibrate together: the replicated norms
    get the same factors on both, each rank's own down_proj channels its own, and the smoothed ranks
    compute the unsmoothed ranks' logits bit for bit."""
    sd = weights(TIED)

    def build_rank(r: int, comm: object, **kw: object) -> torch.nn.Module:
        shard = Shard.of(TIED, 2, r, 1, 0)
        return build_model(
            TIED,
            sd,
            torch.bfloat16,
            torch.device("cpu"),
            64,
            "torch",
            QuantConfig(**kw),
            shard=shard,
            comm=comm,
        )  # type: ignore[arg-type]

    smoothed = on_ranks(2, lambda r, c: build_rank(r, c, calibration=CALIBRATION, smoothing_alpha=0.7))
    plain = on_ranks(2, lambda r, c: build_rank(r, c))
    assert all(m.quant.smoothed_alpha == 0.7 for m in smoothed)
    a, b = smoothed
    for i in range(TIED.num_layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w = getattr(a.layers[i], norm).weight
            assert torch.equal(w, getattr(b.layers[i], norm).weight) and not torch.equal(
                w, sd[f"layers.{i}.{norm}.weight"]
            )
    assert torch.equal(a.norm.weight, b.norm.weight)

    def rank_logits(models: list[torch.nn.Module]) -> list[torch.Tensor]:
        # Each set of ranks runs on the collectives it was built with (its layers hold them).
        with ThreadPoolExecutor(2) as pool:
            return list(pool.map(lambda m: logits(m, PROMPT), models))

    got, want = rank_logits(smoothed), rank_logits(plain)
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], want[0])


@pytest.mark.parametrize("cfg", [CFG, TIED], ids=["qwen2-bias", "llama-tied"])
def test_every_fold_moves_its_weights(cfg: ModelConfig) -> None:
    """In float32 (whose linears stay unpacked, so their weights can be read): the norms' factors
    reach the q/k/v and gate/up columns, the up rows' reach the down columns, the final norm's reach
    the head; o_proj and the embedding are left as loaded."""
    sd = {k: v.float() for k, v in weights(cfg).items()}
    m = build(sd, cfg, dtype=torch.float32, ops="torch", calibration=CALIBRATION, smoothing_alpha=0.7)
    layer, inter = m.layers[0], 48
    moved = {
        "self_attn.qkv_proj.weight": layer.self_attn.qkv_proj.weight,
        "mlp.gate_up_proj.weight": layer.mlp.gate_up_proj.weight[:inter],  # gate: columns only
        "mlp.down_proj.weight": layer.mlp.down_proj.weight,
    }
    for name, now in moved.items():
        assert not torch.equal(now, sd["layers.0." + name]), name
    up_now, up_loaded = layer.mlp.gate_up_proj.weight[inter:], sd["layers.0.mlp.gate_up_proj.weight"][inter:]
    assert not torch.equal(up_now, up_loaded)
    assert torch.equal(layer.self_attn.o_proj.weight, sd["layers.0.self_attn.o_proj.weight"])
    assert torch.equal(m.embed_tokens.weight, sd["embed_tokens.weight"])
    head = sd["embed_tokens.weight"] if cfg.tie_word_embeddings else sd["lm_head.weight"]
    assert not torch.equal(m.lm_head.weight, head) and m.lm_head.weight is not m.embed_tokens.weight


@needs_int8
def test_smoothed_int8_is_nearer_the_float32_reference() -> None:
    sd = weights()
    reference = logits(build(sd, dtype=torch.float32, ops="torch"), PROMPT)

    def error(**kw: object) -> float:
        out = logits(build(sd, quantization="int8", **kw), PROMPT)
        return float((out - reference).norm() / reference.norm())

    # At the default strength; measured 0.089 against 0.140 (bf16 alone: 0.015) on AMD Zen 4.
    unsmoothed = error()
    smoothed = error(calibration=CALIBRATION, smoothing_alpha=EngineConfig().int8_smoothing)
    assert smoothed < 0.75 * unsmoothed, (smoothed, unsmoothed)


def test_models_that_cannot_be_smoothed_are_quantized_unsmoothed(caplog: pytest.LogCaptureFixture) -> None:
    """float16 cannot hold factors up to 2^16: the load says so and goes on unsmoothed."""
    model = build(weights(), dtype=torch.float16, ops="torch", calibration=CALIBRATION, smoothing_alpha=0.7)
    assert model.quant.smoothed_alpha is None
    assert "not smoothed" in caplog.text and "float16" in caplog.text


def test_smoothing_strength_is_checked() -> None:
    with pytest.raises(ValueError, match="int8_smoothing"):
        EngineConfig(quantization="int8", int8_smoothing=1.5)
    with pytest.raises(ValueError, match="alpha"):
        build(weights(outliers=False), calibration=CALIBRATION, smoothing_alpha=1.0)


def test_cached_maxima_smooth_as_measured_ones(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The second load of the same weights takes the maxima from the cache (the chunks are not even
    made) and gets the same smoothed weights bit for bit; a cache file that is damaged or does not fit
    the model is measured again, with a warning, and replaced."""
    made: list[int] = []

    def chunks() -> list[list[int]]:
        made.append(1)
        return CHUNKS

    cal = Calibration(chunks, tmp_path)
    sd = {k: v.float() for k, v in weights(TIED).items()}  # float32: the linears' weights stay readable

    def load() -> torch.nn.Module:
        return build(sd, TIED, dtype=torch.float32, ops="torch", calibration=cal, smoothing_alpha=0.7)

    measured = load()
    (cached_file,) = tmp_path.glob("int8-maxima-*.safetensors")
    assert cached_file.name == f"int8-maxima-{maxima_key(measured)}.safetensors" and len(made) == 1
    cached = load()
    assert len(made) == 1 and cached.quant.smoothed_alpha == 0.7
    assert same_weights(measured, cached)
    for damage in (b"not a safetensors file", None):
        if damage is None:  # a readable file with one linear short
            save_file({"lm_head": torch.ones(3)}, cached_file)
        else:
            cached_file.write_bytes(damage)
        again = load()
        assert len(made) == 3 - (damage is not None) and "measuring again" in caplog.text
        assert same_weights(measured, again)
        caplog.clear()


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_maxima_key_names_what_the_maxima_depend_on() -> None:
    """Another rank's shard, dtype or kernel build measures other maxima, so each has its own file."""
    sd = weights(TIED)
    base = build_model(TIED, sd, torch.bfloat16, torch.device("cpu"), 64, "torch")
    others = [
        build_model(
            TIED, sd, torch.bfloat16, torch.device("cpu"), 64, "torch", shard=Shard.of(TIED, 2, 1, 1, 0)
        ),
        build_model(TIED, sd, torch.float32, torch.device("cpu"), 64, "torch"),
        build_model(TIED, sd, torch.bfloat16, torch.device("cpu"), 64, KERNELS[-1]),
    ]
    if KERNELS[-1] == "torch":
        others.pop()  # no kernel build runs on this CPU
    keys = {maxima_key(m) for m in [base, *others]}
    assert len(keys) == 1 + len(others)
    assert maxima_key(build_model(TIED, sd, torch.bfloat16, torch.device("cpu"), 64, "torch")) == maxima_key(
        base
    )


def test_pipeline_stages_calibrate_together_as_the_whole_model() -> None:
    """Two pipeline stages in threads: the second calibrates on the first's output for each chunk, so
    the stages' smoothed weights are the whole model's, layer for layer, bit for bit (in float32, whose
    linears stay readable); the head and final norm are the last stage's."""
    sd = {k: v.float() for k, v in weights(TIED).items()}

    def stage(r: int, comm: object) -> torch.nn.Module:
        return build_model(
            TIED, sd, torch.float32, torch.device("cpu"), 64, "torch", shard=Shard.of(TIED, 1, 0, 2, r),
            comm=comm, quant=QuantConfig(calibration=CALIBRATION, smoothing_alpha=0.7),
        )  # type: ignore[arg-type]  # fmt: skip

    stages = ThreadStages(2)
    with ThreadPoolExecutor(2) as pool:
        first, last = pool.map(lambda r: stage(r, stages.rank(r)), range(2))
    whole = build(sd, TIED, dtype=torch.float32, ops="torch", calibration=CALIBRATION, smoothing_alpha=0.7)
    assert first.quant.smoothed_alpha == last.quant.smoothed_alpha == 0.7
    want = whole.state_dict()
    for model, offset in ((first, 0), (last, 1)):
        for name, t in model.state_dict().items():
            if name.startswith("layers."):
                i, rest = name.removeprefix("layers.").split(".", 1)
                name = f"layers.{int(i) + offset}.{rest}"
            assert torch.equal(t, want[name]), name
    assert not torch.equal(last.layers[0].input_layernorm.weight, sd["layers.1.input_layernorm.weight"])


def test_ranks_measure_together_when_one_lacks_the_cached_maxima(tmp_path: Path) -> None:
    """Two tensor-parallel ranks, one of whose cached maxima is gone: both measure again (a rank that
    took its file would leave the other waiting in the measuring forward's collectives), and the
    result is the same weights."""
    made: list[int] = []

    def chunks() -> list[list[int]]:
        made.append(1)
        return CHUNKS

    cal = Calibration(chunks, tmp_path)
    sd = weights(TIED)

    def load() -> list[torch.nn.Module]:
        return on_ranks(
            2,
            lambda r, c: build_model(
                TIED, sd, torch.bfloat16, torch.device("cpu"), 64, "torch", shard=Shard.of(TIED, 2, r, 1, 0),
                comm=c, quant=QuantConfig(calibration=cal, smoothing_alpha=0.7),
            ),  # type: ignore[arg-type]
        )  # fmt: skip

    measured = load()
    files = sorted(tmp_path.glob("int8-maxima-*.safetensors"))
    assert len(files) == 2 and len(made) == 2  # one file per rank: their down_proj channels differ
    load()
    assert len(made) == 2
    files[1].unlink()
    again = load()
    assert len(made) == 4 and all(same_weights(a, b) for a, b in zip(measured, again, strict=True))
