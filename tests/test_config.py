"""Strict configs: unknown keys name the closest valid key, values are type-checked, overrides are
dotted, presets build, and build() accepts names, configs and mappings."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

import qkv
from qkv.config import (
    ConfigError,
    TransformerConfig,
    apply_overrides,
    from_dict,
    load_yaml,
    parse_overrides,
    replace,
    to_dict,
)
from qkv.models import BERT, GPT, EncoderDecoder, GPTConfig
from qkv.models.registry import config_for, preset


def test_unknown_key_names_the_closest_valid_key():
    with pytest.raises(ConfigError, match=r"unknown key 'n_head' in GPTConfig; did you mean 'n_heads'\?"):
        from_dict(GPTConfig, {"n_head": 4})
    with pytest.raises(ConfigError, match="did you mean 'context_length'"):
        from_dict(GPTConfig, {"context_lenght": 64})
    with pytest.raises(ConfigError, match="valid keys: .*vocab_size"):  # nothing close: list them
        from_dict(GPTConfig, {"zzzzzz": 1})


@pytest.mark.parametrize("key, value, message", [
    ("d_model", "big", "expected an integer"),
    ("d_model", 2.5, "expected an integer"),
    ("d_model", True, "expected an integer"),
    ("dropout", "lots", "expected a number"),
    ("tie_embeddings", "yes", "expected true/false"),
    ("position", 3, "expected a string"),
    ("n_kv_heads", "two", "GPTConfig.n_kv_heads"),
])
def test_bad_types(key, value, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(GPTConfig, {key: value})


def test_good_types_are_coerced():
    cfg = from_dict(GPTConfig, {"d_model": 64.0, "dropout": 0, "n_kv_heads": None, "init_std": "1e-3"})
    assert cfg.d_model == 64 and isinstance(cfg.d_model, int)
    assert cfg.dropout == 0.0 and isinstance(cfg.dropout, float)
    assert cfg.init_std == 1e-3  # YAML 1.1 reads "1e-3" as a string; a float field accepts it


@pytest.mark.parametrize("key, value, message", [
    ("position", "rotary", r"position: 'rotary' is not one of .*'rope'"),
    ("norm", "layer_norm", r"did you mean 'layernorm'"),
    ("ffn", "geglu", "ffn"),
    ("placement", "middle", "placement"),
    ("attention", "flash", "attention"),
])
def test_bad_choices(key, value, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(GPTConfig, {key: value})


@pytest.mark.parametrize("fields, message", [
    ({"d_model": 30, "n_heads": 4}, "divisible"),
    ({"n_heads": 0}, "GPTConfig.n_heads must be at least 1, got 0"),
    ({"n_kv_heads": 3}, "multiple of n_kv_heads"),
    ({"position": "rope", "d_model": 12, "n_heads": 4}, "even head dimension"),
    ({"dropout": 1.0}, "dropout"),
    ({"vocab_size": 0}, "GPTConfig.vocab_size must be at least 1, got 0"),
    ({"norm_eps": -1e-5}, "norm_eps"),  # these passed validation and crashed (or gave NaN) later
    ({"rope_base": 0}, "rope_base"),
    ({"rope_base": -10000.0}, "rope_base"),
    ({"init_std": -0.02}, "init_std"),
    ({"embed_init_std": float("nan")}, "embed_init_std"),
])
def test_inconsistent_values(fields, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(GPTConfig, fields)
    with pytest.raises(ConfigError, match=message):  # also when the config is built directly
        GPT(GPTConfig(**fields))


def test_overrides():
    over = parse_overrides(["model.d_model=64", "model.position=rope", "lr=3e-4", "name=", "flag=true",
                            "steps=10", "note=a=b"])
    assert over == {"model.d_model": 64, "model.position": "rope", "lr": "3e-4", "name": "", "flag": True,
                    "steps": 10, "note": "a=b"}
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["d_model"])

    data = {"model": {"preset": "gpt-tiny", "d_model": 128}, "steps": 5}
    apply_overrides(data, {"model.d_model": 64, "model.n_heads": 2, "train.lr": 0.1})
    assert (data
            == {"model": {"preset": "gpt-tiny", "d_model": 64, "n_heads": 2}, "steps": 5,
                "train": {"lr": 0.1}})
    with pytest.raises(ConfigError, match="non-mapping"):
        apply_overrides({"steps": 5}, {"steps.x": 1})

    cfg = replace(GPTConfig(), d_model=64, position="rope")
    assert (cfg.d_model, cfg.position) == (64, "rope")
    with pytest.raises(ConfigError, match="did you mean 'n_heads'"):
        replace(GPTConfig(), n_head=2)
    with pytest.raises(ConfigError, match="expected an integer"):
        replace(GPTConfig(), d_model="wide")


@dataclass
class _Inner:
    lr: float = 0.1


@dataclass
class _Outer:
    inner: _Inner = field(default_factory=_Inner)
    tags: list[str] = field(default_factory=list)


def test_nested_dataclasses_and_dotted_replace():
    cfg = from_dict(_Outer, {"inner": {"lr": 1}, "tags": ["a"]})
    assert cfg.inner.lr == 1.0 and cfg.tags == ["a"]
    with pytest.raises(ConfigError, match=r"unknown key 'rl' in _Outer.inner; did you mean 'lr'"):
        from_dict(_Outer, {"inner": {"rl": 1}})
    assert replace(cfg, **{"inner.lr": 0.5}).inner.lr == 0.5
    with pytest.raises(ConfigError, match="expected a list"):
        from_dict(_Outer, {"tags": "a"})


def test_yaml(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("model:\n  preset: gpt-nano\n  d_model: 24\n  init_std: 1e-2\n")
    data = load_yaml(p)
    model = qkv.build(data["model"])
    assert model.config.d_model == 24 and model.config.init_std == 0.01
    with pytest.raises(ConfigError, match="not found"):
        load_yaml(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_yaml(tmp_path / "list.yaml")
    (tmp_path / "bad.yaml").write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_yaml(tmp_path / "bad.yaml")
    (tmp_path / "empty.yaml").write_text("")
    assert load_yaml(tmp_path / "empty.yaml") == {}


def test_required_presets_exist_and_tiny_ones_build_and_run():
    names = qkv.presets()
    for required in ("gpt2", "bert-base", "transformer-base", "gpt-tiny", "bert-tiny", "transformer-tiny"):
        assert required in names
    for name in names:
        fam, cfg, desc = preset(name)
        assert desc, f"preset {name} needs a description"
        if fam.name not in ("gpt", "bert", "encdec"):
            continue  # other families test their own presets
        with torch.device("meta"):
            model = qkv.build(name)  # every preset builds (meta: shapes only)
        assert model.family == fam.name
    for name, cls in (("gpt-tiny", GPT), ("bert-tiny", BERT), ("transformer-tiny", EncoderDecoder)):
        model = qkv.build(name).eval()
        assert isinstance(model, cls)
        ids = torch.randint(0, 16, (1, 5))
        kw = {"decoder_input_ids": ids} if cls is EncoderDecoder else {}
        assert torch.isfinite(model(ids, **kw).logits).all()


def test_build_from_names_configs_and_mappings():
    assert qkv.build("gpt-nano", d_model=24).config.d_model == 24
    with pytest.raises(ConfigError, match="did you mean 'gpt-nano'"):
        qkv.build("gpt-nana")
    m = qkv.build({"preset": "gpt-nano", "n_layers": 1})
    assert isinstance(m, GPT) and m.config.n_layers == 1 and m.config.d_model == 48
    m = qkv.build({"family": "bert", "vocab_size": 50, "n_layers": 1, "d_model": 32, "n_heads": 2})
    assert isinstance(m, BERT) and m.config.vocab_size == 50
    m = qkv.build(GPTConfig(vocab_size=10, n_layers=1, d_model=16, n_heads=2), n_layers=2)
    assert m.config.n_layers == 2
    with pytest.raises(ConfigError, match="'preset' or 'family'"):
        qkv.build({"d_model": 16})
    with pytest.raises(ConfigError, match="is a gpt model, not bert"):
        qkv.build({"preset": "gpt-nano", "family": "bert"})
    with pytest.raises(ConfigError, match="unknown model family"):
        qkv.build({"family": "rnn"})
    with pytest.raises(ConfigError, match="did you mean 'n_heads'"):
        qkv.build({"family": "gpt", "n_head": 2})
    with pytest.raises(ConfigError, match="did you mean 'n_layers'"):
        qkv.build("gpt-nano", n_layer=2)
    with pytest.raises(ConfigError, match="not a registered model config"):
        config_for(TransformerConfig())


def test_config_round_trips_through_a_dict():
    cfg = GPTConfig(vocab_size=10, n_layers=1, d_model=16, n_heads=2, position="rope", n_kv_heads=1)
    assert from_dict(GPTConfig, to_dict(cfg)) == cfg


@pytest.mark.parametrize("seed", [2**62, -(2**62), 123456789012345678901])
def test_a_seed_past_64_bits_is_named(seed):
    """It failed at the first torch.manual_seed with 'Overflow when unpacking long long', naming no
    setting."""
    from qkv.train import TrainConfig

    with pytest.raises(ConfigError, match="TrainConfig.seed must be an integer of magnitude below 2..62"):
        from_dict(TrainConfig, {"seed": seed})
    from_dict(TrainConfig, {"seed": 2**62 - 1})


@pytest.mark.parametrize("content, message", [
    (b"train:\n  lr: 1e-3\n caf\xe9: 1\n", "not UTF-8 text"),
    (b"train: {lr: 1e-3\nmodel: x\n", "not valid YAML at line"),
])
def test_a_bad_yaml_file_is_one_line_naming_it(tmp_path, content, message):
    from qkv.config import load_yaml

    (tmp_path / "run.yaml").write_bytes(content)
    with pytest.raises(ConfigError, match=message) as e:
        load_yaml(tmp_path / "run.yaml")
    assert str(tmp_path / "run.yaml") in str(e.value) and "\n" not in str(e.value)
