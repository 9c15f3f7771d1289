"""KServe v2 / Triton datatypes: protocol names, config names, numpy types, binary layout."""

from __future__ import annotations

import struct

import numpy as np

# protocol name -> numpy dtype (BYTES: numpy object arrays of bytes)
NUMPY: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(np.object_),
}
CONFIG_TO_PROTOCOL = {f"TYPE_{k}": k for k in NUMPY if k != "BYTES"} | {"TYPE_STRING": "BYTES"}
PROTOCOL_TO_CONFIG = {v: k for k, v in CONFIG_TO_PROTOCOL.items()}


def protocol_of(arr: np.ndarray) -> str:
    if arr.dtype.kind in ("O", "S", "U"):
        return "BYTES"
    for name, dt in NUMPY.items():
        if dt == arr.dtype:
            return name
    raise ValueError(f"numpy dtype {arr.dtype} has no KServe v2 datatype")


def from_json(data: list, datatype: str, shape: list[int]) -> np.ndarray:
    """A tensor from the JSON `data` field (nested or flat, row-major)."""
    if datatype == "BYTES":
        flat = np.array(_flatten(data), dtype=object)
        flat = np.array([s.encode() if isinstance(s, str) else bytes(s) for s in flat], dtype=object)
    else:
        flat = np.asarray(_flatten(data), dtype=NUMPY[datatype])
    expected = int(np.prod(shape)) if shape else 1
    if flat.size != expected:
        raise ValueError(f"has {flat.size} values but shape {shape} needs {expected}")
    return flat.reshape(shape)


def to_json(arr: np.ndarray) -> list:
    if protocol_of(arr) == "BYTES":
        return [b.decode("utf-8", "replace") if isinstance(b, bytes) else str(b) for b in arr.reshape(-1)]
    return arr.reshape(-1).tolist()


def bytes_elements(blob: bytes) -> np.ndarray:
    """The elements of serialized BYTES data: each a 4-byte little-endian length, then the bytes."""
    items, pos = [], 0
    while pos < len(blob):
        if pos + 4 > len(blob):
            raise ValueError("BYTES data ends inside a length prefix")
        (n,) = struct.unpack_from("<I", blob, pos)
        items.append(blob[pos + 4 : pos + 4 + n])
        pos += 4 + n
    return np.array(items, dtype=object)


def from_binary(blob: bytes, datatype: str, shape: list[int]) -> np.ndarray:
    if datatype == "BYTES":
        arr = bytes_elements(blob)
    else:
        dt = NUMPY[datatype].newbyteorder("<")
        if len(blob) % dt.itemsize:
            raise ValueError(f"{len(blob)} bytes is not a whole number of {datatype} values")
        arr = np.frombuffer(blob, dtype=dt)
    expected = int(np.prod(shape)) if shape else 1
    if arr.size != expected:
        raise ValueError(f"has {arr.size} values but shape {shape} needs {expected}")
    return arr.reshape(shape)


def to_binary(arr: np.ndarray) -> bytes:
    if protocol_of(arr) == "BYTES":
        parts = []
        for b in arr.reshape(-1):
            b = b if isinstance(b, bytes) else str(b).encode()
            parts.append(struct.pack("<I", len(b)) + b)
        return b"".join(parts)
    return np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()


def _flatten(x) -> list:
    if isinstance(x, list | tuple):
        out = []
        for v in x:
            out.extend(_flatten(v))
        return out
    return [x]
