"""`qkv finetune MODEL --task image-classify --data FOLDER`: fine-tune a pretrained image classifier (a
Hugging Face ViT, ResNet or Swin folder, or a qkv image run), or a CLIP folder's image tower under a new head
(clip_source), on a folder with one sub-folder of images per class.

    qkv finetune vit-folder --task image-classify --data photos/ --out clf [--epochs 3] [--lr 1e-4]
        [--batch-size 32] [--freeze-backbone] [--dev-fraction 0.1] [--split-seed 0] [train.key=value ...]

The images are read by the image_folder task (Pillow; converted to the model's channels and resized to its
image size; normalised with the model's mean and std from preprocessor_config.json, or, without one, with
the training images' own), and a fixed class-stratified share (--dev-fraction, by --split-seed) is held out
as the dev set. The classifier keeps its head when the folder's class names are the model's labels (each
image then keeps the class id the model gives it) and gets a new, freshly initialised head of the right
size otherwise. Training (qkv.train.Trainer: AdamW, warmup then linear decay, clipping, light augmentation,
a checkpoint each epoch, --resume) updates every weight, or the head alone with --freeze-backbone. Dev
accuracy is measured after each epoch; the best epoch's weights are written to OUT as a Hugging Face folder
(by its model type's exporter: qkv.interop.vit / resnet / swin) that `qkv predict`, qkv.from_pretrained and
transformers' AutoModelForImageClassification load.
"""

from __future__ import annotations

import json
import types
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from qkv.config import ConfigError, setting
from qkv.finetune.encoders import FINETUNE_DEFAULTS, best_state
from qkv.finetune.out import FINETUNE_FILE, mark_out
from qkv.finetune.recipe import FinetuneRecipe, epoch_config
from qkv.finetune.registry import Recipe, register_recipe
from qkv.finetune.settings import FinetuneSettings
from qkv.interop.classifier import preprocessor_config
from qkv.interop.export import check_model, writable_types, write_model
from qkv.interop.llava import ImageProcessor
from qkv.interop.registry import ExportRequest
from qkv.models.clip import CLIP
from qkv.predict import preprocessing_for
from qkv.run import load_model_any, model_folder
from qkv.storage import atomic_write_json
from qkv.tasks.images import ImageFolderOptions, build_image_folder
from qkv.train import Trainer
from qkv.train.callbacks import Callback

# fine-tuning a pretrained vision model: a higher rate than BERT's 3e-5 (the ViT paper's fine-tuning
# sweeps 1e-3 .. 3e-2 with SGD; with AdamW 1e-4 is the common choice), larger batches of small inputs
DEFAULT_LR, DEFAULT_BATCH = 1e-4, 32


