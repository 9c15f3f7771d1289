"""A GGUF file written again with its quantized weights in another block type (Q8_0 by default): the
same metadata and tokenizer, each quantized 2-D tensor dequantized to float32 and quantized again by
the gguf package (bit for bit what llama.cpp's quantizer makes of those values), float tensors as they
are. For tests and benchmarks that need a Q8_0 file of the embedded model without llama.cpp's tools
(no model hub here): the int8 path reads such a file's own codes (weights/group_codes.py's Int8Groups).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def requantize(src: Path, dst: Path, qtype: GGMLQuantizationType = GGMLQuantizationType.Q8_0) -> Path:
    """Write `src` to `dst` with every quantized 2-D tensor in `qtype` (one already in it is copied as
    it is); the file appears whole or not at all. Returns dst."""
    reader = GGUFReader(src)
    arch = reader.get_field("general.architecture")
    if arch is None:
        raise ValueError(f"{src}: no general.architecture")
    tmp = dst.with_name(f"{dst.name}.{os.getpid()}.tmp")
    writer = GGUFWriter(str(tmp), str(arch.contents()))
    for field in reader.fields.values():
        # GGUF.* are the reader's own entries (version, counts); the writer adds the architecture.
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        ttype = GGMLQuantizationType(t.tensor_type)
        if ttype in _FLOAT_TYPES or ttype == qtype or len(t.shape) != 2:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=ttype)
            continue
        k, n = (int(d) for d in t.shape.tolist())
        values = dequantize(np.asarray(t.data), ttype).reshape(n, k).astype(np.float32)
        writer.add_tensor(t.name, quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)
    return dst
