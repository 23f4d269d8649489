"""Image requests in the paged Engine (a tiny random LLaVA): greedy tokens equal model.generate with the same
pixel values, batched with other images and text, with a chunked prefill that cuts an image's placeholders;
the prefix cache never mixes two images up and shares the blocks of a repeated one; the LRU of projected
embeddings spares a repeated image the vision tower and holds its bound."""

from __future__ import annotations

import pytest
import torch
from _genmodels import IMG, tiny_llava

from qkv.generate.engine import Engine, ImageInput
from qkv.generate.images import ImageEncoder

N = 6  # new tokens per request


@pytest.fixture(scope="module")
def model():
    return tiny_llava()


def pixels(seed: int, n: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def prompt(n_images: int = 1, lead: int = 7) -> list[int]:
    ids = [1, lead, 3]
    for _ in range(n_images):
        ids += [IMG] * 4 + [9]
    return ids + [11, 12]


def reference(model, ids: list[int], pix: torch.Tensor | None) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=N, pixel_values=pix)
    return out[0, len(ids):].tolist()


class CountCalls:
    """model.image_features wrapped: how many times the vision tower ran, on how many images."""

    def __init__(self, model, monkeypatch) -> None:
        self.calls, self.images, inner = 0, 0, model.image_features

        def counted(pixel_values):
            self.calls += 1
            self.images += pixel_values.shape[0]
            return inner(pixel_values)

        monkeypatch.setattr(model, "image_features", counted)


@pytest.mark.parametrize("chunk", [None, 5, 3])
def test_image_requests_batched_with_text_equal_generate(model, chunk):
    # four requests at once: three images (one request with two), and a text-only prompt; a chunk of 3 or 5
    # tokens cuts every image's 4 placeholders across two steps
    cases = [(prompt(1), pixels(0)), (prompt(1), pixels(1)), (prompt(2, lead=8), pixels(2, n=2)),
             ([1, 7, 3, 9, 11, 12], None)]
    refs = [reference(model, ids, pix) for ids, pix in cases]
    assert refs[0] != refs[1]  # the image matters: the comparisons below mean something
    engine = Engine(model, block_size=4, prefill_chunk=chunk, max_new_tokens=N)
    rids = [engine.add_request(ids, images=None if pix is None else [ImageInput(p) for p in pix])
            for ids, pix in cases]
    out = engine.run()
    assert [out[r] for r in rids] == refs
    st = engine.stats()
    assert st["image_requests"] == 3 and st["images"] == 4 and st["images_encoded"] == 4


def test_same_text_other_image_never_shares_blocks(model, monkeypatch):
    ids = prompt(1)
    a, b = reference(model, ids, pixels(0)), reference(model, ids, pixels(1))
    assert a != b
    engine = Engine(model, block_size=4, max_new_tokens=N)
    first = engine.add_request(ids, images=[ImageInput(pixels(0))])
    engine.run()
    hit = engine.counters.prefix_hit_tokens
    # the same prompt ids, another image: block 0 (positions 0-3) already holds the image's first placeholder,
    # so no block is shared
    second = engine.add_request(ids, images=[ImageInput(pixels(1))])
    engine.run()
    assert engine.counters.prefix_hit_tokens - hit == 0  # block 0 ends inside the image: nothing shared
    assert engine.finished[first] == a and engine.finished[second] == b
    # both at once, and a third with the first image again: each its own answer
    rids = [engine.add_request(ids, images=[ImageInput(pixels(k))]) for k in (1, 0, 1)]
    out = engine.run()
    assert [out[r] for r in rids] == [b, a, b]


def test_a_repeated_image_hits_the_prefix_cache_and_the_tower_runs_once(model, monkeypatch):
    ids = [1, 7, 3, 2, 9, 10] + [IMG] * 4 + [9, 11, 12]  # 13 tokens: the image in blocks 1 and 2 of 4
    want = reference(model, ids, pixels(0))
    count = CountCalls(model, monkeypatch)
    engine = Engine(model, block_size=4, max_new_tokens=N, image_cache=4)
    r0 = engine.add_request(ids, images=[ImageInput(pixels(0), key="cat.png")])
    engine.run()
    computed = engine.counters.prefill_tokens
    assert computed == len(ids) and count.calls == 1
    r1 = engine.add_request(ids, images=[ImageInput(pixels(0), key="cat.png")])
    engine.run()
    # the three full blocks of the prompt come from the cache, the vision tower is not run: no prefill (the
    # last prompt token is fed by a decoding step)
    assert engine.counters.prefill_tokens - computed == 0
    assert engine.counters.prefix_hit_tokens == 12 and count.calls == 1
    assert engine.finished[r0] == engine.finished[r1] == want
    # the same key names the same content: a different key for the same pixels does not match the blocks
    before = engine.counters.prefix_hit_tokens
    r2 = engine.add_request(ids, images=[ImageInput(pixels(0), key="other.png")])
    engine.run()
    assert engine.counters.prefix_hit_tokens - before == 4 and count.calls == 2  # block 0 only: text
    assert engine.finished[r2] == want


