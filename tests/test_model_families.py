"""The families beyond Llama's (Qwen3, Phi-3, Gemma 3, Mixtral, Qwen3-MoE) and sliding windows, on tiny
random models saved as Hugging Face directories, against transformers in float32: greedy tokens identical
and logprobs within 1e-4, batched, in chunked prefill, under preemption and with prefix-cache hits; the
mixtures of experts also split over two ranks, by columns (tensor parallelism) and by whole experts
(expert parallelism), against one process. Each config exercises its family's twist: Qwen3's per-head q/k
norms with a head_dim apart from hidden/heads, Phi-3's fused checkpoint tensors and partial rotary, Gemma
3's interleaved local and global layers (a window shorter than the prompts), soft-capped logits and norms
of offsets, Mistral's sliding window on every layer, Mixtral's experts, Qwen3-MoE's unrenormalized top-k
and a dense layer among the mixtures."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from reference import hf_greedy

from tokenmill import LLM, SamplingParams
from tokenmill.models.config import ModelConfig
from tokenmill.models.registry import FAMILIES, HF_ARCHITECTURES

transformers = pytest.importorskip("transformers", reason="transformers is the reference implementation")
pytestmark = pytest.mark.slow

VOCAB = 49152  # the SmolLM2 tokenizer is saved next to the random weights
NEW = 10
# float32 in both, the same math in another order: observed below 1e-5.
LOGPROB_TOL = 1e-4


_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False,
    initializer_range=0.2,  # large weights: decisive argmaxes, no near-ties between implementations
)  # fmt: skip


def _config(name: str):
    common = _COMMON
    if name == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32)
    if name == "phi3":
        return transformers.Phi3Config(**common, partial_rotary_factor=0.5, pad_token_id=0)
    if name == "phi3-longrope":
        # Phi-4-mini's kind: partial rotary and LongRoPE (short factors within the pretrained context of 128
        # positions, which the prompts stay inside; the context stretched 32x, so cos and sin are scaled).
        half = 4  # rotary_dim / 2 (head_dim 16, half of it turning)
        return transformers.Phi3Config(
            **{**common, "max_position_embeddings": 4096}, partial_rotary_factor=0.5, pad_token_id=0,
            original_max_position_embeddings=128,
            rope_scaling={
                "type": "longrope", "short_factor": [1.0 + 0.3 * i for i in range(half)],
                "long_factor": [2.0 + i for i in range(half)],
            },
        )  # fmt: skip
    if name == "gemma3":
        # A local layer (window 24, shorter than the prompts) and a global one with linearly scaled rope,
        # and a soft cap on the logits.
        return transformers.Gemma3TextConfig(
            **{**common, "tie_word_embeddings": True}, head_dim=32, sliding_window=24,
            layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24,
            final_logit_softcapping=30.0,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        )  # fmt: skip
    if name == "mistral-window":
        return transformers.MistralConfig(**common, sliding_window=20)
    if name == "mixtral":
        return transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    if name == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
            mlp_only_layers=[1], norm_topk_prob=False,
        )  # fmt: skip
    raise AssertionError(name)


FAMILY_NAMES = ["qwen3", "phi3", "phi3-longrope", "gemma3", "mistral-window", "mixtral", "qwen3_moe"]


@pytest.fixture(scope="module")
def checkpoints(
    tmp_path_factory: pytest.TempPathFactory, llm_fp32: LLM
) -> dict[str, tuple[Path, list, list]]:  # noqa: E501
    """Each family's directory, the prompts, and transformers' greedy answers to them."""
    out = {}
    for name in FAMILY_NAMES:
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(_config(name), dtype=torch.float32).eval()
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(path, safe_serialization=True)
        llm_fp32.tokenizer.save(path)
        g = torch.Generator().manual_seed(1)
        shared = [int(t) for t in torch.randint(3, VOCAB, (48,), generator=g)]
        prompts = [[int(t) for t in torch.randint(3, VOCAB, (n,), generator=g)] for n in (90, 40, 17)]
        prompts += [shared + [int(t) for t in torch.randint(3, VOCAB, (12,), generator=g)] for _ in range(2)]
        out[name] = (path, prompts, [hf_greedy(hf, p, NEW) for p in prompts])
    return out


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=2)


def _assert_matches(outs, reference) -> None:
    for i, (out, (tokens, lps)) in enumerate(zip(outs, reference, strict=True)):
        c = out.outputs[0]
        assert c.token_ids == tokens, f"prompt {i} diverges from transformers"
        for lp, ref in zip(c.logprobs, lps, strict=True):
            assert abs(lp.logprob - float(ref[lp.token_id])) < LOGPROB_TOL


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_family_matches_transformers(name: str, checkpoints) -> None:
    path, prompts, reference = checkpoints[name]
    # 12 blocks of 16 tokens hold about half of the batch: preemption (8 where a window on every layer
    # returns blocks behind it); 32-token steps: chunked prefill.
    blocks = 8 if name == "mistral-window" else 12
    llm = LLM(
        model=str(path), dtype="float32", max_model_len=128, max_num_batched_tokens=32, num_blocks=blocks,
        block_size=16,
    )  # fmt: skip
    assert llm.engine.info["model_config"]["architecture"] == _config(name).model_type
    outs = llm.generate(prompts, _greedy())
    _assert_matches(outs, reference)
    assert llm.engine.scheduler.num_preemptions > 0
    hits = llm.engine.kv.prefix_cache_hits
    _assert_matches([llm.generate([p], _greedy())[0] for p in prompts[-2:]], reference[-2:])
    assert llm.engine.kv.prefix_cache_hits > hits


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_mixture_over_two_ranks_answers_as_one_process(name: str, expert_parallel: bool, checkpoints) -> None:
    path, prompts, reference = checkpoints[name]
    llm = LLM(
        model=str(path), dtype="float32", max_model_len=128, tensor_parallel_size=2,
        enable_expert_parallel=expert_parallel,
    )  # fmt: skip
    try:
        _assert_matches(llm.generate(prompts[:3], _greedy()), reference[:3])
    finally:
        llm.engine.shutdown()


def test_every_family_is_registered_by_its_hf_name() -> None:
    assert set(HF_ARCHITECTURES.values()) == set(FAMILIES)
    for arch in HF_ARCHITECTURES:
        assert arch.endswith("ForCausalLM")


def test_moe_config_reads_each_familys_fields() -> None:
    mixtral = ModelConfig.from_hf(_config("mixtral").to_dict())
    assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.expert_intermediate_size) == (4, 2, 128)
    assert mixtral.renormalize_experts and mixtral.dense_layers == ()
    qwen = ModelConfig.from_hf(_config("qwen3_moe").to_dict())
    assert (qwen.expert_intermediate_size, qwen.renormalize_experts, qwen.dense_layers) == (48, False, (1,))
    assert qwen.is_moe_layer(0) and not qwen.is_moe_layer(1)
    assert ModelConfig.from_hf(_config("phi3").to_dict()).rope_dim == 8
    assert ModelConfig.from_dict(qwen.to_dict()) == qwen  # crosses process boundaries as plain data


def test_expert_parallelism_gives_each_rank_whole_experts() -> None:
    cfg = ModelConfig.from_hf(_config("mixtral").to_dict())
    from tokenmill.models.parallel import Shard

    ep = [Shard.of(cfg, 2, r, 1, 0, expert_parallel=True) for r in range(2)]
    assert [s.experts for s in ep] == [range(0, 2), range(2, 4)]
    assert all(s.expert_intermediate == range(128) for s in ep)
    tp = [Shard.of(cfg, 2, r, 1, 0) for r in range(2)]
    assert all(s.experts == range(4) for s in tp)
    assert [s.expert_intermediate for s in tp] == [range(0, 64), range(64, 128)]
    with pytest.raises(ValueError, match="only 2 experts"):
        Shard.of(dataclasses.replace(cfg, num_experts=2), 4, 0, 1, 0, expert_parallel=True)


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_experts_quantize_as_a_dense_mlp_does(method: str, tmp_path: Path, llm_fp32: LLM) -> None:
    """Each quantization method takes every expert's linears (not the router), and a mixture's output
    strays from its bf16 output as far as a dense MLP's of the same shapes does under that method (the
    methods' own bounds are stated on the embedded model: tests/test_quantization_accuracy.py). Qwen3-MoE
    with a dense layer beside a mixture whose experts are as wide as that MLP; the same routing in both
    models (the router stays bf16), so the two outputs differ only by the experts' rounding."""
    from tokenmill.models import registry
    from tokenmill.models.moe import Expert, FusedMoE
    from tokenmill.models.quant import QuantConfig

    torch.manual_seed(0)
    common = {**_COMMON, "intermediate_size": 64, "initializer_range": 0.02}
    hf_cfg = transformers.Qwen3MoeConfig(
        **common, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        mlp_only_layers=[1],
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16).save_pretrained(tmp_path)
    llm_fp32.tokenizer.save(tmp_path)

    def build(quant: str | None) -> torch.nn.Module:
        loaded = registry.load_checkpoint(tmp_path, torch.bfloat16, tmp_path / "cache")
        return registry.build(
            loaded.config,
            loaded.state_dict,
            torch.bfloat16,
            torch.device("cpu"),
            128,
            quant=QuantConfig(quant),
        )

    plain, quantized = build(None), build(method)
    moe = quantized.layers[0].mlp
    assert isinstance(moe, FusedMoE) and len(moe.experts) == 4
    plain_types = {type(m) for m in plain.modules()}
    expert_linears = [lin for e in moe.experts.values() if isinstance(e, Expert) for lin in e.children()]
    if all(type(lin) in plain_types for lin in expert_linears):
        pytest.skip(f"{method} keeps the bf16 weights on this CPU (its log says why)")
    assert all(type(lin) not in plain_types for lin in expert_linears), [type(x) for x in expert_linears]
    assert type(moe.router) is type(plain.layers[0].mlp.router)

    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)

    def stray(layer: int) -> float:
        want = plain.layers[layer].mlp(x, plain.ops).float()
        got = quantized.layers[layer].mlp(x, quantized.ops).float()
        return float((got - want).norm() / want.norm())

    mixture, dense = stray(0), stray(1)
    assert 0 < dense < 0.2, (method, dense)
    assert mixture < 2 * dense, (method, mixture, dense)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_served_family_answers_the_openai_client(name: str, checkpoints, llm_fp32: LLM) -> None:
    """`tokenmill serve --model <dir>`: the completion of a prompt given as token ids is transformers'
    greedy continuation, and a chat request is answered through the directory's chat template."""
    import openai
    from server_fixture import running_server

    path, prompts, reference = checkpoints[name]
    with running_server("--model", str(path), "--dtype", "float32") as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        got = client.completions.create(model=model, prompt=prompts[0], max_tokens=NEW, temperature=0)
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=4, temperature=0
        )
    assert got.choices[0].text == llm_fp32.tokenizer.decode(reference[0][0])
    assert got.usage.completion_tokens == NEW
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 4


