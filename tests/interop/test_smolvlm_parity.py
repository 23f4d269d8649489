"""qkv's loader for Idefics3 / SmolVLM folders against transformers' Idefics3ForConditionalGeneration and
SmolVLMForConditionalGeneration on tiny random-weight folders: logits with image tiles, greedy decoding with
the KV cache, the tiling preprocessing and the prompt's image tokens against Idefics3Processor, clear errors,
the CLI chat."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import qkv
from qkv.interop.smolvlm import Idefics3Processor, navit_position_ids
from qkv.storage import CheckpointError

sys.path.insert(0, str(Path(__file__).parent))
from _llava_folder import png  # noqa: E402
from _smolvlm_folder import IMAGE_TOKEN_ID, hf_idefics3, hf_processor, smolvlm_folder  # noqa: E402

transformers = pytest.importorskip("transformers")


def _prompt(n_image_tokens: int, rows: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    text = torch.randint(3, 100, (rows, 9), generator=g)
    image = torch.full((rows, n_image_tokens), IMAGE_TOKEN_ID)
    return torch.cat([text[:, :2], image, text[:, 2:]], dim=1)


def _tiles(rows: int, per_row: int, size: int = 32) -> torch.Tensor:
    """HF's pixel_values layout: (batch, tiles per row, 3, H, W)."""
    return torch.randn(rows, per_row, 3, size, size, generator=torch.Generator().manual_seed(1))


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool((got - want).abs().max() <= 1e-4 * want.abs().max())


@pytest.mark.parametrize("kind, scale", [("idefics3", 2), ("smolvlm", 2), ("idefics3", 1), ("smolvlm", 4)])
def test_logits_equal_transformers(tmp_path, kind, scale):
    hf = hf_idefics3(kind, scale_factor=scale)
    hf.save_pretrained(tmp_path)
    ours = qkv.from_pretrained(tmp_path)
    n = 16 // scale ** 2
    assert ours.config.image_tokens == n
    ids, pix = _prompt(3 * n, rows=2), _tiles(2, 3)  # 3 tiles in each of 2 rows
    with torch.no_grad():
        want = hf(input_ids=ids, pixel_values=pix).logits
        got = ours(ids, pix.flatten(0, 1)).logits
    assert _close(got, want)


def test_position_rows_of_a_grid_where_bucketing_is_not_the_identity(tmp_path):
    """A 25 x 25 patch grid: Idefics3's bucketed position lookup reads row 4 for patch 5 (float rounding)."""
    assert not torch.equal(navit_position_ids(25), torch.arange(625))
    hf = hf_idefics3(image_size=50, patch_size=2, scale_factor=5)
    hf.save_pretrained(tmp_path)
    ours = qkv.from_pretrained(tmp_path)
    ids, pix = _prompt(25), _tiles(1, 1, size=50)
    with torch.no_grad():
        assert _close(ours(ids, pix[0]).logits, hf(input_ids=ids, pixel_values=pix).logits)


def test_greedy_with_kv_cache_equals_transformers(tmp_path):
    hf = hf_idefics3("smolvlm")
    hf.save_pretrained(tmp_path)
    ours = qkv.from_pretrained(tmp_path)
    ids, pix = _prompt(5 * 4), _tiles(1, 5)
    want = hf.generate(input_ids=ids, pixel_values=pix, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    got = ours.generate(ids, 16, pixel_values=pix[0], min_new_tokens=16)
    assert got.tolist() == want.tolist()
    assert ours.generate(ids, 16, pixel_values=pix[0], min_new_tokens=16, use_cache=False).tolist() == want.tolist()


def test_tied_embeddings_and_bf16(tmp_path):
    hf = hf_idefics3(tie=True)
    hf.save_pretrained(tmp_path / "tied")
    ours = qkv.from_pretrained(tmp_path / "tied")
    assert ours.language_model.lm_head.weight is ours.language_model.tok_emb.weight
    ids, pix = _prompt(8), _tiles(1, 2)
    with torch.no_grad():
        assert _close(ours(ids, pix[0]).logits, hf(input_ids=ids, pixel_values=pix).logits)
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    half = qkv.from_pretrained(tmp_path / "bf16")
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        want = hf(input_ids=ids, pixel_values=pix.bfloat16()).logits.float()
        got = half(ids, pix[0]).logits.float()
    assert (got - want).abs().max() <= 0.05 * want.abs().max()  # bf16 rounding in different op orders


def test_folder_errors_are_clear(tmp_path):
    hf_idefics3().save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())

    def load_with(**change):
        (tmp_path / "config.json").write_text(json.dumps({**meta, **change}))
        return qkv.from_pretrained(tmp_path)

    with pytest.raises(CheckpointError, match="num_hidden_layers is 3, but .* holds 2 layers"):
        load_with(vision_config={**meta["vision_config"], "num_hidden_layers": 3})
    with pytest.raises(CheckpointError, match="'clip_vision_model' is not supported"):
        load_with(vision_config={**meta["vision_config"], "model_type": "clip_vision_model"})
    with pytest.raises(CheckpointError, match="hidden_size \\* scale_factor\\*\\*2 is 512"):
        load_with(scale_factor=4)
    with pytest.raises(CheckpointError, match="text_config.hidden_size is 32"):
        load_with(text_config={**meta["text_config"], "hidden_size": 32})
