"""The trainer knows no family: an encoder-decoder and a BERT classifier train through the same loop."""

import os

import pytest
import torch

import qkv
from qkv.config import ConfigError
from qkv.train import Trainer


class Seq2Seq:
    def batch(self, index, batch_size, split="train"):
        g = torch.Generator().manual_seed(index)
        src = torch.randint(3, 20, (batch_size, 7), generator=g)
        labels = src.flip(1).clone()
        labels[:, -2:] = -100  # padded targets
        return {"input_ids": src, "labels": labels, "attention_mask": torch.ones_like(src)}


class Classify:
    def batch(self, index, batch_size, split="train"):
        g = torch.Generator().manual_seed(index)
        x = torch.randint(1, 50, (batch_size, 9), generator=g)
        return {"input_ids": x, "labels": (x[:, 1] > 25).long(), "attention_mask": torch.ones_like(x)}


@pytest.mark.parametrize("name,overrides,data", [
    ("transformer-tiny", dict(src_vocab_size=24, d_model=32, n_heads=2, d_ff=64,
                              n_encoder_layers=1, n_decoder_layers=1, context_length=16), Seq2Seq()),
    ("bert-tiny", dict(vocab_size=50, head="classify", pooler=True, d_model=32, n_heads=2, n_layers=1,
                       context_length=16), Classify()),
])
def test_other_families_train_and_reload(name, overrides, data, cfg_factory, tmp_path):
    model = qkv.build(name, **overrides)
    s = Trainer(model, cfg_factory(max_steps=3, batch_size=4, grad_accum=2), data).fit()
    assert s["steps"] == 3 and torch.isfinite(torch.tensor(s["final_loss"]))
    again = qkv.from_pretrained(s["checkpoint"])
    for k, v in again.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k


def test_ddp_without_torchrun_is_clear_error(make_gpt, toy_data, cfg_factory, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert "RANK" not in os.environ
    with pytest.raises(ConfigError, match="torchrun"):
        Trainer(make_gpt(), cfg_factory(distributed="fsdp"), toy_data)


def test_bad_data_source_is_clear_error(make_gpt, cfg_factory):
    with pytest.raises(TypeError, match="batch source"):
        Trainer(make_gpt(), cfg_factory(), [1, 2, 3])


def test_config_mapping_is_checked(make_gpt, toy_data, tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'max_steps'"):
        Trainer(make_gpt(), {"max_step": 3, "out_dir": str(tmp_path)}, toy_data)
