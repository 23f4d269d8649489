"""Autoregressive generation for every decoder (GPT, encoder-decoder, Whisper-like).

First version: greedy / temperature / top-k sampling with a static KV cache. The full API (top-p, beams,
left-padded batches, stop strings, streaming, paged engine) is issue #5.
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.no_grad()
def generate(
    model,
    input_ids: Tensor,
    max_new_tokens: int = 32,
    *,
    attention_mask: Tensor | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    do_sample: bool = False,
    eos_token_id: int | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
) -> Tensor:
    """GPT: returns (B, T + new) prompt + continuation. Encoder-decoder: input_ids is the source,
    returns (B, new) target ids (without the start token)."""
    was_training = model.training
    model.eval()
    try:
        is_seq2seq = hasattr(model, "encode")
        if is_seq2seq:
            memory, _ = model.encode(input_ids, attention_mask)
            start = model.config.bos_token_id
            eos = model.config.eos_token_id if eos_token_id is None else eos_token_id
            seq = torch.full((input_ids.shape[0], 1), start, dtype=torch.long, device=input_ids.device)
        else:
            seq, eos = input_ids, eos_token_id
        B = seq.shape[0]
        cache = model.make_cache(B, seq.shape[1] + max_new_tokens) if use_cache else None
        done = torch.zeros(B, dtype=torch.bool, device=seq.device)
        step_in = seq
        for _ in range(max_new_tokens):
            inp = step_in if use_cache else seq
            if is_seq2seq:
                logits, _ = model.decode(inp, memory, memory_mask=attention_mask, cache=cache, last_only=True)
            else:
                logits = model(inp, cache=cache, last_only=True).logits
            logits = logits[:, -1].float()
            if do_sample:
                logits = logits / max(temperature, 1e-8)
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
            else:
                nxt = logits.argmax(-1, keepdim=True)
            if eos is not None:
                nxt = nxt.masked_fill(done.unsqueeze(1), eos)
                done |= nxt.squeeze(1) == eos
            seq = torch.cat([seq, nxt], dim=1)
            step_in = nxt
            if eos is not None and bool(done.all()):
                break
        return seq[:, 1:] if is_seq2seq else seq
    finally:
        model.train(was_training)
