"""Tokenizers: GGUF and Hugging Face loading, chat templates, streaming detokenization."""

from tokenmill.tokenizer.chat_template import ChatTemplateError, render_chat_template
from tokenmill.tokenizer.detokenizer import IncrementalDetokenizer
from tokenmill.tokenizer.gguf_tokenizer import tokenizer_from_gguf
from tokenmill.tokenizer.tokenizer import Tokenizer

__all__ = [
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "Tokenizer",
    "render_chat_template",
    "tokenizer_from_gguf",
]
