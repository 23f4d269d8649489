"""Hugging Face `clip` folders: a tiny random-weight transformers CLIPModel loads into qkv's CLIP with the
same image embeddings, text embeddings and logits (both end-of-text rules); `qkv embed --image / --text`
writes those embeddings, `qkv predict --labels` gives transformers' zero-shot probabilities, `qkv finetune
--task image-classify` trains a classifier on the CLIP image tower; bad input is one clear line, exit 2."""

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

WORDS = ["<pad>", "<unk>", "<bos>", "<eos>", "a", "photo", "of", "cat", "dog", "red", "blue", "car", "the"]
BOS, EOS = 2, 3


def save_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A <eos>",
                                                       special_tokens=[("<bos>", BOS), ("<eos>", EOS)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(folder)


def hf_clip(eos=EOS, seed=0, vocab=None):
    cfg = transformers.CLIPConfig(
        text_config=dict(vocab_size=vocab or len(WORDS), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=8, eos_token_id=eos, bos_token_id=BOS,
                         pad_token_id=0),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8),
        projection_dim=24)
    torch.manual_seed(seed)
    model = transformers.CLIPModel(cfg).eval()
    with torch.no_grad():  # HF's init leaves norms at 1/0 and biases at 0: make every weight matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or "embedding" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def clip_folder(folder, **kwargs):
    model = hf_clip(**kwargs)
    model.save_pretrained(folder)
    save_tokenizer(folder)
    transformers.CLIPImageProcessor(size={"shortest_edge": 32},
                                    crop_size={"height": 32, "width": 32}).save_pretrained(folder)
    return model


def png(path, seed=0, size=(45, 70), colour=None):
    rng = np.random.default_rng(seed)
    px = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
    if colour is not None:  # one bright channel: a class a tiny model learns at once
        px[..., colour] = np.maximum(px[..., colour], 200)
    Image.fromarray(px).save(path)
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("clip")
    clip_folder(d)
    return d


def reference(folder, images, texts):
    model = transformers.CLIPModel.from_pretrained(folder).eval()
    proc = transformers.CLIPImageProcessor.from_pretrained(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    pixels = proc([Image.open(f) for f in images], return_tensors="pt")["pixel_values"]
    enc = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(pixel_values=pixels, input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])


