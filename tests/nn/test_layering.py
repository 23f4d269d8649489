"""The layering rule of docs/architecture.md, checked on the source: every `import` of every module, at module
level, inside functions and under `if TYPE_CHECKING:`, goes to a lower layer (or stays in its own package).
The only exceptions are listed in ALLOWED below, each with the reason it is there."""

from __future__ import annotations

import ast
from pathlib import Path

import qkv

SRC = Path(qkv.__file__).parent

# Lowest first. A module may import from a strictly lower layer or from its own package; two packages on one
# line share a layer and may not import each other.
LAYERS: list[tuple[str, ...]] = [
    ("qkv.nn",),  # building blocks: know no model family, no training, no task
    ("qkv.config",),  # strict dataclass configs (validates the names nn/ defines)
    ("qkv.image_io",),  # the one reader of untrusted images (limits checked before decoding)
    ("qkv.extras",),  # optional packages: one clear error naming the extra to install
    ("qkv.storage",),  # files: CheckpointError, atomic writes, the one state-dict fit check, model folders
    ("qkv.models",),  # families, registry, kinds, the decoder protocol
    ("qkv.memory",),  # a model's KV-cache bytes and training-step memory, from its config (qkv info)
    ("qkv.generate",),  # decoding over the decoder protocol, GenerationConfig, processors, Engine
    ("qkv.interop",),  # Hugging Face folders -> models
    ("qkv.folder_sizes",),  # a qkv folder's config checked against its weights before anything is built
    ("qkv.checkpoint",),  # load any model folder (qkv or Hugging Face, + generation_config.json)
    ("qkv",),  # the package API (qkv/__init__.py: build, from_pretrained)
    ("qkv.tasks", "qkv.train"),  # batch sources / the training loop: neither knows the other
    ("qkv.run",),  # one way to build and train a run (train/demo/ablation runner all come here)
    ("qkv.whisper_decode",),  # one Whisper window decoded as transformers' generate (greedy, beams, fallback)
    # qkv chat: a conversation through its chat template; qkv predict: image classes; CLIP folders' embeddings
    # and zero-shot classes; qkv transcribe: Whisper folders over audio files
    ("qkv.chat", "qkv.predict", "qkv.image_text", "qkv.transcribe"),
    ("qkv.chat_vision",),  # qkv chat --image: a ChatSession whose messages carry an image (LLaVA)
    ("qkv.detect",),  # qkv predict DETECTOR --out: a DETR's boxes drawn (qkv.predict's image preprocessing)
    # ablation suites (each run through qkv.run.train_run); fine-tuning recipes
    ("qkv.experiments", "qkv.finetune"),
    # sentence embeddings from a BERT-family folder (uses finetune.encoders' folder + tokenizer); qkv export
    # (a run's tokenizer and task, qkv predict's preprocessing for an image classifier)
    ("qkv.embed", "qkv.export"),
    ("qkv.explore", "qkv.serve"),  # the attention explorer; qkv serve
    # qkv speedrun: tokenizer -> qkv train -> qkv finetune --task chat -> evaluation -> report card
    ("qkv.speedrun",),
    ("qkv.demo",),
    ("qkv.cli",),
]

# (importing module, imported module): why the upward import is there. Keep this list short.
ALLOWED: dict[tuple[str, str], str] = {
    ("qkv.models.base", "qkv.generate"):
        "QKVModel.generate(): the Hugging Face-style model.generate(...) convenience, a function-level "
        "import; generation itself only consumes the decoder protocol (models/decoding.py)",
}


def layer_of(module: str) -> tuple[int, str]:
    """(layer index, package) of a qkv module: the longest LAYERS prefix that names it."""
    best = None
    for i, names in enumerate(LAYERS):
        for name in names:
            if ((module == name or module.startswith(name + "."))
                and (best is None or len(name) > len(best[1]))):
                best = (i, name)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def all_imports(path: Path, me: str | None = None) -> list[tuple[int, str]]:
    """(line, module) of every qkv import anywhere in the file (relative imports resolved); `me` is the
    file's module name (default: from its place under src/)."""
    me = me or module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            # `from qkv import x` may import a submodule x: resolve it when it exists
            names = [f"{mod}.{a.name}" for a in node.names
                         if (SRC.parent / f"{mod}.{a.name}".replace(".", "/")).exists()
                     or (SRC.parent / (f"{mod}.{a.name}".replace(".", "/") + ".py")).exists()]
            out += [(node.lineno, n) for n in names] or [(node.lineno, mod)]
    return [(line, m) for line, m in out if m == "qkv" or m.startswith("qkv.")]


def test_every_import_goes_down_a_layer():
    problems, used = [], set()
    for path in sorted(SRC.rglob("*.py")):
        me = module_name(path)
        my_layer, my_pkg = layer_of(me)
        for line, imported in all_imports(path):
            layer, pkg = layer_of(imported)
            if layer < my_layer or pkg == my_pkg:
                continue
            allowed = next((k for k in ALLOWED if k[0] == me
                                and (imported == k[1] or imported.startswith(k[1] + "."))),
                           None)
            if allowed is not None:
                used.add(allowed)
                continue
            problems.append(f"{path.relative_to(SRC.parent)}:{line}: {me} (layer {my_pkg}) imports "
                            f"{imported} (layer {pkg})")
    assert not problems, "upward or sideways imports:\n" + "\n".join(problems)
    assert used == set(ALLOWED), f"allow-list entries no longer needed: {set(ALLOWED) - used}"


def test_the_checker_sees_function_level_and_type_checking_imports(tmp_path):
    """The rule is not vacuous: imports inside functions and TYPE_CHECKING blocks are read too."""
    f = tmp_path / "probe.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import qkv.models\n"
                 "def g():\n    from qkv.generate import generate\n    from . import block\n",
                 encoding="utf-8")
    found = [m for _, m in all_imports(f, "qkv.nn.probe")]
    assert found == ["qkv.models", "qkv.generate", "qkv.nn.block"]
    assert [layer_of(m)[0] > layer_of("qkv.nn.probe")[0] for m in found] == [True, True, False]
