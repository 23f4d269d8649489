"""Hugging Face `siglip` folders: a tiny random-weight transformers SiglipModel loads into qkv's CLIP
(SigLIP's ends: attention-pooled image tower without projection, bidirectional text tower read at the final
position, sigmoid scoring with a logit bias) with the same image embeddings, text embeddings, logits and
sigmoid loss; `qkv embed` writes those embeddings, `qkv predict --labels` gives transformers' sigmoid
probabilities; bad input is one clear line, exit 2."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

import qkv  # noqa: E402
from qkv.cli.main import main  # noqa: E402
from qkv.image_text import open_clip, read_images, tokenize  # noqa: E402
from qkv.models.clip import CLIP  # noqa: E402
from qkv.storage import CheckpointError  # noqa: E402

WORDS = ["<pad>", "</s>", "<unk>", "a", "photo", "of", "cat", "dog", "red", "blue", "car", "the"]
EOS, CONTEXT = 1, 10


def save_tokenizer(folder):
    """A word-level tokenizer.json ending every text with </s>, padding with <pad> (SigLIP's layout)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", EOS)])
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(folder)


def hf_siglip(seed=0, **vision):
    cfg = transformers.SiglipConfig(
        text_config=dict(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=CONTEXT, pad_token_id=0,
                         eos_token_id=EOS),
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8, **vision))
    torch.manual_seed(seed)
    model = transformers.SiglipModel(cfg).eval()
    with torch.no_grad():  # HF's init zeros biases and sets norms to 1: make every weight matter
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
        model.logit_scale.fill_(np.log(20.0))  # exp(t) = 20, b = -3: probabilities away from 0 and 1
        model.logit_bias.fill_(-3.0)
    return model


def siglip_folder(folder, **kwargs):
    model = hf_siglip(**kwargs)
    model.save_pretrained(folder)
    save_tokenizer(folder)
    transformers.SiglipImageProcessor(size={"height": 32, "width": 32}).save_pretrained(folder)
    return model


def png(path, seed=0, size=(45, 70)):
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)).save(path)
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("siglip")
    siglip_folder(d)
    return d