def test_the_embeddings_lru_skips_the_tower_after_eviction_and_holds_its_bound(model, monkeypatch):
    ids = prompt(1)
    count = CountCalls(model, monkeypatch)
    # no prefix cache: every prompt is computed again, only the LRU spares the tower
    engine = Engine(model, block_size=4, max_new_tokens=2, image_cache=2, prefix_caching=False)
    for k in (0, 1, 0, 2):
        engine.add_request(ids, images=[ImageInput(pixels(k))])
        engine.run()
    assert count.images == 3 and engine.stats()["image_cache_hits"] == 1
    assert len(engine.images.cache) == 2  # images 0 and 2, the most recent two
    engine.add_request(ids, images=[ImageInput(pixels(1))])  # 1 was evicted: encoded again
    engine.run()
    assert count.images == 4 and len(engine.images.cache) == 2
    off = Engine(model, block_size=4, max_new_tokens=2, image_cache=0)
    for _ in range(2):
        off.add_request(ids, images=[ImageInput(pixels(0))])
        off.run()
    assert len(off.images.cache) == 0


def test_preemption_and_cancel_with_images(model):
    cases = [(prompt(1, lead=k + 4), pixels(k)) for k in range(3)]
    refs = [reference(model, ids, pix) for ids, pix in cases]
    # 7 blocks of 4 positions for three 16-position sequences: preemption, recomputed from the same images
    engine = Engine(model, block_size=4, num_blocks=7, max_new_tokens=N, prefill_chunk=3)
    rids = [engine.add_request(ids, images=[ImageInput(pix)]) for ids, pix in cases]
    out = engine.run()
    assert [out[r] for r in rids] == refs and engine.stats()["preemptions"] > 0
    rid = engine.add_request(prompt(1), images=[ImageInput(pixels(5))])
    engine.step()
    assert engine.cancel(rid) and engine.finish_reason[rid] == "cancelled" and not engine.has_work


def test_precomputed_features_equal_pixels(model):
    ids = prompt(1)
    with torch.no_grad():
        feats = model.image_features(pixels(3))[0]
    engine = Engine(model, block_size=4, max_new_tokens=N)
    rid = engine.add_request(ids, images=[ImageInput(features=feats)])
    assert engine.run()[rid] == reference(model, ids, pixels(3))


def test_bad_image_requests_are_refused(model):
    from _genmodels import tiny_gpt

    engine = Engine(model, block_size=4, max_new_tokens=2)
    with pytest.raises(ValueError, match="4 image placeholder tokens .* take 8"):
        engine.add_request(prompt(1), images=[ImageInput(pixels(0)), ImageInput(pixels(1))])
    with pytest.raises(ValueError, match="8 image placeholder tokens .* take 0"):
        engine.add_request(prompt(2))
    with pytest.raises(ValueError, match="takes no images"):
        Engine(tiny_gpt(), block_size=4).add_request([1, 2], images=[ImageInput(pixels(0))])
    with pytest.raises(ValueError, match="pixel_values or features"):
        ImageInput()
    with pytest.raises(ValueError, match="pixel_values must be"):
        ImageInput(torch.zeros(16, 16))
    assert not engine.has_work
    # the content key: the pixels' bytes unless a key is given
    digest = ImageInput(pixels(0)).digest()
    assert digest == ImageInput(pixels(0)[0]).digest() != ImageInput(pixels(1)).digest()
    assert ImageInput(pixels(0), key="a").digest() == ImageInput(pixels(1), key="a").digest()
    assert isinstance(engine.images, ImageEncoder)


