"""One record per Hugging Face model_type (qkv.interop.registry): every family module registers its own,
each record names a real kind and family, every exporter has one signature, and the tables the rest of qkv
reads (load_hf's dispatch, `qkv finetune`'s kinds, `qkv info`'s sizing fields, `qkv export`'s formats, the
vision-language check) follow a record registered in one place."""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path

import pytest

import qkv.interop
from qkv.cli.info import check_sizable
from qkv.config import ConfigError
from qkv.export import choose_model_type
from qkv.finetune import model_kind
from qkv.interop import registry
from qkv.interop.export import writable_types
from qkv.interop.registry import FAMILY_MODULES, ModelType, is_vision_language, lookup, model_types, names
from qkv.models.registry import KINDS, families
from qkv.storage import CheckpointError

INTEROP = Path(qkv.interop.__file__).parent


def registering_modules() -> set[str]:
    """The interop modules whose source calls register(...) (read with ast, not by importing them)."""
    found = set()
    for path in INTEROP.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "register":
                found.add(path.stem)
    return found - {"registry"}


def test_every_module_that_registers_is_imported_by_the_first_query():
    assert registering_modules() == set(FAMILY_MODULES)
    by_module = {r.module for r in model_types()}
    assert by_module == {f"qkv.interop.{m}" for m in FAMILY_MODULES}


def test_each_record_names_a_kind_and_a_family_qkv_has():
    known = set(families())
    for r in model_types():
        assert r.kind in KINDS, r
        assert r.family in known, r
        assert lookup(r.name) is r


def test_one_exporter_signature():
    for r in model_types(writable=True):
        assert list(inspect.signature(r.exporter).parameters) == ["model", "out", "request"], r.name
        if r.check is not None:
            assert list(inspect.signature(r.check).parameters) == ["model", "request"], r.name


def test_the_tables_derived_from_the_records():
    """What the hand-kept tables said before they were derived (each type in one of them)."""
    decoders = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe",
                "deepseek_v3")
    assert writable_types("gpt") == decoders
    assert writable_types("bert") == ("bert", "roberta", "xlm-roberta", "distilbert")  # bert: the default
    assert writable_types("deberta") == ("deberta-v2",)
    assert set(writable_types(kind="image")) == {"vit", "resnet", "swin"}
    assert writable_types("llava") == ("llava", "idefics3", "smolvlm")
    encoders = {"bert", "roberta", "xlm-roberta", "distilbert", "deberta-v2"}
    assert set(names(model_types(kind="encoder"))) == encoders
    assert {r.name for r in model_types() if r.exporter is None} == {
        "deepseek_v2", "whisper", "clip", "siglip", "detr"}
    assert [n for n in names(model_types()) if is_vision_language(n)] == ["llava", "idefics3", "smolvlm"]
    assert {r.name: r.kind for r in model_types(kind="seq2seq")} == {"t5": "seq2seq", "bart": "seq2seq",
                                                                    "marian": "seq2seq"}
    assert lookup("whisper").kind == "audio" and lookup("clip").kind == "dual"
    assert lookup("siglip").family == "clip" and lookup("detr").kind == "detection"
    assert lookup("gpt2").sizing_fields == ("n_layer", "n_head", "n_embd", "n_positions")
    assert lookup("vit").sizing_fields == ()
    assert lookup("nope") is None and lookup(None) is None


def test_a_second_record_for_a_type_is_refused(monkeypatch):
    monkeypatch.setattr(registry, "_RECORDS", dict(registry._RECORDS))
    gpt2 = lookup("gpt2")
    registry.register(gpt2)  # the same record again (a module imported twice) is no conflict
    with pytest.raises(ValueError, match="'gpt2' is registered twice"):
        registry.register(ModelType("gpt2", "encoder", "bert", gpt2.loader))


class Tiny:
    family = "gpt"


def _tiny_loader(folder: Path, meta: dict) -> Tiny:
    return Tiny()


def _tiny_exporter(model: Tiny, out: Path, request: registry.ExportRequest) -> None:
    (out / "written.txt").write_text(request.model_type)


def test_a_type_registered_in_one_place_is_read_everywhere(tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "_RECORDS", dict(registry._RECORDS))
    registry.register(ModelType("tiny-lm", "decoder", "gpt", _tiny_loader, _tiny_exporter,
                                sizing_fields=("n_layers", "width")))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "tiny-lm", "n_layers": 2}))
    assert isinstance(qkv.interop.load_hf(tmp_path), Tiny)
    assert model_kind(tmp_path) == "decoder"
    with pytest.raises(ConfigError, match="lacks 'width'.*tiny-lm"):
        check_sizable(str(tmp_path))
    assert "tiny-lm" in writable_types("gpt")
    assert choose_model_type(Tiny(), {}, "tiny-lm") == "tiny-lm"
    out = tmp_path / "out"
    out.mkdir()
    qkv.interop.export.write_model(Tiny(), out, registry.ExportRequest("tiny-lm"))
    assert (out / "written.txt").read_text() == "tiny-lm"


def test_an_unknown_type_is_refused_naming_the_ones_read(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "tiny-lm"}))
    with pytest.raises(CheckpointError, match=r"'tiny-lm' is not supported; supported: \[.*'bart'"):
        qkv.interop.load_hf(tmp_path)
    with pytest.raises(ConfigError, match="no Hugging Face exporter for model_type 'whisper'"):
        qkv.interop.export.write_model(Tiny(), tmp_path, registry.ExportRequest("whisper"))