def reference(folder, images, texts, **kw):
    """transformers' SiglipModel, its image processor, and its text layout: padding="max_length", no mask."""
    model = transformers.SiglipModel.from_pretrained(folder).eval()
    proc = transformers.SiglipImageProcessor.from_pretrained(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    pixels = proc([Image.open(f) for f in images], return_tensors="pt")["pixel_values"]
    ids = tok(texts, padding="max_length", max_length=CONTEXT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model(pixel_values=pixels, input_ids=ids, **kw), pixels, ids


def test_config_is_read_as_siglip(folder):
    model = qkv.from_pretrained(folder)
    c = model.config
    assert isinstance(model, CLIP) and c.sigmoid and c.vision.pooling == "map"
    assert model.visual.cls_emb is None
    assert model.visual_proj is None and c.text_pool == "final" and not c.text_causal
    assert c.max_logit_scale is None and c.vision.ffn == "gelu_tanh"


def test_equal_embeddings_logits_and_loss(folder, tmp_path):
    images = [str(png(tmp_path / f"{i}.png", seed=i)) for i in range(3)]
    texts = ["a photo of a cat", "dog", "the red car of a dog"]  # different lengths: padding differs
    ref, ref_pixels, ref_ids = reference(folder, images, texts, return_loss=True)
    clip = open_clip(folder)
    pixels = read_images(clip, images)
    torch.testing.assert_close(pixels, ref_pixels, atol=1e-5, rtol=1e-5)
    ids, mask = tokenize(clip, texts)
    assert torch.equal(ids, ref_ids) and bool(mask.all())
    with torch.no_grad():
        img, txt = clip.model.encode_image(pixels), clip.model.encode_text(ids, mask)
        logits = clip.model.zero_shot_logits(pixels, ids, mask)
        out = clip.model(pixels, ids, attention_mask=mask)
    assert ref.logits_per_image.std() > 0.1  # not a degenerate model
    torch.testing.assert_close(img, ref.image_embeds, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(txt, ref.text_embeds, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, ref.logits_per_image, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.logits, ref.logits_per_image, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-4, rtol=1e-4)


def test_another_seed_gives_other_embeddings(folder, tmp_path):
    """The parity above is not an accident of the inputs: another seed's weights are far off."""
    other = tmp_path / "other"
    siglip_folder(other, seed=5)
    image = str(png(tmp_path / "x.png"))
    ref, pixels, _ = reference(folder, [image], ["a cat"])
    with torch.no_grad():
        got = qkv.from_pretrained(other).encode_image(pixels)
    assert (got - ref.image_embeds).abs().max() > 1e-2


def test_embed_cli_images_and_texts(folder, tmp_path, capsys):
    images = [str(png(tmp_path / f"{i}.png", seed=10 + i)) for i in range(2)]
    texts = ["a cat", "a blue car"]
    ref, _, _ = reference(folder, images, texts)
    assert main(["embed", str(folder), "--image", *images, "--out", str(tmp_path / "img.npy")]) == 0
    assert "2 x 32 float32" in capsys.readouterr().out
    np.testing.assert_allclose(np.load(tmp_path / "img.npy"), ref.image_embeds.numpy(), atol=1e-5)
    assert main(["embed", str(folder), "--text", *texts, "--out", str(tmp_path / "txt.npy")]) == 0
    np.testing.assert_allclose(np.load(tmp_path / "txt.npy"), ref.text_embeds.numpy(), atol=1e-5)


def test_predict_zero_shot_sigmoid_equals_transformers(folder, tmp_path, capsys):
    image = str(png(tmp_path / "x.png", seed=3))
    labels = ["cat", "dog", "red car"]
    ref, _, _ = reference(folder, [image], [f"a photo of {x}" for x in labels])
    probs = torch.sigmoid(ref.logits_per_image)[0]  # SigLIP's probabilities: one sigmoid per label
    assert abs(float(probs.sum()) - 1) > 1e-3  # not a softmax
    assert main(["predict", str(folder), "--image", image, "--labels", ",".join(labels),
                 "--template", "a photo of {}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    got = {line.split(None, 1)[1]: float(line.split()[0]) for line in lines[1:]}
    assert set(got) == set(labels)
    for i, name in enumerate(labels):
        assert got[name] == pytest.approx(float(probs[i]), abs=1e-4)


def test_bad_input_is_one_line(folder, tmp_path, capsys):
    assert main(["predict", str(folder), "--image", "a photo of a cat", "--labels", "cat,dog"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv: error: ") and "a photo of a cat: no such image file" in err
    assert err.count("\n") == 1
    assert main(["predict", str(folder), "--image", str(png(tmp_path / "x.png")), "--labels", ""]) == 2
    err = capsys.readouterr().err
    assert "--labels is empty" in err and err.count("\n") == 1


def test_a_folder_without_the_pooling_head_is_refused(tmp_path):
    siglip_folder(tmp_path, vision_use_head=False)
    with pytest.raises(CheckpointError, match="vision_use_head is false"):
        qkv.from_pretrained(tmp_path)


def test_saved_qkv_checkpoint_keeps_sigmoid_scoring(folder, tmp_path):
    model = qkv.from_pretrained(folder)
    model.save_pretrained(tmp_path / "q")
    again = qkv.from_pretrained(tmp_path / "q")
    assert json.loads((tmp_path / "q" / "config.json").read_text())
    assert again.config.sigmoid and float(again.logit_bias.detach()) == pytest.approx(-3.0)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(again.encode_image(x), model.encode_image(x))


def test_finetune_image_classify_on_the_siglip_tower(folder, tmp_path, capsys):
    """A classifier on the SigLIP image tower reads its attention-pooled feature; it starts from the folder's
    pooling head and predicts with the class names."""
    data = tmp_path / "data"
    for c, name in enumerate(("blue", "red")):
        (data / name).mkdir(parents=True)
        for i in range(6):
            png(data / name / f"{i}.png", seed=100 * c + i, size=(20, 20))
    out = tmp_path / "out"
    assert main(["finetune", str(folder), "--task", "image-classify", "--data", str(data), "--out", str(out),
                 "--epochs", "1", "--lr", "1e-3", "--batch-size", "4", "--dev-fraction", "0.25",
                 "--no-progress"]) == 0
    model = qkv.from_pretrained(out)
    assert model.config.pooling == "map" and model.map_head is not None
    probe = transformers.SiglipModel.from_pretrained(folder).vision_model.head.probe.detach()
    assert (model.map_head.probe.detach() - probe).abs().max() < 0.5 * probe.abs().max()
    capsys.readouterr()
    assert main(["predict", str(out), str(data / "red" / "0.png"), "--top-k", "2"]) == 0
    names = {line.split()[-1] for line in capsys.readouterr().out.splitlines()[1:]}
    assert names == {"blue", "red"}
