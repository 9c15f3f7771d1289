"""Greedy decoding with the Hugging Face model, token by token, keeping the logits."""

from __future__ import annotations

import torch


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy continuation ignoring EOS, and the log-softmax of the logits that chose each token."""
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    tokens: list[int] = []
    logprobs: list[torch.Tensor] = []
    for _ in range(max_new_tokens):
        lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        tok = int(lp.argmax())
        tokens.append(tok)
        logprobs.append(lp)
        out = model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, logprobs
