"""A fixed, varied set of short chat prompts for fidelity measurements (no data set to download)."""

from __future__ import annotations

from tokenmill.tokenizer.tokenizer import Tokenizer

QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is.",
    "List three prime numbers.",
    "Who wrote Hamlet?",
    "What is 12 times 7?",
    "Name a color of the rainbow.",
    "Translate 'hello' to Spanish.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Summarize the plot of Cinderella.",
    "What does a CPU do?",
    "Write a Python function that adds two numbers.",
    "How many legs does a spider have?",
    "Tell me a joke about cats.",
    "What is photosynthesis?",
)


def chat_prompts(tokenizer: Tokenizer) -> list[list[int]]:
    """Each question as a one-turn chat, through the model's chat template, ready for generation."""
    return [
        tokenizer.encode_chat([{"role": "user", "content": q}], add_generation_prompt=True) for q in QUESTIONS
    ]
