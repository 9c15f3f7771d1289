"""Shared fixtures: the embedded model (installed by `make test`'s set-up) and the HF reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from weights_caches import drop_weights_caches

from tokenmill.weights import catalog


@pytest.fixture(scope="session")
def model_path() -> Path:
    path = catalog.installed_file(catalog.CATALOG[catalog.DEFAULT_MODEL])
    if path is None:
        pytest.fail("the embedded model is not installed: run `make test` (it runs `tokenmill models pull`)")
    return path


@pytest.fixture(scope="session")
def q8_0_model_path(model_path: Path, tmp_path_factory):
    """The embedded model written again with its linear weights in Q8_0 blocks (weights/requantize.py:
    the gguf package's own quantizer on the dequantized Q4_1 values), as a Q8_0 GGUF file holds them."""
    from tokenmill.weights.requantize import requantize

    path = requantize(model_path, tmp_path_factory.mktemp("q8_0") / "smollm2-135m-q8_0.gguf")
    yield path
    drop_weights_caches(path)


@pytest.fixture(scope="session")
def hf_model(model_path: Path):
    """Hugging Face transformers' own Llama on the same GGUF weights, float32: the independent reference."""
    transformers = pytest.importorskip("transformers", reason="transformers is the reference implementation")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def llm_fp32():
    from tokenmill import LLM

    return LLM(dtype="float32", max_model_len=1024)


@pytest.fixture(scope="session")
def llm_bf16():
    from tokenmill import LLM

    return LLM(dtype="bfloat16", max_model_len=1024)
