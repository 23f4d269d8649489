"""Where a llava folder's answer looks, computed from transformers alone (for the tests of qkv attention
--image and of qkv explore's image view): the prompt from the tokenizer's chat template (the <image> token
expanded to one per patch, as LlavaProcessor does), CLIPImageProcessor's pixels, the greedy answer, and the
eager attention (output_attentions=True) of a full forward over the prompt and the answer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Reference:
    ids: list[int]  # the prompt, placeholders expanded
    answer: list[int]
    attentions: tuple  # (1, H, T, T) per layer over ids + answer
    image_positions: list[int]

    def rows(self, token: int | None = None) -> list[int]:
        """The queries that chose the answer tokens (or answer token `token`): the position before each."""
        return [len(self.ids) - 1 + j for j in (range(len(self.answer)) if token is None else [token])]

    def grid(self, side: int, layers: list[int] | None = None, token: int | None = None) -> torch.Tensor:
        """(side, side): the mean over the layers, heads and rows of the attention on each placeholder."""
        chosen = range(len(self.attentions)) if layers is None else layers
        total = torch.zeros(len(self.image_positions), dtype=torch.float64)
        rows = self.rows(token)
        for layer in chosen:
            a = self.attentions[layer][0].double()  # (H, T, T)
            for r in rows:
                total += a[:, r, self.image_positions].sum(0)
        return (total / (len(chosen) * self.attentions[0].shape[1] * len(rows))).reshape(side, side)


def reference(folder: Path, image, question: str, image_token_id: int, n_patches: int,
              max_new_tokens: int) -> Reference:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    pixels = transformers.CLIPImageProcessor.from_pretrained(folder)(
        images=image.convert("RGB"), return_tensors="pt").pixel_values
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    ids = [x for i in ids for x in ([i] * n_patches if i == image_token_id else [i])]
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(folder, attn_implementation="eager")
    hf.eval()
    with torch.no_grad():
        seq = hf.generate(input_ids=torch.tensor([ids]), pixel_values=pixels, max_new_tokens=max_new_tokens,
                          do_sample=False)
        att = hf(input_ids=seq, pixel_values=pixels, output_attentions=True).attentions
    positions = [i for i, t in enumerate(ids) if t == image_token_id]
    return Reference(ids, seq[0, len(ids):].tolist(), att, positions)
