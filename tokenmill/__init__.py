"""tokenmill: an open inference platform in Python."""

from typing import TYPE_CHECKING

from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.llm import LLM

__all__ = ["LLM", "LoRARequest", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):  # noqa: ANN202
    # `LLM` brings torch and the model stack; a client, a router or the protocol must not pay for it.
    if name == "LLM":
        from tokenmill.llm import LLM

        return LLM
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
