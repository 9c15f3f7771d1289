"""Reading every supported GGUF tensor type back from a file we write, in PyTorch's [out, in] order."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

from tokenmill.weights.gguf_file import GGUFFile

ROWS, COLS = 8, 512  # [out, in]; 512 is a whole number of blocks for every type
# Types the numpy side of the gguf package can quantize, with the worst error we accept.
QUANTIZABLE = {
    Q.F32: 0,
    Q.F16: 2e-3,
    Q.BF16: 2e-2,
    Q.Q8_0: 0.03,
    Q.Q4_0: 0.5,
    Q.Q4_1: 0.4,
    Q.Q5_0: 0.3,
    Q.Q5_1: 0.2,
}
# K-quants: gguf only dequantizes them, so the file holds valid random blocks.
K_QUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]


def _random_blocks(qtype: Q, rng: np.random.Generator) -> np.ndarray:
    block, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(ROWS, COLS // block * nbytes), dtype=np.uint8)
    # Keep the float16 scale fields finite: re-roll any byte pair that decodes to inf/nan.
    with np.errstate(invalid="ignore", over="ignore"):  # the rejected draws are the point
        out = dequantize(raw, qtype)
        while not np.isfinite(out).all():
            raw = rng.integers(0, 64, size=raw.shape, dtype=np.uint8)
            out = dequantize(raw, qtype)
    return raw


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory) -> tuple[Path, dict]:
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("gguf") / "types.gguf"
    w = GGUFWriter(str(path), "llama")
    expected = {}
    x = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    for qtype in QUANTIZABLE:
        data = quantize(x, qtype)
        w.add_tensor(qtype.name, data, raw_dtype=qtype)
        expected[qtype.name] = (x, QUANTIZABLE[qtype], dequantize(data, qtype))
    for qtype in K_QUANTS:
        data = _random_blocks(qtype, rng)
        w.add_tensor(qtype.name, data, raw_dtype=qtype)
        expected[qtype.name] = (None, None, dequantize(data, qtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, expected


@pytest.mark.parametrize("name", [q.name for q in [*QUANTIZABLE, *K_QUANTS]])
def test_tensor_type_reads_back(gguf_path, name: str) -> None:
    path, expected = gguf_path
    original, tol, dequant = expected[name]
    got = GGUFFile(path).tensor(name)
    assert got.shape == (ROWS, COLS) and got.dtype == np.float32
    np.testing.assert_array_equal(got, dequant.reshape(ROWS, COLS))
    if original is not None:
        assert np.abs(got - original).max() <= tol