def _broken(src: Path, dst: Path, config: dict | None = None, tensors: dict | None = None) -> Path:
    """A copy of the checkpoint at `src` with config fields and tensors replaced (None: removed)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text()) | (config or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    sd = load_file(dst / "model.safetensors")
    for name, t in (tensors or {}).items():
        if t is None:
            del sd[name]
        else:
            sd[name] = t
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_a_broken_checkpoint_is_refused_in_one_line_naming_what(checkpoints, tmp_path: Path) -> None:
    import subprocess
    import sys

    src = checkpoints["qwen3"][0]
    cases = {
        "unknown": ({"architectures": ["FooForCausalLM"], "model_type": "foo"}, None, "FooForCausalLM"),
        "missing": (None, {"model.layers.1.self_attn.k_norm.weight": None}, "layers.1.self_attn.k_norm"),
        "missing-part": (None, {"model.layers.0.self_attn.v_proj.weight": None}, "layers.0.self_attn.v_proj"),
        "shape": (None, {"model.layers.0.input_layernorm.weight": torch.ones(65)}, "input_layernorm.weight"),
        "config": ({"intermediate_size": 256}, None, "layers.0.mlp.down_proj.weight"),
    }
    for case, (config, tensors, named) in cases.items():
        path = _broken(src, tmp_path / case, config, tensors)
        cmd = [sys.executable, "-m", "tokenmill.cli.main", "generate", "--model", str(path), "hi"]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        lines = [ln for ln in (run.stdout + run.stderr).splitlines() if ln.strip()]
        assert run.returncode != 0 and len(lines) == 1 and named in lines[0], (case, lines)
        assert "Traceback" not in run.stderr


def test_a_refused_load_leaves_nothing_in_memory(checkpoints, tmp_path: Path) -> None:
    import gc

    src = checkpoints["mixtral"][0]
    path = _broken(src, tmp_path / "m", tensors={"model.layers.1.block_sparse_moe.gate.weight": None})
    with pytest.raises(ValueError, match="missing tensor: layers.1.mlp.router.weight") as e:
        LLM(model=str(path), dtype="float32", max_model_len=128)
    del e
    gc.collect()
    # The embedding ([vocab, 64]) is the largest tensor of the model: no copy of it survives the failure.
    left = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and tuple(o.shape) == (VOCAB, 64)]
    assert not left, len(left)


# Hugging Face names (after "model.") to llama.cpp's, per block and at the top: how its converter writes them.
_TO_GGUF_BLOCK = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip
_TO_GGUF_TOP = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}


def _qwen3_gguf(src: Path, dst: Path, tokenizer_gguf: Path) -> Path:
    """The Hugging Face Qwen3 directory `src` as llama.cpp's converter writes it (float32 tensors, its
    names and metadata keys), with the tokenizer of `tokenizer_gguf`."""
    import json

    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    from safetensors.torch import load_file

    cfg = json.loads((src / "config.json").read_text())
    w = GGUFWriter(str(dst), "qwen3")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    for field in GGUFReader(tokenizer_gguf).fields.values():
        if field.name.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
            w.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for name, t in load_file(src / "model.safetensors").items():
        name = name.removeprefix("model.")
        if name == "lm_head.weight":
            gguf_name = "output.weight"
        elif name in _TO_GGUF_TOP:
            gguf_name = _TO_GGUF_TOP[name]
        else:
            _, i, rest = name.split(".", 2)
            gguf_name = f"blk.{i}.{_TO_GGUF_BLOCK[rest.removesuffix('.weight')]}.weight"
        w.add_tensor(gguf_name, np.ascontiguousarray(t.float().numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_qwen3_gguf_matches_transformers(checkpoints, tmp_path: Path) -> None:
    from tokenmill.weights import catalog

    path, prompts, reference = checkpoints["qwen3"]
    gguf_path = _qwen3_gguf(path, tmp_path / "qwen3.gguf", catalog.resolve("smollm2-135m"))
    llm = LLM(model=str(gguf_path), dtype="float32", max_model_len=128, cache_dir=str(tmp_path / "cache"))
    assert llm.engine.info["model_config"]["architecture"] == "qwen3"
    _assert_matches(llm.generate(prompts[:3], _greedy()), reference[:3])


def test_a_gguf_of_a_family_read_only_from_its_directory_is_refused(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    w = GGUFWriter(str(tmp_path / "m.gguf"), "gemma3")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="GGUF files of gemma3 are not read yet"):
        LLM(model=str(tmp_path / "m.gguf"), max_model_len=128, cache_dir=str(tmp_path / "cache"))


@pytest.mark.parametrize(
    ("name", "why"), [("qwen3", None), ("gemma3", "GemmaDecoderLayer"), ("mixtral", "FusedMoE")]
)
def test_int8_smoothing_is_offered_only_where_its_factors_fold(name: str, why: str | None, checkpoints):
    """int8's smoothing folds its factors into the norm before qkv and the one before the MLP
    (models/smoothing.py): right for Llama's arrangement (Qwen3's q/k norms come after the projection),
    wrong for Gemma's (its MLP reads a norm of its own) and a mixture's (the router reads it too)."""
    from tokenmill.models import registry
    from tokenmill.models.smoothing import why_not_smoothable

    loaded = registry.load_checkpoint(checkpoints[name][0], torch.float32, None)
    model = registry.build(loaded.config, loaded.state_dict, torch.float32, torch.device("cpu"), 128)
    reason = why_not_smoothable(model)
    assert reason is None if why is None else why in reason


# Released config.json files as transformers 4 wrote them (keys equal to their class's default left out),
# trimmed to what tokenmill reads.
RELEASED = {
    "gemma-3-1b-it": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 256,
        "hidden_size": 1152, "intermediate_size": 6912, "max_position_embeddings": 32768,
        "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
        "final_logit_softcapping": None, "attn_logit_softcapping": None, "vocab_size": 262144,
    },
    "Qwen3-30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "head_dim": 128,
        "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
        "max_window_layers": 48, "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True,
        "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
        "num_key_value_heads": 4, "rope_theta": 1000000.0, "sliding_window": None,
        "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936,
    },
    "Mixtral-8x7B-v0.1": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
        "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
        "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False, "vocab_size": 32000,
    },
    "Phi-3-mini-4k-instruct": {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072,
        "intermediate_size": 8192, "max_position_embeddings": 4096, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 32, "original_max_position_embeddings": 4096,
        "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": 2047, "tie_word_embeddings": False,
        "vocab_size": 32064,
    },
}  # fmt: skip


def test_released_configs_read_as_their_families_mean_them() -> None:
    gemma = ModelConfig.from_hf(RELEASED["gemma-3-1b-it"])
    assert gemma.tie_word_embeddings  # the class's default, left out of the file
    assert gemma.window_layers == tuple(i for i in range(26) if (i + 1) % 6) and gemma.sliding_window == 512
    assert (gemma.rope_theta, gemma.local_rope_theta, gemma.attention_scale) == (1e6, 1e4, 256**-0.5)
    assert gemma.final_logit_softcap == 0 and gemma.window_of(5) == 0 and gemma.window_of(4) == 512
    qwen = ModelConfig.from_hf(RELEASED["Qwen3-30B-A3B"])
    assert (qwen.num_experts, qwen.experts_per_token, qwen.expert_intermediate_size) == (128, 8, 768)
    assert qwen.renormalize_experts and qwen.dense_layers == () and qwen.window_layers == ()
    unsaid = {k: v for k, v in RELEASED["Qwen3-30B-A3B"].items() if k != "norm_topk_prob"}
    assert not ModelConfig.from_hf(unsaid).renormalize_experts  # Qwen3MoeConfig's default
    mixtral = ModelConfig.from_hf(RELEASED["Mixtral-8x7B-v0.1"])
    assert (
        mixtral.renormalize_experts
        and mixtral.sliding_window == 0
        and mixtral.expert_intermediate_size == 14336
    )
    phi = ModelConfig.from_hf(RELEASED["Phi-3-mini-4k-instruct"])
    assert phi.sliding_window == 2047 and phi.window_layers == tuple(range(32)) and phi.rope_dim == 96


def test_a_window_on_every_layer_returns_blocks_behind_it(checkpoints) -> None:
    """Mistral's window (20 positions here) on every layer: a 90-token prompt decoded to 100 tokens holds
    at most the blocks its window and step cover, not the 7 of its whole context, and answers as
    transformers does."""
    path, prompts, reference = checkpoints["mistral-window"]
    llm = LLM(
        model=str(path), dtype="float32", max_model_len=128, block_size=16, num_blocks=16,
        max_num_batched_tokens=32,
    )  # fmt: skip
    kv = llm.engine.kv
    assert kv.window == 20
    in_use: list[int] = []
    allocate = kv.allocate_slots

    def watched(*args, **kwargs) -> bool:
        done = allocate(*args, **kwargs)
        in_use.append(16 - kv.pool.num_free)
        return done

    kv.allocate_slots = watched  # type: ignore[method-assign]
    _assert_matches(llm.generate(prompts[:1], _greedy()), reference[:1])
    assert max(in_use) <= 5 and in_use[-1] <= 3, in_use
    assert kv.pool.num_free == 16  # every block back, none twice
