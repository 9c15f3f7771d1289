"""Quantization as one seam: a config says which method a model's linears take (quant/config.py), each
method owns its weights' form, the codes it takes from the checkpoint and the kernels it picks for this
CPU (quant/int4.py, int8.py, fp8.py; the checkpoint's own weights: method.py's Unquantized), registered by
name (quant/method.py). Model files
describe the architecture only; models/llama.py's build_model hands the built module to
`quantize_model`."""

from tokenmill.models.quant.config import QuantConfig
from tokenmill.models.quant.method import METHODS, QuantMethod, method_class, method_names, quantize_model

# The methods register themselves (quant/method.py's METHODS) when imported.
from tokenmill.models.quant import fp8, int4, int8  # noqa: E402, F401  isort: skip

__all__ = ["METHODS", "QuantConfig", "QuantMethod", "method_class", "method_names", "quantize_model"]
