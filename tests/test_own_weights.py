"""A built model lets go of its checkpoint: what it still uses of a mapped checkpoint is copied out when
that is little of it (models/own_weights.py), so the file mapping goes when the state dict does."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tokenmill.models import registry
from tokenmill.models.own_weights import own_remaining


def _mapped(path: Path) -> bool:
    return str(path) in Path("/proc/self/maps").read_text()


needs_proc = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")


@needs_proc
def test_a_little_still_used_is_copied_out_and_the_mapping_goes(tmp_path: Path) -> None:
    """An embedding tied to a head (one Parameter in two modules) and a bias kept as a plain attribute
    are copied, stay tied, keep their values; the big matrix the model repacked is not copied."""
    path = tmp_path / "ck.safetensors"
    save_file({"emb": torch.randn(64, 16), "big": torch.randn(1024, 64), "bias": torch.randn(64)}, str(path))
    sd = load_file(str(path))
    assert _mapped(path), "safetensors maps the file (the case this is for)"
    emb = nn.Embedding(64, 16)
    emb.weight = nn.Parameter(sd["emb"], requires_grad=False)
    head = nn.Linear(16, 64)
    head.weight = emb.weight
    head.kept = sd["bias"].detach()  # as PackedLinear keeps its bias
    repacked = nn.Linear(64, 1024)
    repacked.weight = nn.Parameter(sd["big"].clone(), requires_grad=False)  # its own copy
    model = nn.ModuleList([emb, head, repacked])
    want = {k: v.clone() for k, v in sd.items()}
    assert own_remaining(model, sd) == (64 * 16 + 64) * 4
    assert (
        head.weight is emb.weight
        and torch.equal(emb.weight, want["emb"])
        and torch.equal(head.kept, want["bias"])
    )
    del sd
    gc.collect()
    assert not _mapped(path)


def test_a_model_that_is_most_of_its_checkpoint_keeps_the_mapping(tmp_path: Path) -> None:
    """The plain path computes from the checkpoint's tensors as they are: copying them would only trade
    shareable file pages for private memory."""
    path = tmp_path / "ck.safetensors"
    save_file({"emb": torch.randn(8, 16), "big": torch.randn(1024, 64)}, str(path))
    sd = load_file(str(path))
    lin = nn.Linear(64, 1024)
    lin.weight = nn.Parameter(sd["big"], requires_grad=False)
    assert own_remaining(nn.ModuleList([lin]), sd) == 0
    assert lin.weight.data_ptr() == sd["big"].data_ptr()


@needs_proc
@pytest.mark.slow
def test_the_built_model_holds_no_view_of_its_cached_checkpoint(model_path: Path, tmp_path: Path) -> None:
    """The embedded model from its weights cache (a mapped safetensors file), built as a worker builds it:
    once the checkpoint is dropped no page of the cache file stays mapped, and the embedding keeps its
    values."""
    from tokenmill.models.linear import onednn_packing_available

    if not onednn_packing_available(torch.zeros(1, dtype=torch.bfloat16)):
        pytest.skip("without oneDNN's bf16 packing the linears use the checkpoint as is: the mapping stays")
    registry.load_checkpoint(model_path, torch.bfloat16, tmp_path)  # writes the cache
    loaded = registry.load_checkpoint(model_path, torch.bfloat16, tmp_path)  # maps it
    (cache,) = tmp_path.glob("*/bfloat16/*/model.safetensors")
    assert _mapped(cache)
    model = registry.build(loaded.config, loaded.state_dict, torch.bfloat16, torch.device("cpu"), 256)
    embedding = model.embed_tokens.weight.clone()
    del loaded
    gc.collect()
    assert not _mapped(cache)
    assert torch.equal(model.embed_tokens.weight, embedding)
