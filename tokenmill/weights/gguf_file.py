"""Reading a GGUF file: metadata as plain Python values, tensors dequantized to float32."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

# Tensor types we dequantize; the issue asks for at least these, the gguf package knows more.
SUPPORTED_TYPES = {
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
}


class GGUFFile:
    """A GGUF file opened lazily (memory-mapped by the gguf package)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._reader = GGUFReader(str(self.path))
        self.metadata: dict[str, Any] = {}
        for key, field in self._reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                self.metadata[key] = field.contents()
            except Exception:  # an exotic field type we do not use; skip rather than fail the load
                continue

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "llama"))

    def arch_value(self, name: str, default: Any = None) -> Any:
        """Value of `<architecture>.<name>` (e.g. `block_count`)."""
        return self.metadata.get(f"{self.architecture}.{name}", default)

    def tensor_names(self) -> list[str]:
        return [t.name for t in self._reader.tensors]

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """Yield (gguf name, float32 array in PyTorch [out, in] order)."""
        for t in self._reader.tensors:
            yield t.name, self._dequantize(t)

    def tensor(self, name: str) -> np.ndarray:
        for t in self._reader.tensors:
            if t.name == name:
                return self._dequantize(t)
        raise KeyError(name)

    def _dequantize(self, t: ReaderTensor) -> np.ndarray:
        qtype = GGMLQuantizationType(t.tensor_type)
        if qtype not in SUPPORTED_TYPES:
            raise ValueError(f"{self.path.name}: tensor {t.name} has unsupported type {qtype.name}")
        arr = dequantize(t.data, qtype)
        # GGUF lists dims fastest-first; numpy wants them slowest-first.
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        return np.ascontiguousarray(arr.reshape(shape), dtype=np.float32)
