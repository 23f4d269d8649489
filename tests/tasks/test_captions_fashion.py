"""The captions task on Fashion-MNIST (dataset=fashion_mnist): captions against a table written here from
Fashion-MNIST's class list, each row's caption naming its own image (read back from the pixels of an IDX
folder the test writes), the zero-shot prompt never trained on, distinct classes per batch, the official test
split, evaluation scored with a stand-in model whose answers are known, clear errors, and `qkv train` +
`qkv eval` of configs/clip_fashion.yaml shrunk."""

import sys
from pathlib import Path

import pytest
import torch

from _clirun import run_cli
from qkv.config import ConfigError
from qkv.tasks import build_task, load_task
from qkv.tasks import captions as C
from qkv.tasks.images import FASHION_APT, FASHION_CLASSES, FASHION_DIR

sys.path.insert(0, str(Path(__file__).parent))
from _fashion_idx import fashion_folder, label_of  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "clip_fashion.yaml"
# Fashion-MNIST's ten classes (images.FASHION_CLASSES, the dataset's documented order) -> the caption's words
TABLE = {"T-shirt/top": "t-shirt", "Trouser": "trouser", "Pullover": "pullover", "Dress": "dress",
         "Coat": "coat", "Sandal": "sandal", "Shirt": "shirt", "Sneaker": "sneaker", "Bag": "bag",
         "Ankle boot": "ankle boot"}
N_TRAIN, N_TEST = 60, 30





def class_named(text: str) -> str:
    """The Fashion-MNIST class a caption names (the longest table word in it: "ankle boot" before "boot")."""
    hits = [c for c, w in TABLE.items() if f" {w} " in f" {text} "]
    assert len(hits) == 1, (text, hits)
    return hits[0]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return fashion_folder(tmp_path_factory.mktemp("fashion"))


@pytest.fixture(scope="module")
def task(folder):
    return build_task("captions", dataset="fashion_mnist", path=str(folder), max_shift=0, hflip=True)


def captions_of(task, batch) -> list[str]:
    return [task.tokenizer.decode(row[mask.bool()]) for row, mask in zip(batch["input_ids"],
                                                                          batch["attention_mask"])]


def test_each_caption_names_its_own_image_from_a_training_template(task):
    assert [TABLE[c] for c in FASHION_CLASSES] == list(task.words)
    for index in range(3):
        b = task.batch(index, 10)
        assert b["pixel_values"].shape == (10, 1, 28, 28) and b["pixel_values"].dtype == torch.float32
        for x, text in zip(b["pixel_values"], captions_of(task, b)):
            cls = class_named(text)
            assert text in [t.format(TABLE[cls]) for t in C.FASHION_TEMPLATES], text
            assert FASHION_CLASSES[label_of(task, x)] == cls, text
            assert text.split()[-1] != "<eos>"  # the <eos> is an id after the caption, not a word of it


def test_the_zero_shot_prompt_is_never_a_training_caption(task):
    assert C.FASHION_ZERO_SHOT not in C.FASHION_TEMPLATES
    prompts = {C.FASHION_ZERO_SHOT.format(w) for w in TABLE.values()}
    seen = {text for i in range(30) for text in captions_of(task, task.batch(i, 20))}
    assert len(seen) > 40 and not seen & prompts
    # every word of the prompt is in the vocabulary (trained in some other caption)
    assert all(w in task.tokenizer.stoi for p in prompts for w in p.split())


def test_batches_hold_distinct_classes(task):
    for i in range(5):
        assert sorted(class_named(t) for t in captions_of(task, task.batch(i, 10))) == sorted(TABLE)
    twenty = [class_named(t) for t in captions_of(task, task.batch(0, 20))]
    assert all(twenty.count(c) == 2 for c in TABLE)  # consecutive permutations of the ten classes
    loose = build_task("captions", dataset="fashion_mnist", path=task.options.path, distinct_digits=False)
    assert any(len(set(captions_of(loose, loose.batch(i, 10)))) < 10 for i in range(10))


def test_held_out_images_are_the_idx_test_split_and_batches_are_deterministic(task):
    assert task.train_idx.tolist() == list(range(N_TRAIN))
    assert task.test_idx.tolist() == list(range(N_TRAIN, N_TRAIN + N_TEST))
    val = task.batch(0, 10, "val")
    every = task.pixels(torch.arange(len(task.labels)))

    def found_in(x, idx):
        return bool((every[idx] == x).flatten(1).all(1).any())

    # validation images are test images as stored (no flip, no crop)
    assert all(found_in(x, task.test_idx) and not found_in(x, task.train_idx) for x in val["pixel_values"])
    a, b = task.batch(4, 8), task.batch(4, 8)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # hflip: a training image is a stored training image or its mirror, both seen
    kinds, train = [], task.train_idx
    for x in task.batch(0, 20)["pixel_values"]:
        kinds.append("stored" if found_in(x, train) else "mirror" if found_in(x.flip(-1), train) else "no")
    assert set(kinds) == {"stored", "mirror"}, kinds


