"""qkv's LLaVA on its own (no transformers): placeholders and images, generation through the decoder protocol,
the interactive /image command, saving and loading, clear errors."""

from __future__ import annotations

import io

import pytest
import torch

import qkv
from qkv.config import ConfigError
from qkv.models.gpt import GPTConfig
from qkv.models.vlm import LLaVA, VisionConfig, VLMConfig

IMG = 50  # the placeholder id


def tiny(**change) -> LLaVA:
    vision = VisionConfig(image_size=16, patch_size=8, n_layers=1, d_model=32, n_heads=4, d_ff=64)
    text = GPTConfig(vocab_size=60, n_layers=2, d_model=48, n_heads=4, n_kv_heads=2, d_ff=96, ffn="swiglu",
                     norm="rmsnorm", position="rope", bias=False, context_length=64, tie_embeddings=False)
    torch.manual_seed(0)
    return LLaVA(VLMConfig(vision=vision, text=text, image_token_id=IMG, **change)).eval()


def prompt(n_images: int = 1, per_image: int = 4) -> torch.Tensor:
    ids = [1, 7]
    for _ in range(n_images):
        ids += [IMG] * per_image + [9]
    return torch.tensor([ids + [11, 12]])


def pixels(n: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def test_image_features_replace_the_placeholders_in_order():
    model = tiny()
    assert model.config.image_tokens == 4  # a 2x2 grid; the class token dropped
    ids, pix = prompt(2), pixels(2)
    feats = model.image_features(pix)
    assert feats.shape == (2, 4, 48)
    x = model.embed(ids, feats)
    where = (ids[0] == IMG).nonzero().flatten()
    assert torch.equal(x[0, where], feats.reshape(8, 48))
    assert torch.equal(x[0, :2], model.language_model.tok_emb(ids[0, :2]))
    with torch.no_grad():  # the second image changes the logits after it, not before
        a, b = model(ids, pix).logits, model(ids, torch.cat([pix[:1], pixels(1, seed=5)])).logits
    assert torch.allclose(a[0, :7], b[0, :7]) and not torch.allclose(a[0, 7:], b[0, 7:])


def test_placeholder_count_must_match_the_patches():
    model = tiny()
    with pytest.raises(ValueError,
                       match=r"holds 5 image placeholder tokens \(id 50\) but 1 image\(s\) give 4 patch"):
        model(prompt(1, per_image=5), pixels(1))
    with pytest.raises(ValueError, match="holds 4 image placeholder tokens .* but 0 image"):
        model(prompt(1))
    with pytest.raises(ValueError, match="holds 4 image placeholder tokens .* 2 image"):
        model(prompt(1), pixels(2))
    with pytest.raises(ValueError, match=r"holds 3 image placeholder tokens .* give 4"):
        model.generate(prompt(1, per_image=3), 2, pixel_values=pixels(1))
    with pytest.raises(ValueError, match=r"repeated for num_return_sequences > 1 .*not supported"):
        model.generate(prompt(1), 2, pixel_values=pixels(1), do_sample=True, num_return_sequences=2)
    with pytest.raises(ValueError, match=r"pixel_values must be \(n_images, 3, 16, 16\)"):
        model(prompt(1), torch.zeros(1, 3, 32, 32))
    # the serving step's scatter checks the same (it is the same code): rows per position, and their width
    ids = prompt(1)
    where = ids == IMG
    d = model.config.text.d_model
    with pytest.raises(ValueError, match=r"holds 4 image placeholder tokens .* but 3 image embeddings"):
        model.step_with_images(ids, None, where=where, features=torch.zeros(3, d))
    with pytest.raises(ValueError, match=rf"of width {d + 1} \(the decoder's: {d}\)"):
        model.step_with_images(ids, None, where=where, features=torch.zeros(4, d + 1))


def test_generation_with_the_cache_equals_recomputation():
    model = tiny()
    ids, pix = prompt(), pixels()
    cached = model.generate(ids, 8, pixel_values=pix, min_new_tokens=8)
    recomputed = model.generate(ids, 8, pixel_values=pix, min_new_tokens=8, use_cache=False)
    assert cached.tolist() == recomputed.tolist()
    # greedy by hand: each token the argmax of a full forward over prompt + tokens so far, image included
    seq = ids
    with torch.no_grad():
        for _ in range(8):
            logits = model(seq, pix).logits[:, -1]
            logits[:, IMG] = float("-inf")  # the placeholder is never generated (a banned word by default)
            nxt = logits.argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    assert cached.tolist() == seq.tolist()
    out = model.generate(ids, 3, pixel_values=pix, min_new_tokens=3, return_attentions=True)  # full forwards
    assert out.sequences.tolist() == cached[:, : ids.shape[1] + 3].tolist()
    assert model._pending is None  # the images are the call's only


def test_a_placeholder_id_past_the_vocabulary_and_the_other_options():
    model = tiny(feature_select="full", projector="linear")
    model.config.image_token_id = 1000  # past the 60-token vocabulary, as some folders have it
    assert model.config.image_tokens == 5
    ids = torch.tensor([[1, 7] + [1000] * 5 + [9]])
    with torch.no_grad():
        assert model(ids, pixels()).logits.shape == (1, 8, 60)
    assert model.projector.linear_2 is None


def test_save_and_load_keep_the_function(tmp_path):
    model = tiny()
    model.save_pretrained(tmp_path)
    loaded = qkv.from_pretrained(tmp_path)
    assert isinstance(loaded, LLaVA)
    with torch.no_grad():
        assert torch.equal(loaded(prompt(), pixels()).logits, model(prompt(), pixels()).logits)


@pytest.mark.parametrize("change, message", [
    ({"feature_select": "cls"}, "feature_select"), ({"projector": "mlp3"}, "projector"),
    ({"projector_act": "swiglu"}, "projector_act must be one of .*'gelu'.*, got 'swiglu'"),
])
def test_config_errors(change, message):
    with pytest.raises(ConfigError, match=message):
        tiny(**change)
    with pytest.raises(ConfigError, match="drops a class token"):
        LLaVA(VLMConfig(vision=VisionConfig(class_token=False, n_layers=0, d_model=32, n_heads=4),
                        text=GPTConfig(n_layers=1, d_model=32, n_heads=4)))


class Words:
    """The smallest tokenizer a ChatSession needs (plain transcript, no template): a word -> an id by its
    length."""

    has_chat_template, end_of_turn_ids, eos_token = False, frozenset(), ""

    def encode(self, text, add_special_tokens=True):
        return [IMG if w == "<image>" else 1 + len(w) % 40 for w in text.split()]

    def id_to_token(self, i):
        return "<image>" if i == IMG else None

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))

    def stream_decoder(self, skip_special_tokens=True):
        class Pieces:
            def push(self, i):
                return f" {i}"

            def flush(self):
                return ""
        return Pieces()


