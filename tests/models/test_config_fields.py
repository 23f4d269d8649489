"""Every model config's fields are declared with qkv.config.setting (help, bounds, choices): a subclass that
re-declares a field with a bare default would drop its bounds silently, so this walks every registered
family's config (and the configs nested in it) and checks each field carries its help, that a re-declared
field keeps its base's bounds, and that the bounds refuse what they say."""

from __future__ import annotations

from dataclasses import fields, is_dataclass

import pytest

from qkv.config import ConfigError, TransformerConfig, field_types, from_dict
from qkv.models.bert import BERTConfig
from qkv.models.deberta import DeBERTaConfig
from qkv.models.registry import families, family
from qkv.nn.attention import BACKENDS
from qkv.nn.block import PLACEMENTS
from qkv.nn.ffn import ACTIVATIONS
from qkv.nn.norm import NORMS
from qkv.nn.position import ENCODINGS

# declared in qkv.nn, the layer below qkv.config, which cannot import its `setting` (checked by the model's
# validate: check_moe, check_mla)
NN_CONFIGS = ("MoEConfig", "MLAConfig")


def model_configs() -> list[type]:
    """Every registered family's config class and the config classes nested in them."""
    seen: list[type] = []
    todo = [family(name).config_class for name in families()]
    while todo:
        cls = todo.pop()
        if cls in seen or cls.__name__ in NN_CONFIGS:
            continue
        seen.append(cls)
        todo += [tp for tp in field_types(cls).values() if is_dataclass(tp)]
    return seen


@pytest.mark.parametrize("cls", model_configs(), ids=lambda c: c.__name__)
def test_every_field_is_declared_with_its_help(cls):
    bare = [f.name for f in fields(cls) if not f.metadata.get("help")]
    assert not bare, f"{cls.__name__}: {bare} declared without setting(...)"


@pytest.mark.parametrize("cls", [c for c in model_configs() if issubclass(c, TransformerConfig)],
                         ids=lambda c: c.__name__)
def test_a_redeclared_field_keeps_its_bounds(cls):
    base = {f.name: f for f in fields(TransformerConfig)}
    for f in fields(cls):
        if f.name in base:
            assert dict(f.metadata) == dict(base[f.name].metadata), f"{cls.__name__}.{f.name}"


def test_a_subclass_default_and_the_base_bounds_both_hold():
    assert BERTConfig().d_model == 768 and DeBERTaConfig().pooler_act == "gelu"
    with pytest.raises(ConfigError, match="BERTConfig.d_model must be at least 1, got 0"):
        from_dict(BERTConfig, {"d_model": 0})
    with pytest.raises(ConfigError, match=r"DeBERTaConfig.pooler_act must be one of \('tanh', 'relu', "
                                          r"'gelu'\), got 'swish'"):
        from_dict(DeBERTaConfig, {"pooler_act": "swish"})


@pytest.mark.parametrize("value, ok", [(0.0, True), (0.999, True), (1.0, False), (-0.1, False)])
def test_an_exclusive_bound_stays_exclusive(value, ok):
    if ok:
        assert from_dict(DeBERTaConfig, {"pooler_dropout": value}).pooler_dropout == value
    else:
        with pytest.raises(ConfigError, match=r"DeBERTaConfig.pooler_dropout must be in \[0, 1\), got"):
            from_dict(DeBERTaConfig, {"pooler_dropout": value})


@pytest.mark.parametrize("name, names", [("ffn", ACTIVATIONS), ("norm", NORMS), ("placement", PLACEMENTS),
                                         ("position", ENCODINGS), ("attention", BACKENDS)])
def test_the_help_of_a_name_qkv_nn_defines_lists_every_name(name, names):
    """qkv.nn owns these names (qkv.config, a layer above, checks them in validate); the help text the docs
    table shows spells them out, and must keep up with nn."""
    help_text = {f.name: f.metadata["help"] for f in fields(TransformerConfig)}[name]
    assert all(n in help_text for n in names), (name, [n for n in names if n not in help_text])
