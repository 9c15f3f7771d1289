"""Llama-family variants on tiny random models saved as Hugging Face directories, against transformers.

Covers what the embedded model does not exercise: Llama 3 rope scaling, Qwen2's q/k/v biases,
untied embeddings, and loading from config.json + *.safetensors + tokenizer.json.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from reference import hf_greedy

from tokenmill import LLM, SamplingParams

transformers = pytest.importorskip("transformers", reason="transformers is the reference implementation")

VOCAB = 49152  # the SmolLM2 tokenizer is saved next to the random weights


def _save(tmp: Path, model, llm_tok) -> Path:
    model.save_pretrained(tmp, safe_serialization=True)
    llm_tok.save(tmp)
    return tmp


def _variants():
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=0.2,  # large weights: decisive argmaxes, no near-ties between implementations
    )
    return {
        "llama3-rope": transformers.LlamaConfig(
            **common,
            rope_theta=500000.0,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        "qwen2-bias": transformers.Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=True),
        "mistral": transformers.MistralConfig(**common, sliding_window=None, tie_word_embeddings=False),
    }


@pytest.mark.parametrize("name", ["llama3-rope", "qwen2-bias", "mistral"])
def test_variant_matches_transformers(name: str, tmp_path: Path, llm_fp32: LLM) -> None:
    torch.manual_seed(0)
    cfg = _variants()[name]
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    if name == "qwen2-bias":  # random biases, so that a missing bias would show
        with torch.no_grad():
            for layer in hf.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    path = _save(tmp_path / name, hf, llm_fp32.tokenizer)
    # Positions past original_max_position_embeddings exercise the scaled rope frequencies.
    prompt = [int(t) for t in torch.randint(3, VOCAB, (90,))]
    ref_tokens, ref_lps = hf_greedy(hf, prompt, 12)

    ours = LLM(model=str(path), dtype="float32", max_model_len=256, max_num_batched_tokens=32)
    out = ours.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3))[
        0
    ]
    assert out.outputs[0].token_ids == ref_tokens
    for lp, ref in zip(out.outputs[0].logprobs, ref_lps, strict=True):
        assert abs(lp.logprob - float(ref[lp.token_id])) < 1e-3