def test_images_that_do_not_fit_the_model_are_refused_before_queueing(model):
    # each would fail inside step() (stopping the engine for every request) or, for too-wide features,
    # fill the placeholders with the wrong numbers: refused by add_request, nothing queued
    engine = Engine(model, block_size=4, max_new_tokens=2)
    bad = [(torch.zeros(1, 3, 32, 32), "pixel_values must be .n_tiles, 3, 16, 16"),
           (torch.zeros(1, 1, 16, 16), "pixel_values must be .n_tiles, 3, 16, 16")]
    for pix, match in bad:
        with pytest.raises(ValueError, match=match):
            engine.add_request(prompt(1), images=[ImageInput(pix)])
    for feats in (torch.zeros(4, 49), torch.zeros(4, 47), torch.zeros(3, 48)):
        with pytest.raises(ValueError, match=r"features must be \(k \* 4, 48\)"):
            ids = prompt(1)[:3] + [IMG] * feats.shape[0] + [9]
            engine.add_request(ids, images=[ImageInput(features=feats)])
    assert not engine.has_work and engine.steps == 0
    rid = engine.add_request(prompt(1), images=[ImageInput(pixels(0))])
    assert len(engine.run()[rid]) == 2


def test_a_given_key_is_told_apart_by_the_tile_count(model):
    # one key, two tile counts: other placeholders and embeddings, so other blocks and LRU entries
    one, two = ImageInput(pixels(0), key="cat.png"), ImageInput(pixels(0, n=2), key="cat.png")
    assert one.digest() != two.digest()
    assert ImageInput(features=torch.zeros(4, 48), key="k").digest() \
        != ImageInput(features=torch.zeros(8, 48), key="k").digest()


def test_the_lru_holds_a_copy_per_image_not_a_view_of_the_batch(model):
    engine = Engine(model, block_size=4, max_new_tokens=2, image_cache=4)
    engine.add_request(prompt(2), images=[ImageInput(pixels(0)), ImageInput(pixels(1))])
    engine.run()
    assert len(engine.images.cache) == 2
    for f in engine.images.cache.values():  # the whole batch's storage is not kept alive by one entry
        assert f.untyped_storage().nbytes() == f.numel() * f.element_size()


@pytest.mark.parametrize("chunk", [None, 4])
def test_a_prompt_ending_with_its_image(model, chunk):
    # the prompt's last token is a placeholder: fed by a decoding step when the rest is cached (the repeat)
    # or prefilled (a chunk of 4 leaves it alone), it still takes the image's embedding
    ids = [1, 7, 3, 2, 9] + [IMG] * 4
    want = reference(model, ids, pixels(4))
    engine = Engine(model, block_size=4, max_new_tokens=N, prefill_chunk=chunk)
    for _ in range(2):
        rid = engine.add_request(ids, images=[ImageInput(pixels(4))])
        assert engine.run()[rid] == want
    assert engine.counters.prefix_hit_tokens == 8


@pytest.mark.parametrize("chunk", [None, 3])
def test_a_vision_tower_failure_fails_that_request_only(model, monkeypatch, chunk):
    text = [1, 7, 3, 9, 11, 12]
    refs = [reference(model, text, None), reference(model, prompt(1, lead=8), pixels(1)),
            reference(model, prompt(1), pixels(2))]
    inner = model.image_features

    def flaky(pixel_values):  # an out-of-memory on one image (all sevens), wherever it is in the batch
        if (pixel_values == 7).flatten(1).all(1).any():
            raise RuntimeError("out of memory (a test's vision tower)")
        return inner(pixel_values)

    monkeypatch.setattr(model, "image_features", flaky)
    engine = Engine(model, block_size=4, max_new_tokens=N, prefill_chunk=chunk)
    bad = engine.add_request(prompt(1), images=[ImageInput(torch.full((3, 16, 16), 7.0))])
    good = engine.add_request(prompt(1, lead=8), images=[ImageInput(pixels(1))])
    txt = engine.add_request(text)
    out = engine.run()
    assert engine.finish_reason[bad] == "error" and out[bad] == []
    assert "out of memory" in engine.errors[bad]
    assert out[txt] == refs[0] and out[good] == refs[1]
    assert engine.cache.blocks_in_use == 0  # the failed request's blocks went back too
    nxt = engine.add_request(prompt(1), images=[ImageInput(pixels(2))])  # the engine goes on
    assert engine.run()[nxt] == refs[2]
