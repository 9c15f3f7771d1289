"""A checkpoint's tokenizer alone, for a process that holds no weights (the API server, a router,
`tokenmill bench`): from the weights' cache, a Hugging Face directory or a GGUF file's metadata, without
importing PyTorch."""

from __future__ import annotations

from pathlib import Path

from tokenmill.tokenizer.tokenizer import Tokenizer
from tokenmill.weights.cache_paths import complete_caches
from tokenmill.weights.gguf_file import GGUFFile


def load_tokenizer(path: Path, cache_dir: Path | None) -> Tokenizer:
    """The tokenizer: from the cache, the HF directory or GGUF metadata."""
    if path.is_dir():
        return Tokenizer.from_dir(path)
    for cached in complete_caches(path, cache_dir):
        return Tokenizer.from_dir(cached)
    return Tokenizer.from_gguf_metadata(GGUFFile(path).metadata)