class Oracle(torch.nn.Module):
    """A stand-in CLIP whose embeddings are one-hot classes: images read from brightness, texts from the
    class word they hold. Every zero-shot answer and every retrieval is right."""

    def __init__(self, task) -> None:
        super().__init__()
        self.task, self.w = task, torch.nn.Parameter(torch.zeros(1))

    def encode_image(self, pixels):
        return torch.eye(10)[[label_of(self.task, x) for x in pixels]]

    def encode_text(self, ids, mask):
        texts = [self.task.tokenizer.decode(r[m.bool()]) for r, m in zip(ids, mask)]
        return torch.eye(10)[[FASHION_CLASSES.index(class_named(t)) for t in texts]]


def test_evaluation_scores_a_model_that_knows_the_classes_perfectly(task):
    m = task.evaluate(Oracle(task), n=20)
    assert m == {"zero_shot_accuracy": 1.0, "recall@1_i2t": 1.0, "recall@1_t2i": 1.0, "n": 20.0}
    assert all(s.endswith("(ok)") for s in task.samples(Oracle(task), 4))


def test_recall_in_blocks_equals_recall_at_once():
    g = torch.Generator().manual_seed(0)
    img, txt = torch.randn(50, 8, generator=g), torch.randn(50, 8, generator=g)
    labels = torch.randint(0, 5, (50,), generator=g)
    sims = img @ txt.t()
    full = (float((labels[sims.argmax(1)] == labels).float().mean()),
            float((labels[sims.argmax(0)] == labels).float().mean()))
    assert C.recall_at_1(img, txt, labels, chunk=7) == full


def test_the_saved_tokenizer_rebuilds_the_same_task(task, tmp_path):
    task.save(tmp_path)
    again = load_task(tmp_path)
    assert again.options.dataset == "fashion_mnist" and again.tokenizer.itos == task.tokenizer.itos
    assert torch.equal(again.batch(2, 8)["input_ids"], task.batch(2, 8)["input_ids"])


@pytest.mark.parametrize("options, message", [
    ({"dataset": "cifar"}, "task.dataset: 'cifar' is not one of \\['digits', 'fashion_mnist'\\]"),
    ({"dataset": "fashion_mnist", "path": "/nonexistent/fashion"}, "no Fashion-MNIST data at /nonexistent"),
    ({"dataset": "fashion_mnist", "max_shift": -1}, "task.max_shift must be at least 0, got -1"),
    ({"hflip": True}, "task.dataset: path and hflip are for dataset fashion_mnist, not digits"),
])
def test_bad_options_are_one_clear_error(options, message):
    with pytest.raises(ConfigError, match=message):
        build_task("captions", **options)


def test_a_folder_without_the_idx_files_is_one_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="missing IDX file\\(s\\) train-images-idx3-ubyte"):
        build_task("captions", dataset="fashion_mnist", path=str(tmp_path))


def test_qkv_train_then_qkv_eval_on_the_shipped_config_shrunk(folder, tmp_path):
    out = tmp_path / "run"
    tiny = ["model.n_layers=1", "model.vision.n_layers=1", "model.d_model=32", "model.vision.d_model=32",
            "train.batch_size=10", "train.warmup=0", "train.log_every=1", "eval.n=20"]
    train = ["train", str(CONFIG), *tiny, f"task.path={folder}", "--max-steps", "3", "--out", str(out)]
    r = run_cli(*train)
    assert r.returncode == 0, r.stderr
    assert "held-out (20 examples): zero_shot_accuracy=" in r.stdout and "best prompt" in r.stdout
    r = run_cli("eval", str(out), "-n", "30")
    assert r.returncode == 0, r.stderr
    for key in ("zero_shot_accuracy", "recall@1_i2t", "recall@1_t2i"):
        assert key in r.stdout, r.stdout


@pytest.mark.skipif(not Path(FASHION_DIR).is_dir(), reason=f"Fashion-MNIST is not installed ({FASHION_APT})")
def test_on_debians_fashion_mnist_the_held_out_images_are_the_10000_test_images():
    t = build_task("captions", dataset="fashion_mnist")
    assert len(t.train_idx) == 60_000 and t.test_idx.tolist() == list(range(60_000, 70_000))
    assert t.batch(0, 64)["pixel_values"].shape == (64, 1, 28, 28)
