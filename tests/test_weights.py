"""Model catalog, GGUF dequantization cache, and loading a Hugging Face directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tokenmill import LLM, SamplingParams
from tokenmill.models import registry
from tokenmill.weights import catalog, loader


def test_catalog_resolves_embedded_model(model_path: Path) -> None:
    assert catalog.resolve("smollm2-135m") == model_path
    assert model_path.suffix == ".gguf" and model_path.exists()


@pytest.mark.parametrize("name", ["no-such-model", "/nonexistent/file.gguf"])
def test_unknown_model_has_clear_error(name: str) -> None:
    with pytest.raises(catalog.ModelNotFoundError, match="unknown model"):
        catalog.resolve(name)


def test_not_a_model_path(tmp_path: Path) -> None:
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(catalog.ModelNotFoundError, match="expected a .gguf file"):
        catalog.resolve(str(tmp_path / "x.txt"))


@pytest.mark.slow
def test_gguf_cache_round_trip(model_path: Path, tmp_path: Path, monkeypatch) -> None:
    first = registry.load_checkpoint(model_path, torch.float32, tmp_path)
    cached = list(tmp_path.glob("*/float32/*/done"))
    assert len(cached) == 1, "the dequantized weights are cached"

    def parse(*_):  # the file's metadata takes seconds to parse: a cached start must not need it
        raise AssertionError("the GGUF file was opened")

    monkeypatch.setattr(loader, "GGUFFile", parse)
    second = registry.load_checkpoint(model_path, torch.float32, tmp_path)
    assert first.config == second.config
    assert first.state_dict.keys() == second.state_dict.keys()
    for k, v in first.state_dict.items():
        assert torch.equal(v, second.state_dict[k]), k
    text = "Hello, world! 12345 ünïcödé 🚀"
    assert first.tokenizer.encode(text) == second.tokenizer.encode(text)
    assert first.tokenizer.chat_template == second.tokenizer.chat_template


@pytest.mark.slow
def test_weights_equal_transformers_dequantization(hf_model, llm_fp32: LLM) -> None:
    ours = llm_fp32.engine.runner.model.state_dict()
    theirs = hf_model.state_dict()
    q = ours["layers.3.self_attn.qkv_proj.weight"]
    assert torch.equal(q[:576], theirs["model.layers.3.self_attn.q_proj.weight"])
    assert torch.equal(q[576:768], theirs["model.layers.3.self_attn.k_proj.weight"])
    assert torch.equal(ours["embed_tokens.weight"], theirs["model.embed_tokens.weight"])
    assert torch.equal(ours["layers.3.mlp.down_proj.weight"], theirs["model.layers.3.mlp.down_proj.weight"])


@pytest.mark.slow
def test_hf_directory_gives_same_outputs(hf_model, llm_fp32: LLM, tmp_path: Path) -> None:
    # The embedded model re-saved by transformers as config.json + model.safetensors + tokenizer.json.
    # (transformers refuses save_pretrained on a GGUF-loaded model, so write the two files directly.)
    cfg = hf_model.config.to_dict()
    cfg.pop("quantization_config", None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    sd = {k: v.contiguous() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    save_file(sd, tmp_path / "model.safetensors")
    llm_fp32.tokenizer.save(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", max_model_len=512)
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = "The history of the bicycle"
    assert (
        llm.generate(prompt, p)[0].outputs[0].token_ids
        == llm_fp32.generate(prompt, p)[0].outputs[0].token_ids
    )
