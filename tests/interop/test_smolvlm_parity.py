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
from _smolvlm_folder import (  # noqa: E402
    IMAGE_TOKEN_ID,
    hf_idefics3,
    hf_processor,
    image_processor,
    save_bpe_tokenizer,
    smolvlm_folder,
)

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
    no_cache = ours.generate(ids, 16, pixel_values=pix[0], min_new_tokens=16, use_cache=False)
    assert no_cache.tolist() == want.tolist()


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


SIZES = [(45, 70), (70, 45), (32, 32), (100, 33), (20, 20), (64, 40), (33, 65)]


# longest edge 64: 2 x 2 tiles mostly; 96: up to 3 x 3; 32: one tile, no global image even when splitting
@pytest.mark.parametrize("split, longest", [(True, 64), (False, 64), (True, 96), (True, 32)])
def test_preprocessing_equals_idefics3_image_processor(tmp_path, split, longest):
    from PIL import Image

    smolvlm_folder(tmp_path, split=split, longest=longest)
    ref = hf_processor(tmp_path, split, longest).image_processor
    ours = Idefics3Processor.from_folder(tmp_path)
    assert (ours.tile, ours.longest_edge, ours.split, ours.image_seq_len) == (32, longest, split, 4)
    for size in SIZES:
        image = Image.open(png(tmp_path / "x.png", size, seed=size[0]))
        want = ref(images=image, return_tensors="pt", return_row_col_info=True)
        got = ours(image)
        assert got.shape == want.pixel_values.shape[1:]
        assert (got - want.pixel_values[0]).abs().max() <= 1e-5, size
        assert ours.grid(image) == (want.rows[0][0], want.cols[0][0])
        assert want.pixel_attention_mask.all()  # every tile is whole: the tower needs no patch mask
    grey = Image.open(png(tmp_path / "g.png")).convert("L")  # RGB conversion
    want = ref(images=[grey, grey], return_tensors="pt").pixel_values
    assert (ours([grey, grey]) - want.flatten(0, 1)).abs().max() <= 1e-5


@pytest.mark.parametrize("split, longest", [(True, 64), (False, 64), (True, 96)])
def test_prompt_ids_equal_idefics3_processor(tmp_path, split, longest):
    from PIL import Image

    from qkv.interop.tokenizer import load_hf_tokenizer

    smolvlm_folder(tmp_path, split=split, longest=longest)
    processor = hf_processor(tmp_path, split, longest)
    ours, tok = Idefics3Processor.from_folder(tmp_path), load_hf_tokenizer(tmp_path)
    text = "<|im_start|>User:<image>what is in the picture?<end_of_utterance>\nAssistant:"
    for size in SIZES:
        image = Image.open(png(tmp_path / "x.png", size))
        want = processor(text=text, images=[image], add_special_tokens=False, return_tensors="pt")
        ids = tok.encode(text, add_special_tokens=False)
        ids = ours.expand_ids(ids, IMAGE_TOKEN_ID, [ours.grid(image)], tok)
        assert ids == want.input_ids[0].tolist()
        assert torch.equal(ours(image), want.pixel_values[0])
    with pytest.raises(ValueError, match="more image tokens than the 1 image"):
        ours.expand_ids([IMAGE_TOKEN_ID, IMAGE_TOKEN_ID], IMAGE_TOKEN_ID, [(0, 0)], tok)


def test_smolvlm_processor_writes_the_same_image_text(tmp_path):
    """SmolVLMProcessor's prompt strings (its module functions: the processor itself needs num2words)."""
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    ours = Idefics3Processor(image_seq_len=3)
    for rows, cols in [(0, 0), (1, 2), (2, 2), (3, 1)]:
        assert ours.image_text(rows, cols) == get_image_prompt_string(
            rows, cols, 3, fake_token_around_image="<fake_token_around_image>", image_token="<image>",
            global_image_token="<global-img>")


def test_preprocessor_config_json_of_hub_folders(tmp_path):
    """Hub folders keep the image processor in preprocessor_config.json, image_seq_len in processor_config."""
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "SmolVLMImageProcessor", "size": {"longest_edge": 2048},
         "max_image_size": {"longest_edge": 512}, "resample": 1, "do_image_splitting": True}))
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_len": 64}))
    p = Idefics3Processor.from_folder(tmp_path)
    assert (p.tile, p.longest_edge, p.split, p.image_seq_len, p.resample) == (512, 2048, True, 64, 1)


def test_preprocessing_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no preprocessor_config.json and no image_processor"):
        Idefics3Processor.from_folder(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "CLIPImageProcessor"}))
    with pytest.raises(CheckpointError, match="'CLIPImageProcessor' is not supported"):
        Idefics3Processor.from_folder(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Idefics3ImageProcessor", "size": {"height": 9, "width": 9}}))
    with pytest.raises(CheckpointError, match="size .* is not supported"):
        Idefics3Processor.from_folder(tmp_path)


@pytest.mark.parametrize("split", [True, False])
def test_cli_chat_with_an_image_equals_transformers(tmp_path, capsys, split):
    from PIL import Image

    from qkv.cli.main import main

    folder = smolvlm_folder(tmp_path / "smolvlm", split=split, kind="smolvlm")
    image = png(tmp_path / "cat.png")
    assert main(["chat", str(folder), "--image", str(image), "--message", "what is in the picture?",
                 "--max-new-tokens", "8", "--greedy"]) == 0
    answer = capsys.readouterr().out.strip()

    processor = hf_processor(folder, split)
    content = [{"type": "image"}, {"type": "text", "text": "what is in the picture?"}]
    messages = [{"role": "user", "content": content}]
    text = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, images=[Image.open(image)], return_tensors="pt", add_special_tokens=False)
    hf = transformers.SmolVLMForConditionalGeneration.from_pretrained(folder).eval()
    out = hf.generate(**inputs, max_new_tokens=8, do_sample=False)
    want = processor.tokenizer.decode(out[0, inputs.input_ids.shape[1]:], skip_special_tokens=True).strip()
    assert answer == want and answer