@dataclass(kw_only=True)
class ImageSettings(FinetuneSettings):
    """--lr and --batch-size are seq2seq's flags too: defined once, in its group (Recipe.reads)."""

    RECIPE = "image-classify"

    lr: float = setting(DEFAULT_LR, "peak learning rate (the same as train.lr: give one)")
    batch_size: int = setting(DEFAULT_BATCH, "images per batch (the same as train.batch_size: give one)")
    freeze_backbone: bool = setting(False, "train the classification head only (every other weight, "
                                           "BatchNorm statistics included, kept)")
    dev_fraction: float = setting(0.1, "share of each class held out as the dev set")
    split_seed: int = setting(0, "seed of the fixed train/dev split")
    augment: bool = setting(True, "random shifts and flips of the training images (--no-augment for digits, "
                                  "text: their mirror images are other classes)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dev is not None:
            raise ConfigError("--task image-classify holds out --dev-fraction of each class of --data as its "
                              "dev set; --dev is not supported")


@dataclass
class ImageSource:
    """The model folder being fine-tuned and how its images are prepared."""

    path: Path
    model: Any  # qkv ViT / ResNet / Swin as loaded
    family: str  # vit | resnet | swin
    labels: list[str]  # the model's class names, by id
    image_size: int
    mean: list[float] | None  # its normalisation (None: the training images' own statistics)
    std: list[float] | None
    clip: bool = False  # a CLIP folder's image tower (written as a qkv model folder: see clip_source)

    @property
    def channels(self) -> int:
        return int(self.model.config.n_channels)

    @property
    def has_head(self) -> bool:
        return getattr(self.model, "classifier", None) is not None


def family_of(model: Any) -> str:
    """vit, resnet or swin: the model's family, the model_type OUT is written as."""
    family = getattr(type(model), "family", None)
    if family not in writable_types(kind="image"):
        raise ConfigError(f"--task image-classify fine-tunes ViT, ResNet and Swin classifiers, not "
                          f"{type(model).__name__}")
    return family


def _image_size(model: Any, pre: Any) -> int:
    """The side of the square images the model takes: ViT's and Swin's own (their positions / windows are
    sized for it); a ResNet takes any size, so its preprocessor's (the crop, else the resized edge)."""
    if family_of(model) != "resnet":
        return int(model.config.image_size)
    if pre.crop is not None or pre.size is not None:
        h, w = pre.crop or pre.size
        if h != w:
            raise ConfigError(f"the model's preprocessor makes {w}x{h} images; this recipe trains on squares")
        return int(h)
    return int(pre.shortest_edge or model.config.image_size)


def open_image_model(path: str | Path) -> ImageSource:
    """A Hugging Face vit / resnet / swin folder or a qkv image run (its newest checkpoint), with its
    preprocessing and class names (read as `qkv predict` reads them)."""
    model = load_model_any(path)
    if isinstance(model, CLIP):
        return clip_source(Path(path), model)
    if getattr(model, "kind", None) != "image":
        raise ConfigError(f"{path}: --task image-classify needs an image model (ViT, ResNet, Swin), not "
                          f"{type(model).__name__}")
    family = family_of(model)
    pre, labels = preprocessing_for(path, model)
    check_model(model, ExportRequest(family, model_folder(path)))  # refused now, not after the training
    return ImageSource(Path(path), model.float(), family, labels, _image_size(model, pre), pre.mean, pre.std)


def clip_source(path: Path, model: CLIP) -> ImageSource:
    """A CLIP folder's image tower (a ViT without a head) as the backbone of a new classifier that reads the
    tower's pooled feature (the normed class token, the feature CLIP's linear probes read), with the folder's
    normalisation. transformers' CLIPForImageClassification reads the mean of the un-normed patch outputs
    instead, so the classifier is written as a qkv model folder (qkv predict and qkv.from_pretrained load it),
    not as a transformers folder."""
    tower = model.visual.float()
    pre = (ImageProcessor.from_folder(path) if (path / "preprocessor_config.json").is_file()
           else ImageProcessor())
    mean = list(pre.mean) if pre.mean is not None else None
    std = list(pre.std) if pre.std is not None else None
    return ImageSource(path, tower, "vit", [], int(tower.config.image_size), mean, std, clip=True)


def load_images(s: Any, src: ImageSource) -> Any:
    """The image_folder task over --data at the model's size and channels, normalised as the model is."""
    if not 0.0 < s.dev_fraction < 1.0:
        raise ConfigError(f"--dev-fraction must be between 0 and 1, got {s.dev_fraction:g}")
    augment = s.augment
    opts = ImageFolderOptions(path=str(s.data), image_size=src.image_size, channels=src.channels,
                              dev_fraction=s.dev_fraction, split_seed=s.split_seed, seed=s.seed,
                              pad=max(1, src.image_size // 8) if augment else 0, hflip=augment)
    opts.validate()
    task = build_image_folder(opts, src.family)
    counts = torch.bincount(task.labels[task.train_idx], minlength=len(task.classes))
    if int(counts.min()) == 0:
        name = task.classes[int(counts.argmin())]
        raise ConfigError(f"{s.data}/{name}: too few images to hold some out and train on the rest; each "
                          "class needs at least two")
    if src.mean is not None:
        c = src.channels
        task.mean = torch.tensor(src.mean[:c]).view(1, -1, 1, 1)
        task.std = torch.tensor(src.std[:c]).view(1, -1, 1, 1)
    return task


def keep_head_order(task: Any, src: ImageSource) -> bool:
    """When the folder's classes are the model's labels (as a set), renumber the images by the model's ids
    and say so: the head is kept. Otherwise the task keeps its sorted class order for a new head."""
    same = sorted(task.classes) == sorted(src.labels) and len(set(src.labels)) == len(src.labels)
    if not (src.has_head and same):
        return False
    to_model = torch.tensor([src.labels.index(c) for c in task.classes])
    task.labels = to_model[task.labels]
    task.classes = list(src.labels)
    return True


def with_head(src: ImageSource, n_labels: int, seed: int) -> Any:
    """The source's backbone under a new classifier of n_labels outputs (seeded: the same start in every
    run). transformers' classifiers read the features directly: a ViTModel's pooler is left out."""
    extra = {"pooler": False} if src.family == "vit" else {}
    cfg = replace(src.model.config, head="classify", num_labels=n_labels, **extra)
    torch.manual_seed(seed)
    model = type(src.model)(cfg)
    own = model.state_dict()
    kept = {k: v for k, v in src.model.state_dict().items()
            if k in own and own[k].shape == v.shape and not k.startswith(("classifier.", "pooler."))}
    missing = [k for k in own if k not in kept and not k.startswith("classifier.")]
    if missing:  # an architecture the copy above does not cover: fail here, not with a half-random backbone
        raise ConfigError(f"{src.path}: cannot carry the weights {missing[:3]} over to the new head's model")
    model.load_state_dict(kept, strict=False)
    return model


def freeze_backbone(model: Any) -> None:
    """Train the classifier alone: every other parameter frozen, and every BatchNorm left in eval mode
    (the Trainer's model.train() would otherwise renormalise by each batch and move the running statistics,
    which are the backbone's as much as its weights)."""
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("classifier."))
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.eval()
            m.train = types.MethodType(lambda self, mode=True: self, m)  # stays in eval mode


def earlier_epochs(out: Path) -> list[tuple[int, float]]:
    """(step, dev accuracy) of the epochs OUT/finetune.json records (none for a run that never finished)."""
    try:
        rows = json.loads((out / FINETUNE_FILE).read_text(encoding="utf-8")).get("epochs") or []
        return [(int(r["step"]), float(r["dev_accuracy"])) for r in rows]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return []


class ImageClassifyRecipe(FinetuneRecipe):
    """The phases (qkv.finetune.recipe): setup_model, setup_data, train, save, report."""

    name = "image-classify"
    settings = ImageSettings

    def __init__(self, settings: ImageSettings) -> None:
        super().__init__(settings)
        self.epochs: list[tuple[int, float]] = []  # (step, dev accuracy) after each epoch
        self.result: dict[str, Any] = {}

    def setup_model(self) -> ImageSource:
        self.src = open_image_model(self.s.model)
        return self.src

    def setup_data(self) -> Any:
        self.task = load_images(self.s, self.src)
        self.kept_head = keep_head_order(self.task, self.src)
        self.id2label = dict(enumerate(self.task.classes))
        return self.task

    def evaluate(self, model: Any) -> dict[str, float]:
        metrics = self.task.evaluate(model)
        return {"accuracy": metrics["accuracy"]}

    def train(self) -> dict[str, Any]:
        recipe = self

        class EpochLog(Callback):
            def on_eval(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
                if not recipe.epochs or recipe.epochs[-1][0] != step:  # the final evaluation may repeat one
                    recipe.epochs.append((step, float(metrics["accuracy"])))

        self.model = self.src.model if self.kept_head else \
            with_head(self.src, len(self.id2label), self.s.seed)
        if self.s.freeze_backbone:
            freeze_backbone(self.model)
        defaults = {**FINETUNE_DEFAULTS, "lr": self.s.lr, "batch_size": self.s.batch_size}
        cfg = epoch_config(self.s, defaults, len(self.task.train_idx), True)
        if self.s.resume:  # the epochs before the resumed checkpoint, as the earlier run recorded them
            self.epochs = earlier_epochs(self.s.out)
        mark_out(self.s.out, self.name)  # the data are read and checked: the run starts
        self.per_epoch = cfg.eval_every
        trainer = Trainer(self.model, cfg, self.task, eval_fn=self.evaluate, callbacks=[EpochLog()])
        self.summary = trainer.fit()
        return self.summary

    def save(self) -> dict[str, Any]:
        """OUT with the best epoch's weights, preprocessor_config.json and finetune.json."""
        best = best_state(self.s.out) if self.summary.get("best_eval") else None
        if best is not None:
            self.model.load_state_dict(best)
        self.model.cpu().eval()
        mean, std = self.task.mean.flatten().tolist(), self.task.std.flatten().tolist()
        preprocessor = preprocessor_config(self.src.image_size, mean, std)
        if self.src.clip:
            self.model.save_pretrained(self.s.out)
            atomic_write_json(preprocessor, self.s.out / "preprocessor_config.json")
        else:
            request = ExportRequest(self.src.family, model_folder(self.src.path), self.id2label, preprocessor)
            write_model(self.model, self.s.out, request)
        self.result = {"recipe": self.name, "family": self.src.family, "labels": list(self.task.classes),
                       "head": "kept" if self.kept_head else "new",
                       "frozen_backbone": self.s.freeze_backbone,
                       "train_images": len(self.task.train_idx), "dev_images": len(self.task.val_idx),
                       "steps": self.summary["steps"], "best": self.summary.get("best_eval"),
                       "epochs": [{"epoch": round(step / self.per_epoch, 2), "step": step,
                                   "dev_accuracy": acc} for step, acc in self.epochs],
                       "dev": self.evaluate(self.model), "out": str(self.s.out)}
        atomic_write_json(self.result, self.s.out / FINETUNE_FILE)
        return self.result

    def report(self) -> list[str]:
        r, n = self.result, len(self.task.classes)
        what = "the head" if self.s.freeze_backbone else "every weight"
        lines = [f"fine-tuned {what} of a {self.src.family} for {r['steps']} steps on {r['train_images']} "
                 f"images ({n} classes: {', '.join(r['labels'][:10])}; {r['head']} head)"]
        lines += [f"epoch {e['epoch']:g}: dev accuracy {e['dev_accuracy']:.4f} ({r['dev_images']} images)"
                  for e in r["epochs"]]
        which = f"best epoch, step {r['best']['step']}" if r.get("best") else "final model"
        loaders = ("qkv predict; qkv.from_pretrained" if self.src.clip else
                   "transformers: AutoModelForImageClassification.from_pretrained; qkv predict; "
                   "qkv.from_pretrained")
        lines.append(f"saved {self.s.out} ({which}: dev accuracy {r['dev']['accuracy']:.4f}; {loaders})")
        return lines


register_recipe(Recipe("image-classify", ("image", "dual"), "image classifiers (ViT, ResNet, Swin; a CLIP "
                       "image tower) on a folder with "
                       f"one sub-folder of images per class; reads --lr (default {DEFAULT_LR:g}) and "
                       f"--batch-size (default {DEFAULT_BATCH}) too", ImageClassifyRecipe,
                       data_folder=True, reads=("lr", "batch_size")))