def session(tmp_path, max_new_tokens: int = 3):
    """A VisionChatSession over the tiny model (context 64, 4 placeholders per image) and a red picture."""
    from PIL import Image

    from qkv.chat_vision import VisionChatSession
    from qkv.generate import GenerationConfig
    from qkv.interop.llava import ImageProcessor

    Image.new("RGB", (20, 16), (200, 30, 30)).save(tmp_path / "red.png")
    return VisionChatSession(tiny(), Words(),
                             generation_config=GenerationConfig(max_new_tokens=max_new_tokens),
                             processor=ImageProcessor(size=16, crop=(16, 16)), note=lambda msg: None)


def test_interactive_image_command(tmp_path):
    """/image PATH in the chat loop sets the image for the next message; a bad path is said, not raised."""
    from qkv.chat import chat_loop

    chat = session(tmp_path)
    out = io.StringIO()
    n = chat_loop(chat, [f"/image {tmp_path / 'red.png'}", "hello there", "/image nope.png", "again"], out)
    text = out.getvalue()
    assert n == 2 and "(image set" in text and "nope.png: no such image file" in text
    first = chat.history[0]
    assert first["content"] == "hello there" and chat._image_message is first
    assert chat.pixel_values.shape == (1, 3, 16, 16)
    ids = chat._render(chat.history[:1])
    assert ids.count(IMG) == 4 and ids[1:5] == [IMG] * 4  # the plain transcript: "User: <image>\nhello there"


def test_the_image_is_never_dropped_from_a_chat(tmp_path):
    chat = session(tmp_path, max_new_tokens=40)
    chat.set_image(tmp_path / "red.png")
    chat.reply("what is this")  # ~10 prompt tokens + 40: fits the context of 64
    with pytest.raises(ValueError, match="no longer fits the model's context with its image"):
        chat.reply("and now")  # the first exchange would have to go, and the image with it
    assert len(chat.history) == 2 and chat._image_message is chat.history[0]
    chat.reset()
    chat.reply("again")  # the image goes with the next message after /reset
    assert chat._image_message is chat.history[0] and chat.history[0]["content"] == "again"