def test_from_pretrained_equal_embeddings_and_logits(folder, tmp_path):
    images = [str(png(tmp_path / f"{i}.png", seed=i)) for i in range(3)]
    texts = ["a photo of a cat", "dog", "the red car of a dog"]  # different lengths: padding + eos position
    ref = reference(folder, images, texts)
    clip = open_clip(folder)
    assert isinstance(clip.model, CLIP) and isinstance(qkv.from_pretrained(folder), CLIP)
    proc = transformers.CLIPImageProcessor.from_pretrained(folder)
    pixels = read_images(clip, images)
    ref_pixels = proc([Image.open(f) for f in images], return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(pixels, ref_pixels)
    ids, mask = tokenize(clip, texts)
    with torch.no_grad():
        img, txt = clip.model.encode_image(pixels), clip.model.encode_text(ids, mask)
        logits = clip.model.zero_shot_logits(pixels, ids, mask)
    torch.testing.assert_close(img, ref.image_embeds, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(txt, ref.text_embeds, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, ref.logits_per_image, atol=1e-4, rtol=1e-4)


def test_legacy_eos_2_pools_at_the_largest_id(tmp_path):
    """Folders whose eos_token_id is 2 pool at the largest id (transformers keeps that rule for them)."""
    hf = clip_folder(tmp_path, eos=2, vocab=20)
    ids = torch.tensor([[2, 4, 19, 5, 0], [2, 7, 8, 19, 6]])  # 19: the "end" by the argmax rule, mid-text
    mask = torch.ones_like(ids)
    ours = qkv.from_pretrained(tmp_path)
    assert ours.config.text_pool == "argmax"
    with torch.no_grad():
        ref = hf.get_text_features(input_ids=ids, attention_mask=mask)
        ref = ref.pooler_output if hasattr(ref, "pooler_output") else ref
        torch.testing.assert_close(ours.encode_text(ids, mask), torch.nn.functional.normalize(ref, dim=-1),
                                   atol=1e-5, rtol=1e-5)


def test_embed_cli_images_and_texts(folder, tmp_path, capsys):
    images = [str(png(tmp_path / f"{i}.png", seed=10 + i)) for i in range(2)]
    texts = ["a cat", "a blue car"]
    ref = reference(folder, images, texts)
    assert main(["embed", str(folder), "--image", *images, "--out", str(tmp_path / "img.npy"),
                 "--query", "a cat"]) == 0
    out = capsys.readouterr().out
    assert "2 x 24 float32" in out and "line 1:" in out
    np.testing.assert_allclose(np.load(tmp_path / "img.npy"), ref.image_embeds.numpy(), atol=1e-5)
    assert main(["embed", str(folder), "--text", *texts, "--out", str(tmp_path / "txt.npy")]) == 0
    np.testing.assert_allclose(np.load(tmp_path / "txt.npy"), ref.text_embeds.numpy(), atol=1e-5)


def test_predict_zero_shot_equals_transformers(folder, tmp_path, capsys):
    image = str(png(tmp_path / "x.png", seed=3))
    labels = ["cat", "dog", "red car"]
    ref = reference(folder, [image], [f"a photo of {x}" for x in labels]).logits_per_image.softmax(-1)[0]
    assert main(["predict", str(folder), "--image", image, "--labels", ",".join(labels),
                 "--template", "a photo of {}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    got = {line.split(None, 1)[1]: float(line.split()[0]) for line in lines[1:]}
    assert set(got) == set(labels)
    for i, name in enumerate(labels):
        assert got[name] == pytest.approx(float(ref[i]), abs=1e-4)


@pytest.mark.parametrize("args, message", [
    (["--labels", ""], "--labels is empty"),
    (["--labels", "cat"], "names one class"),
    (["--labels", "cat,,dog"], "empty class"),
    (["--labels", "cat,cat"], "names a class twice"),
])
def test_predict_bad_labels(folder, tmp_path, capsys, args, message):
    image = str(png(tmp_path / "x.png"))
    assert main(["predict", str(folder), "--image", image, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv: error: ") and message in err and err.count("\n") == 1


def test_text_where_an_image_is_due(folder, tmp_path, capsys):
    assert main(["predict", str(folder), "--image", "a photo of a cat", "--labels", "cat,dog"]) == 2
    assert "a photo of a cat: no such image file" in capsys.readouterr().err
    note = tmp_path / "note.txt"
    note.write_text("a photo of a cat\n")
    assert main(["embed", str(folder), "--image", str(note), "--out", str(tmp_path / "e.npy")]) == 2
    err = capsys.readouterr().err
    assert "not a readable image" in err and err.count("\n") == 1
    assert not (tmp_path / "e.npy").exists()


def test_labels_need_a_clip_folder(tmp_path, capsys):
    d = tmp_path / "vit"
    transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=64)).save_pretrained(d)
    image = str(png(tmp_path / "x.png"))
    assert main(["predict", str(d), image, "--labels", "cat,dog"]) == 2
    assert "--labels needs a CLIP folder" in capsys.readouterr().err


def test_finetune_image_classify_on_the_clip_tower(folder, tmp_path, capsys):
    data = tmp_path / "data"
    for c, name in enumerate(("blue", "green", "red")):
        (data / name).mkdir(parents=True)
        for i in range(8):
            png(data / name / f"{i}.png", seed=100 * c + i, size=(20, 20), colour=2 - c)
    out = tmp_path / "out"
    assert main(["finetune", str(folder), "--task", "image-classify", "--data", str(data), "--out", str(out),
                 "--epochs", "2", "--lr", "3e-3", "--batch-size", "8", "--dev-fraction", "0.25",
                 "--no-progress"]) == 0
    result = json.loads((out / "finetune.json").read_text())
    assert result["labels"] == ["blue", "green", "red"] and result["head"] == "new"
    model = qkv.from_pretrained(out)
    # the backbone started from the CLIP tower: its patch projection moved little from the folder's
    hf = transformers.CLIPModel.from_pretrained(folder)
    start = hf.vision_model.embeddings.patch_embedding.weight
    assert model.patch_emb.proj.bias is None
    assert (model.patch_emb.proj.weight - start).abs().max() < 0.5 * start.abs().max()
    capsys.readouterr()
    assert main(["predict", str(out), str(data / "red" / "0.png"), "--top-k", "3"]) == 0
    names = {line.split()[-1] for line in capsys.readouterr().out.splitlines()[1:]}
    assert names == {"blue", "green", "red"}