def test_cli_chat_refuses_a_folder_without_the_processor_config(tmp_path, capsys):
    from qkv.cli.main import main

    folder = smolvlm_folder(tmp_path / "smolvlm")
    (folder / "processor_config.json").unlink()
    rc = main(["chat", str(folder), "--image", str(png(tmp_path / "x.png")), "--message", "hi"])
    assert rc == 2 and "no preprocessor_config.json and no image_processor" in capsys.readouterr().err


def test_qkv_native_save_and_reload(tmp_path):
    """The loaded model is a qkv LLaVA with a SigLIP tower and a pixel-shuffle projector: it saves and loads
    back as a qkv folder (there is no export back to a Hugging Face idefics3 folder)."""
    hf_idefics3("smolvlm").save_pretrained(tmp_path / "hf")
    ours = qkv.from_pretrained(tmp_path / "hf")
    ours.save_pretrained(tmp_path / "qkv")
    again = qkv.from_pretrained(tmp_path / "qkv")
    assert again.config == ours.config and again.config.projector == "pixel_shuffle"
    ids, pix = _prompt(8), _tiles(1, 2)
    with torch.no_grad():
        assert torch.equal(again(ids, pix[0]).logits, ours(ids, pix[0]).logits)


def test_a_config_with_transformers_defaults_left_out(tmp_path):
    """Hub configs hold only the fields that differ from transformers' defaults (model types, activation,
    norm eps, channels, scale_factor): the loader fills them in as transformers does."""
    hf = hf_idefics3()
    hf.save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    for key in ("model_type", "hidden_act", "layer_norm_eps", "num_channels"):
        del meta["vision_config"][key]
    for key in ("model_type", "hidden_act", "tie_word_embeddings"):
        del meta["text_config"][key]
    for key in ("scale_factor", "tie_word_embeddings"):
        del meta[key]
    (tmp_path / "config.json").write_text(json.dumps(meta))
    ref = transformers.Idefics3ForConditionalGeneration.from_pretrained(tmp_path).eval()
    ours = qkv.from_pretrained(tmp_path)
    ids, pix = _prompt(8), _tiles(1, 2)
    with torch.no_grad():
        want = ref(input_ids=ids, pixel_values=pix).logits
        assert torch.equal(want, hf(input_ids=ids, pixel_values=pix).logits)  # the defaults are the values
        assert _close(ours(ids, pix[0]).logits, want)


def test_pixel_shuffle_config_errors():
    from qkv.config import ConfigError
    from qkv.models.connector import pixel_shuffle
    from qkv.models.vlm import VisionConfig, VLMConfig

    tower = VisionConfig(image_size=32, patch_size=8, d_model=32, n_heads=4, d_ff=64, n_layers=1,
                         class_token=False)
    for bad in [{"scale_factor": 2}, {"scale_factor": 3, "projector": "pixel_shuffle"},
                {"scale_factor": 0, "projector": "pixel_shuffle"}]:
        with pytest.raises(ConfigError, match="scale_factor"):
            VLMConfig(vision=tower, feature_select="full", **bad).validate()
    VLMConfig(vision=tower, feature_select="full", projector="pixel_shuffle", scale_factor=4).validate()
    with pytest.raises(ValueError, match="square grid whose side divides by 2"):
        pixel_shuffle(torch.zeros(1, 12, 8), 2)


def test_prompt_ids_with_a_byte_level_bpe_tokenizer(tmp_path):
    """The tile rows' newlines ("\\n", "\\n\\n") are merged by a byte-level BPE as they are in SmolVLM's
    tokenizer: the ids spliced per image equal the processor's text-then-tokenize ids."""
    from PIL import Image

    from qkv.interop.tokenizer import load_hf_tokenizer

    image_id = save_bpe_tokenizer(tmp_path)
    processor = transformers.Idefics3Processor(image_processor=image_processor(True, 96), image_seq_len=4,
                                               tokenizer=transformers.AutoTokenizer.from_pretrained(tmp_path))
    tok = load_hf_tokenizer(tmp_path)
    assert len(tok.encode("\n\n", add_special_tokens=False)) == 1  # the merge the test is about
    ours = Idefics3Processor(tile=32, longest_edge=96, image_seq_len=4)
    text = "<|im_start|>User:<image>what is in the picture?<end_of_utterance>\nAssistant:"
    for size in SIZES:
        image = Image.open(png(tmp_path / "x.png", size))
        want = processor(text=text, images=[image], add_special_tokens=False).input_ids[0]
        ids = ours.expand_ids(tok.encode(text, add_special_tokens=False), image_id, [ours.grid(image)], tok)
        assert ids == list(want)
