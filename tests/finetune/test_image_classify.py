"""`qkv finetune --task image-classify`: tiny random-weight Hugging Face ViT, ResNet and Swin classifiers
learn a colour-separable image folder (dev accuracy well above chance after each epoch), the saved folder
gives the same logits in transformers (AutoModelForImageClassification) as in qkv, carries the folder's class
names and a preprocessor that `qkv predict` reads; a label set that differs gets a new head of the right size,
the same label set keeps the head; --freeze-backbone trains the head alone; bad input is one clear error,
exit 2, nothing written."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

import qkv  # noqa: E402
from qkv.cli.main import main  # noqa: E402
from qkv.finetune.image import ImageClassifyRecipe, ImageSettings  # noqa: E402
from qkv.interop.common import HFTensors  # noqa: E402

CLASSES = ("blue", "green", "red")  # sorted: the order a new head numbers them in


def _labels(names):
    return {"id2label": dict(enumerate(names)), "label2id": {n: i for i, n in enumerate(names)}}


def make_vit(folder, names=("a", "b"), size=16):
    cfg = transformers.ViTConfig(image_size=size, patch_size=4, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=64, **_labels(names))
    transformers.ViTForImageClassification(cfg).save_pretrained(folder)
    transformers.ViTImageProcessor(size={"height": size, "width": size}).save_pretrained(folder)


def make_resnet(folder, names=("a", "b"), size=16):
    cfg = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                    layer_type="basic", **_labels(names))
    transformers.ResNetForImageClassification(cfg).save_pretrained(folder)
    transformers.ConvNextImageProcessor(size={"shortest_edge": size}).save_pretrained(folder)


def make_swin(folder, names=("a", "b"), size=16):
    cfg = transformers.SwinConfig(image_size=size, patch_size=2, embed_dim=32, depths=[1, 1],
                                  num_heads=[2, 4], window_size=4, **_labels(names))
    transformers.SwinForImageClassification(cfg).save_pretrained(folder)
    transformers.ViTImageProcessor(size={"height": size, "width": size}).save_pretrained(folder)


MAKERS = {"vit": make_vit, "resnet": make_resnet, "swin": make_swin}


def make_images(root, per_class=12, classes=CLASSES, seed=0):
    """Noisy 20x20 images, one colour channel bright per class (trivially separable; mirror-safe)."""
    rng = np.random.default_rng(seed)
    for name in classes:
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            a = rng.integers(0, 90, (20, 20, 3))
            a[..., ("red", "green", "blue").index(name) % 3] += 140
            Image.fromarray(a.astype(np.uint8)).save(root / name / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return make_images(tmp_path_factory.mktemp("images") / "data")


def finetune(model, data, out, *flags):
    return main(["finetune", str(model), "--task", "image-classify", "--data", str(data), "--out", str(out),
                 "--no-progress", "--epochs", "3", "--batch-size", "8", "--lr", "2e-3", *flags])


@pytest.mark.parametrize("family", ["vit", "resnet", "swin"])
def test_finetune_learns_and_saves_a_folder_transformers_loads(tmp_path, images, capsys, family):
    torch.manual_seed(0)
    MAKERS[family](tmp_path / "model")
    out = tmp_path / "out"
    assert finetune(tmp_path / "model", images, out) == 0
    report = capsys.readouterr().out
    accs = [float(line.split("dev accuracy ")[1].split()[0]) for line in report.splitlines()
            if line.startswith("epoch ")]
    assert len(accs) == 3 and accs[-1] >= 0.8, report  # chance is 1/3
    result = json.loads((out / "finetune.json").read_text())
    assert result["head"] == "new" and result["labels"] == list(CLASSES)

    hf = transformers.AutoModelForImageClassification.from_pretrained(out).eval()
    assert hf.config.id2label == dict(enumerate(CLASSES))
    head = hf.classifier[1] if family == "resnet" else hf.classifier  # ResNet's: Flatten, Linear
    assert head.out_features == 3
    ours = qkv.from_pretrained(out).eval()
    x = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, hf(pixel_values=x).logits, rtol=1e-4, atol=1e-5)

    pre = json.loads((out / "preprocessor_config.json").read_text())
    assert pre["size"] == {"height": 16, "width": 16}
    assert main(["predict", str(out), str(images / "red" / "0.png"), "--top-k", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[-1] == "red"


def _recipe(model, data, out, **settings):
    return ImageClassifyRecipe(ImageSettings(model=str(model), data=str(data), out=out, progress=False,
                                             **settings))


def test_the_same_labels_keep_the_head_and_the_model_ids(tmp_path, images):
    order = ("red", "blue", "green")  # the model's own ids, not the sorted ones
    torch.manual_seed(0)
    make_vit(tmp_path / "model", order)
    r = _recipe(tmp_path / "model", images, tmp_path / "out", epochs=1)
    r.setup_model()
    task = r.setup_data()
    assert r.kept_head and task.classes == list(order)
    assert set(task.labels[:12].tolist()) == {order.index("blue")}  # the first folder's images (blue)
    r.train()
    assert r.model is r.src.model  # the loaded classifier, its head included, is what trains
    r.save()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["id2label"] == \
        {str(i): n for i, n in enumerate(order)}


def test_the_same_labels_start_from_the_old_head(tmp_path, images):
    torch.manual_seed(0)
    make_vit(tmp_path / "model", ("red", "blue", "green"))
    r = _recipe(tmp_path / "model", images, tmp_path / "out")
    r.setup_model()
    r.setup_data()
    ref = transformers.ViTForImageClassification.from_pretrained(tmp_path / "model")
    torch.testing.assert_close(r.src.model.classifier.weight, ref.classifier.weight, rtol=0, atol=0)


def test_a_new_label_set_gets_a_new_head_of_its_size(tmp_path, images):
    torch.manual_seed(0)
    make_vit(tmp_path / "model", ("red", "blue", "green", "black", "white"))
    r = _recipe(tmp_path / "model", images, tmp_path / "out")
    r.setup_model()
    r.setup_data()
    assert not r.kept_head
    from qkv.finetune.image import with_head

    model = with_head(r.src, len(r.id2label), seed=0)
    assert model.classifier.weight.shape == (3, 32)
    backbone = {k: v for k, v in r.src.model.state_dict().items() if not k.startswith("classifier.")}
    for k, v in backbone.items():
        assert torch.equal(model.state_dict()[k], v), k


def test_freeze_backbone_trains_the_head_alone(tmp_path, images):
    torch.manual_seed(0)
    make_resnet(tmp_path / "model")  # BatchNorm: its running statistics must stay too
    out = tmp_path / "out"
    assert finetune(tmp_path / "model", images, out, "--freeze-backbone") == 0
    before, after = HFTensors(tmp_path / "model"), HFTensors(out)
    for k in after.keys():
        if not k.startswith("classifier."):
            assert torch.equal(before[k], after[k]), k
    assert after["classifier.1.weight"].shape == (3, 32)


@pytest.mark.parametrize("case, message", [
    ("missing", "data folder not found"),
    ("a file", "is a file; --task image-classify reads a folder with one sub-folder of images per class"),
    ("one class", "needs at least two class sub-folders"),
    ("not an image", "not a readable image"),
    ("one image", "each class needs at least two"),
    ("dev", "--dev is not supported"),
])
def test_bad_input_is_one_clear_error(tmp_path, capsys, case, message):
    make_vit(tmp_path / "model")
    data = tmp_path / "data"
    flags = []
    if case == "a file":
        make_images(tmp_path / "images", per_class=2)
        data = tmp_path / "images" / "red" / "0.png"
    elif case == "one class":
        make_images(data, classes=("red",))
    elif case == "not an image":
        make_images(data, per_class=3)
        (data / "red" / "notes.png").write_text("not a picture")
    elif case == "one image":
        make_images(data, per_class=3)
        for f in sorted((data / "blue").iterdir())[1:]:
            f.unlink()
    elif case == "dev":
        make_images(data, per_class=3)
        flags = ["--dev", str(data)]
    out = tmp_path / "out"
    capsys.readouterr()  # transformers' progress bars while the folders were written
    assert finetune(tmp_path / "model", data, out, *flags) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qkv: error: ") and message in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_lr_and_batch_size_stay_refused_by_other_recipes(tmp_path, capsys):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (tmp_path / "d.csv").write_text("text,label\nx,1\n")
    rc = main(["finetune", str(tmp_path / "model"), "--data", str(tmp_path / "d.csv"), "--out",
               str(tmp_path / "o"), "--lr", "1e-3"])
    assert rc == 2 and "--lr is not supported by --task classify (it is a --task seq2seq flag)" in \
        capsys.readouterr().err


def _qkv_run(out, data, *model_flags):
    """A qkv image run (a grey 8x8 ViT trained briefly on `data`)."""
    assert main(["train", "--task", "image_folder", "--model", "vit-digits", "--out", str(out), "--max-steps",
                 "2", f"task.path={data}", "task.image_size=8", "task.channels=1", "train.batch_size=8",
                 "train.progress=false", "train.plot=false", *model_flags]) == 0


def test_a_qkv_image_run_is_fine_tuned_into_a_transformers_folder(tmp_path, images, capsys):
    _qkv_run(tmp_path / "run", images, "model.pooling=cls")
    out = tmp_path / "out"
    assert finetune(tmp_path / "run", images, out, "--epochs", "1") == 0
    result = json.loads((out / "finetune.json").read_text())
    assert result["head"] == "kept" and result["labels"] == list(CLASSES)  # the run's classes
    hf = transformers.AutoModelForImageClassification.from_pretrained(out).eval()
    assert hf.config.num_channels == 1 and hf.config.id2label == dict(enumerate(CLASSES))
    x = torch.randn(3, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(qkv.from_pretrained(out)(x).logits, hf(pixel_values=x).logits, rtol=1e-4,
                                   atol=1e-5)
    pre = json.loads((out / "preprocessor_config.json").read_text())
    assert len(pre["image_mean"]) == 1 and pre["size"] == {"height": 8, "width": 8}


def test_a_qkv_model_transformers_cannot_hold_is_refused_before_training(tmp_path, images, capsys):
    _qkv_run(tmp_path / "run", images)  # vit-digits pools by the mean: no transformers ViT does
    capsys.readouterr()
    assert finetune(tmp_path / "run", images, tmp_path / "out") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qkv: error: ") and "pooling='mean'" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", ["vit", "swin"])
def test_a_base_model_gets_a_classifier(tmp_path, images, family):
    """A ViTModel (with its tanh pooler) or SwinModel folder: a new head, written as *ForImageClassification
    (transformers' ViT classifier has no pooler: it is left out)."""
    torch.manual_seed(0)
    MAKERS[family](tmp_path / "clf")
    cls = transformers.ViTModel if family == "vit" else transformers.SwinModel
    cls.from_pretrained(tmp_path / "clf").save_pretrained(tmp_path / "base")
    (tmp_path / "base" / "preprocessor_config.json").write_text((tmp_path / "clf" /
                                                                 "preprocessor_config.json").read_text())
    out = tmp_path / "out"
    assert finetune(tmp_path / "base", images, out, "--epochs", "1") == 0
    hf = transformers.AutoModelForImageClassification.from_pretrained(out).eval()
    assert type(hf).__name__.endswith("ForImageClassification") and hf.config.num_labels == 3
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(qkv.from_pretrained(out)(x).logits, hf(pixel_values=x).logits, rtol=1e-4,
                                   atol=1e-5)


def test_resume_continues_and_reports_every_epoch(tmp_path, images, capsys):
    torch.manual_seed(0)
    make_vit(tmp_path / "model")
    out = tmp_path / "out"
    flags = ["--batch-size", "16"]  # 30 training images: 2 steps an epoch
    assert main(["finetune", str(tmp_path / "model"), "--task", "image-classify", "--data", str(images),
                 "--out", str(out), "--no-progress", "--epochs", "1", *flags]) == 0
    capsys.readouterr()
    assert main(["finetune", str(tmp_path / "model"), "--task", "image-classify", "--data", str(images),
                 "--out", str(out), "--no-progress", "--epochs", "2", "--resume", *flags]) == 0
    report = capsys.readouterr().out
    assert "epoch 1: dev accuracy" in report and "epoch 2: dev accuracy" in report, report
    result = json.loads((out / "finetune.json").read_text())
    assert result["steps"] == 4 and [e["step"] for e in result["epochs"]] == [2, 4]
