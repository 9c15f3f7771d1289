"""Reading a GGUF file: metadata as plain Python values, tensors dequantized to float32, and 4-bit
tensors also as their own codes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

if TYPE_CHECKING:
    from tokenmill.weights.group_codes import GroupCodes, Int8Groups

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


class GGUFFormatError(ValueError):
    """The file is not a GGUF file the reader can make sense of: damaged, cut off, or something else."""


class GGUFFile:
    """A GGUF file opened lazily (memory-mapped by the gguf package)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._reader = GGUFReader(str(self.path))
        except OSError:
            raise  # cannot be read at all (permissions, a folder): the OS's own words say it
        except Exception as e:
            # A damaged file fails in the reader wherever the damage is (IndexError, ValueError, a bad
            # enum, an undecodable string): name the file and what it is, not the parser's internals.
            msg = f"{self.path}: not a readable GGUF file (corrupt or truncated?): {e}"
            raise GGUFFormatError(msg) from e
        self._check_extents()
        self._by_name = {t.name: t for t in self._reader.tensors}
        self.metadata: dict[str, Any] = {}
        for key, field in self._reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                self.metadata[key] = field.contents()
            except Exception:  # an exotic field type we do not use; skip rather than fail the load
                continue

    def _check_extents(self) -> None:
        """Every tensor's data lies inside the file: the reader maps a cut-off file's last tensors as
        shorter arrays, which would fail later, far from the cause, or not at all for unread ones."""
        size = self.path.stat().st_size
        for t in self._reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size:
                raise GGUFFormatError(
                    f"{self.path}: truncated: tensor {t.name} ends at byte {end}, the file has {size}"
                )

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
        return self._dequantize(self._by_name[name])

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape in PyTorch's order ([out, in] for a matrix), without reading its data."""
        return tuple(int(d) for d in reversed(self._by_name[name].shape.tolist()))

    def group_codes(self, name: str) -> GroupCodes | None:
        """A 4-bit tensor's own codes, scales and minima (Q4_0, Q4_1, Q4_K; weights/group_codes.py), in
        PyTorch's [out, in] order; None for a tensor of any other type."""
        # The codes are torch tensors: imported here, so that reading metadata (a frontend's tokenizer)
        # does not import torch.
        from tokenmill.weights.group_codes import FOUR_BIT_TYPES, codes_from_blocks

        t = self._by_name[name]
        qtype = GGMLQuantizationType(t.tensor_type)
        if qtype not in FOUR_BIT_TYPES or len(t.shape) != 2:
            return None
        k, n = (int(d) for d in t.shape.tolist())
        return codes_from_blocks(t.data, qtype, n, k)

    def int8_groups(self, name: str) -> Int8Groups | None:
        """A Q8_0 tensor's own codes and float16 scales (weights/group_codes.py), in PyTorch's [out, in]
        order; None for a tensor of any other type."""
        from tokenmill.weights.group_codes import int8_groups_from_blocks

        t = self._by_name[name]
        if GGMLQuantizationType(t.tensor_type) != GGMLQuantizationType.Q8_0 or len(t.shape) != 2:
            return None
        k, n = (int(d) for d in t.shape.tolist())
        return int8_groups_from_blocks(t.data, n, k)

    def _dequantize(self, t: ReaderTensor) -> np.ndarray:
        qtype = GGMLQuantizationType(t.tensor_type)
        if qtype not in SUPPORTED_TYPES:
            raise ValueError(f"{self.path.name}: tensor {t.name} has unsupported type {qtype.name}")
        arr = dequantize(t.data, qtype)
        # GGUF lists dims fastest-first; numpy wants them slowest-first.
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        return np.ascontiguousarray(arr.reshape(shape), dtype=np.float32)
