"""The image tasks: the IDX reader on files written here, fashion_mnist on a tiny IDX folder (and on Debian's
dataset-fashion-mnist when installed), image_folder on PNG/JPEG files written here, and the augmentation."""

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from qkv.config import ConfigError
from qkv.tasks import build_task
from qkv.tasks import images as img
from qkv.tasks.digits import shift_images


def write_idx(path: Path, array: np.ndarray, gz: bool = False) -> Path:
    """The IDX layout, independently of the reader: magic (0, 0, type, ndim), big-endian dims, big-endian
    data."""
    code = {np.dtype(np.uint8): 0x08, np.dtype(">i4"): 0x0C, np.dtype(">f4"): 0x0D}[array.dtype]
    raw = (struct.pack(">BBBB", 0, 0, code, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
           + array.tobytes())
    path.write_bytes(gzip.compress(raw) if gz else raw)
    return path


def mnist_folder(root: Path, n_train: int = 40, n_test: int = 20, classes: int = 10, gz: bool = True) -> Path:
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    suffix = ".gz" if gz else ""
    for split, n in (("train", n_train), ("t10k", n_test)):
        labels = (np.arange(n) % classes).astype(np.uint8)
        # each class its own brightness: a model can tell them apart
        images = (rng.integers(0, 60, (n, 28, 28)) + 19 * labels[:, None, None]).astype(np.uint8)
        write_idx(root / f"{split}-images-idx3-ubyte{suffix}", images, gz)
        write_idx(root / f"{split}-labels-idx1-ubyte{suffix}", labels, gz)
    return root


@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_reads_what_the_format_says(tmp_path, gz):
    a = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    got = img.read_idx(write_idx(tmp_path / ("a.gz" if gz else "a"), a, gz))
    assert got.shape == (2, 3, 4) and np.array_equal(got, a)
    b = np.array([1, -2, 70000], dtype=">i4")
    assert img.read_idx(write_idx(tmp_path / "b", b)).tolist() == [1, -2, 70000]
    f = np.array([[0.5, -1.25]], dtype=">f4")
    assert img.read_idx(write_idx(tmp_path / "f", f)).tolist() == [[0.5, -1.25]]


def test_read_idx_refuses_other_and_cut_files(tmp_path):
    (tmp_path / "png").write_bytes(b"\x89PNG\r\n\x1a\n....")
    with pytest.raises(ConfigError, match="not an IDX file"):
        img.read_idx(tmp_path / "png")
    p = write_idx(tmp_path / "cut", np.zeros((3, 4), np.uint8))
    p.write_bytes(p.read_bytes()[:-1])
    with pytest.raises(ConfigError, match="truncated"):
        img.read_idx(p)
    (tmp_path / "x.gz").write_bytes(b"not gzip")
    with pytest.raises(ConfigError, match="gzip"):
        img.read_idx(tmp_path / "x.gz")


def test_fashion_mnist_task_on_any_idx_folder(tmp_path):
    folder = mnist_folder(tmp_path / "mnist", gz=False)
    task = build_task("fashion_mnist", family="resnet", path=str(folder), hflip=False)
    assert task.classes == [str(i) for i in range(10)]  # not the Fashion-MNIST names: another folder
    assert len(task.train_idx) == 40 and len(task.val_idx) == 20
    b = task.batch(3, 8)
    assert b["pixel_values"].shape == (8, 1, 28, 28) and b["pixel_values"].dtype == torch.float32
    torch.testing.assert_close(task.batch(3, 8)["pixel_values"], b["pixel_values"], rtol=0, atol=0)
    # an epoch of training batches is a permutation of the training images; "val" is the test file
    seen = torch.cat([task.batch(i, 8)["labels"] for i in range(5)])
    assert sorted(seen.tolist()) == sorted((np.arange(40) % 10).tolist())
    v = task.batch(0, 20, "val")
    assert torch.equal(v["pixel_values"],
                       task.normalize(task.images[40:60])[task.batch_positions(0, 20, "val")])
    assert task.model_overrides() == {"image_size": 28, "n_channels": 1, "num_labels": 10}
    m = task.build_model("resnet-8-cifar")
    assert m.config.n_channels == 1 and m.config.num_labels == 10
    got = task.evaluate(m)
    assert got["n"] == 20 and 0 <= got["accuracy"] <= 1
    assert len(task.samples(m, 2)) == 2


def test_missing_data_is_one_clear_error(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="no Fashion-MNIST data at"):
        build_task("fashion_mnist", path=str(tmp_path / "nowhere"))
    monkeypatch.setattr(img, "FASHION_DIR", str(tmp_path / "nowhere"))  # the package's folder, not installed
    with pytest.raises(ConfigError, match="apt-get install dataset-fashion-mnist"):
        img.build_fashion_mnist(img.FashionMNISTOptions(path=str(tmp_path / "nowhere")), "resnet")
    folder = mnist_folder(tmp_path / "partial")
    (folder / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(ConfigError, match="missing IDX file.*t10k-labels-idx1-ubyte"):
        build_task("fashion_mnist", path=str(folder))


@pytest.mark.skipif(not Path(img.FASHION_DIR).is_dir(),
                    reason=f"Fashion-MNIST is not installed ({img.FASHION_APT})")
def test_debians_fashion_mnist():
    task = build_task("fashion_mnist")
    assert task.classes[0] == "T-shirt/top" and task.classes[9] == "Ankle boot"
    assert len(task.train_idx) == 60_000 and len(task.val_idx) == 10_000
    assert torch.bincount(task.labels[task.val_idx]).tolist() == [1000] * 10
    # the known statistics
    assert abs(float(task.mean) - 0.2860) < 1e-3 and abs(float(task.std) - 0.3530) < 1e-3


def test_augment_is_a_padded_crop_and_a_flip():
    x = torch.arange(2 * 1 * 5 * 5, dtype=torch.float32).reshape(2, 1, 5, 5) + 1
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        out = img.augment(x, 2, False, g)
        for b in range(2):  # some shift by (dy, dx) in [-2, 2] with zero fill
            assert any(torch.equal(out[b:b + 1],
                                   shift_images(x[b:b + 1], torch.tensor([dy]), torch.tensor([dx])))
                       for dy in range(-2, 3) for dx in range(-2, 3))
        flipped = img.augment(x, 0, True, g)
        assert all(torch.equal(flipped[b], x[b]) or torch.equal(flipped[b], x[b].flip(-1)) for b in range(2))


def _write_images(root: Path, sizes: dict[str, list[tuple[int, int]]], fmt: str = "png") -> Path:
    from PIL import Image

    rng = np.random.default_rng(1)
    for ci, (name, shapes) in enumerate(sizes.items()):
        (root / name).mkdir(parents=True)
        for i, (w, h) in enumerate(shapes):
            a = (rng.integers(0, 40, (h, w, 3)) + 100 * ci).astype(np.uint8)
            Image.fromarray(a).save(root / name / f"{i}.{fmt}")
    return root


def test_image_folder_task(tmp_path):
    root = _write_images(tmp_path / "pets", {"cat": [(40, 30)] * 10, "dog": [(20, 20)] * 10,
                                             "owl": [(64, 48)] * 10})
    (root / "owl" / "notes.txt").write_text("not an image: skipped by its suffix")
    task = build_task("image_folder", path=str(root), image_size=16, dev_fraction=0.2, split_seed=3)
    assert task.family == "resnet" and task.classes == ["cat", "dog", "owl"]
    assert task.images.shape == (30, 3, 16, 16) and len(task.val_idx) == 6
    assert torch.bincount(task.labels[task.val_idx]).tolist() == [2, 2, 2]  # stratified
    again = build_task("image_folder", path=str(root), image_size=16, dev_fraction=0.2, split_seed=3)
    assert torch.equal(again.val_idx, task.val_idx)  # a fixed split
    other = build_task("image_folder", path=str(root), image_size=16, dev_fraction=0.2, split_seed=4)
    assert not torch.equal(other.val_idx, task.val_idx)
    grey = build_task("image_folder", path=str(root), image_size=12, channels=1, family="vit")
    assert grey.batch(0, 4)["pixel_values"].shape == (4, 1, 12, 12)


def test_image_folder_errors(tmp_path):
    with pytest.raises(ConfigError, match="task.path is required"):
        build_task("image_folder")
    root = _write_images(tmp_path / "one", {"cat": [(8, 8)] * 2})
    with pytest.raises(ConfigError, match="at least two class"):
        build_task("image_folder", path=str(root))
    root = _write_images(tmp_path / "bad", {"a": [(8, 8)] * 2, "b": [(8, 8)] * 2})
    (root / "b" / "9.png").write_bytes(b"garbage")
    with pytest.raises(ConfigError, match="9.png: not a readable image"):
        build_task("image_folder", path=str(root))
