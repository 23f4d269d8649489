"""Image requests in the paged Engine: time to first token of a new image vs a repeated one, CPU, one thread.

A random-weight LLaVA shaped like LLaVA 1.5 at a small width: a CLIP-style tower on 224 px images of 14 px
patches (256 image tokens), 4 blocks 256 wide, and a 4-block Llama-style decoder 256 wide (vocabulary 1000).
The prompt: 8 text tokens, the image's 256 placeholders, 24 text tokens (288 in all). Each case is one
request alone in the engine, timed from add_request to its first token (the median of --trials):

  new image            a picture never seen: the vision tower runs, the whole prompt is prefilled
  same image + prompt  the blocks of the earlier request are in the prefix cache (its key hashes the image's):
                       no vision tower, only the last prompt token is fed
  same image, new text the question after the image differs: the blocks up to the image are shared, the rest
                       is prefilled; no vision tower
  same image, no prefix cache (--no-prefix-caching): the whole prompt is prefilled, the embeddings come from
                       the LRU (EngineConfig.image_cache): no vision tower

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/vlm_engine.py [--trials 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from qkv.generate.engine import Engine, ImageInput
from qkv.models.gpt import GPTConfig
from qkv.models.vlm import LLaVA, VisionConfig, VLMConfig

IMG = 999


def build() -> LLaVA:
    vision = VisionConfig(image_size=224, patch_size=14, n_layers=4, d_model=256, n_heads=4, d_ff=1024)
    text = GPTConfig(vocab_size=1000, n_layers=4, d_model=256, n_heads=4, n_kv_heads=2, d_ff=768,
                     ffn="swiglu", norm="rmsnorm", position="rope", bias=False, context_length=512)
    torch.manual_seed(0)
    return LLaVA(VLMConfig(vision=vision, text=text, image_token_id=IMG)).eval()


def prompt(question: int, n_image: int) -> list[int]:
    return [1, *range(10, 17)] + [IMG] * n_image + [(question * 7 + i) % 900 + 20 for i in range(24)]


def ttft(engine: Engine, ids: list[int], pixels: torch.Tensor, key: str) -> tuple[float, int]:
    """(seconds from add_request to the first token, that token)."""
    t0 = time.perf_counter()
    rid = engine.add_request(ids, max_new_tokens=1, images=[ImageInput(pixels, key=key)])
    while rid not in engine.finished:
        engine.step()
    return time.perf_counter() - t0, engine.finished[rid][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = build()
    n_image = model.config.image_tokens
    on = Engine(model, block_size=16, num_blocks=512)
    off = Engine(model, block_size=16, num_blocks=512, prefix_caching=False)
    times: dict[str, list[float]] = {k: [] for k in ("new", "same", "text", "lru")}
    for t in range(args.trials):
        pix = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(t))
        key = f"img{t}"
        first: dict[str, int] = {}
        for name, engine, question in (("new", on, 0), ("same", on, 0), ("text", on, t + 1),
                                       ("", off, 0), ("lru", off, 0)):  # "": fills off's LRU
            seconds, first[name] = ttft(engine, prompt(question, n_image), pix, key)
            if name:
                times[name].append(seconds)
        # the cached paths give the token the full computation gives
        assert first["new"] == first["same"] == first[""] == first["lru"], first
    with torch.no_grad():
        pix = torch.randn(1, 3, 224, 224)
        model.image_features(pix)  # a warm-up call: the first one pays for allocations, not the tower
        t0 = time.perf_counter()
        for _ in range(args.trials):
            model.image_features(pix)
        tower = (time.perf_counter() - t0) / args.trials
    print(f"prompt {len(prompt(0, n_image))} tokens ({n_image} image placeholders), one thread, "
          f"median of {args.trials}; vision tower + projector alone {tower * 1e3:.1f} ms")
    names = {"new": "new image", "same": "same image + prompt", "text": "same image, new text",
             "lru": "same image, no prefix cache"}
    for k, label in names.items():
        print(f"  {label:30s} TTFT {statistics.median(times[k]) * 1e3:7.1f} ms")
    st = on.stats()
    print(f"prefix-caching engine: images encoded {st['images_encoded']}, embeddings from the LRU "
          f"{st['image_cache_hits']}, prefix hit tokens {st['prefix_hit_tokens']}; first tokens of the "
          "repeats equal the new image's")


if __name__ == "__main__":
    main()
