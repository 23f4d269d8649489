"""qkv's LLaVA against transformers' LlavaForConditionalGeneration on tiny random-weight folders: logits with
an image, greedy decoding with the KV cache, the image preprocessing, the key layouts, clear errors, the CLI
chat."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import qkv
from qkv.interop.llava import ImageProcessor, canonical_key, expand_image_tokens
from qkv.storage import CheckpointError

sys.path.insert(0, str(Path(__file__).parent))
from _llava_folder import IMAGE_TOKEN_ID, hf_llava, llava_folder, png  # noqa: E402

transformers = pytest.importorskip("transformers")


def _prompt(n_image_tokens: int, rows: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    text = torch.randint(3, IMAGE_TOKEN_ID, (rows, 9), generator=g)
    image = torch.full((rows, n_image_tokens), IMAGE_TOKEN_ID)
    return torch.cat([text[:, :1], torch.full((rows, 1), 1), image, text[:, 1:]], dim=1)


def _pixels(n: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("select, layer", [("default", -2), ("full", -1), ("default", -3)])
def test_logits_equal_transformers(tmp_path, select, layer):
    hf = hf_llava(select=select, feature_layer=layer)
    hf.save_pretrained(tmp_path)
    ours = qkv.from_pretrained(tmp_path)
    n = 16 + (select == "full")
    assert ours.config.image_tokens == n
    ids, pix = _prompt(n, rows=2), _pixels(2)
    with torch.no_grad():
        want = hf(input_ids=ids, pixel_values=pix).logits
        got = ours(ids, pix).logits
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_greedy_with_kv_cache_equals_transformers(tmp_path):
    hf = hf_llava()
    hf.save_pretrained(tmp_path)
    ours = qkv.from_pretrained(tmp_path)
    ids, pix = _prompt(16), _pixels()
    want = hf.generate(input_ids=ids, pixel_values=pix, max_new_tokens=16, do_sample=False, min_new_tokens=16)
    got = ours.generate(ids, 16, pixel_values=pix, min_new_tokens=16)
    assert got.tolist() == want.tolist()
    # the same tokens recomputing every step without a cache (the image enters every full forward)
    assert (ours.generate(ids, 16, pixel_values=pix, min_new_tokens=16, use_cache=False).tolist()
            == want.tolist())


def test_beam_search_equals_transformers(tmp_path):
    hf = hf_llava()
    hf.save_pretrained(tmp_path)
    ours = qkv.from_pretrained(tmp_path)
    ids, pix = _prompt(16), _pixels()
    want = hf.generate(input_ids=ids, pixel_values=pix, max_new_tokens=8, min_new_tokens=8, num_beams=3,
                       do_sample=False)
    assert ours.generate(ids, 8, pixel_values=pix, min_new_tokens=8, num_beams=3).tolist() == want.tolist()


def test_a_bf16_folder_stays_bf16(tmp_path):
    hf = hf_llava().to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    ours = qkv.from_pretrained(tmp_path)
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    ids, pix = _prompt(16), _pixels()
    with torch.no_grad():
        want = hf(input_ids=ids, pixel_values=pix.bfloat16()).logits.float()
        got = ours(ids, pix).logits.float()
    assert (got - want).abs().max() <= 0.05 * want.abs().max()  # bf16 rounding in different op orders


def test_preprocessing_equals_clip_image_processor(tmp_path):
    from PIL import Image

    llava_folder(tmp_path)
    ref = transformers.AutoImageProcessor.from_pretrained(tmp_path)
    ours = ImageProcessor.from_folder(tmp_path)
    for size in [(45, 70), (70, 45), (32, 32), (100, 33)]:
        image = Image.open(png(tmp_path / "x.png", size, seed=size[0]))
        want = ref(images=image, return_tensors="pt").pixel_values
        got = ours(image)
        assert got.shape == want.shape == (1, 3, 32, 32)
        assert (got - want).abs().max() <= 1e-5
    grey = Image.open(png(tmp_path / "g.png")).convert("L")  # RGB conversion
    assert ((ours([grey, grey]) - ref(images=[grey, grey], return_tensors="pt").pixel_values).abs().max()
            <= 1e-5)


@pytest.mark.parametrize("config", [
    {"size": 40, "crop_size": 32},  # ints, as older folders write them
    {"size": {"height": 32, "width": 32}, "do_center_crop": False, "resample": 2},
    {"size": {"shortest_edge": 36}, "crop_size": {"height": 32, "width": 24}, "do_normalize": False},
    {"size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32}, "image_mean": [0.5, 0.4, 0.3],
     "image_std": [0.2, 0.3, 0.4], "rescale_factor": 0.5 / 255},
])
def test_preprocessing_options_equal_clip_image_processor(tmp_path, config):
    from PIL import Image

    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "CLIPImageProcessor", **config}))
    ref = transformers.AutoImageProcessor.from_pretrained(tmp_path)
    image = Image.open(png(tmp_path / "x.png", (45, 70)))
    want = ref(images=image, return_tensors="pt").pixel_values
    got = ImageProcessor.from_folder(tmp_path)(image)
    assert got.shape == want.shape and (got - want).abs().max() <= 1e-5


def test_preprocessing_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no preprocessor_config.json"):
        ImageProcessor.from_folder(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "ConvNextImageProcessor"}))
    with pytest.raises(CheckpointError, match="'ConvNextImageProcessor' is not supported"):
        ImageProcessor.from_folder(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"size": {"longest_edge": 9}}))
    with pytest.raises(CheckpointError, match="size .* is not supported"):
        ImageProcessor.from_folder(tmp_path)


def test_processor_expansion_equals_llava_processor(tmp_path):
    from PIL import Image

    llava_folder(tmp_path)
    processor = transformers.LlavaProcessor(
        image_processor=transformers.AutoImageProcessor.from_pretrained(tmp_path),
        tokenizer=transformers.AutoTokenizer.from_pretrained(tmp_path), patch_size=8,
        vision_feature_select_strategy="default", num_additional_image_tokens=1)
    image = Image.open(png(tmp_path / "x.png"))
    want = processor(text="USER: <image>\nwhat is in the picture? ASSISTANT:", images=image,
                     return_tensors="pt")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids = tok("USER: <image>\nwhat is in the picture? ASSISTANT:").input_ids
    model = qkv.from_pretrained(tmp_path)
    assert expand_image_tokens(ids, IMAGE_TOKEN_ID, model.config.image_tokens) == want.input_ids[0].tolist()


def test_new_key_layout_loads_the_same_model(tmp_path):
    """transformers 5's layout (model.language_model., model.vision_tower., lm_head.) and the 4.x one."""
    from safetensors.torch import load_file, save_file

    hf = hf_llava()
    hf.save_pretrained(tmp_path / "a")
    ref = qkv.from_pretrained(tmp_path / "a")
    state = load_file(tmp_path / "a" / "model.safetensors")

    def v5(k: str) -> str:  # transformers 5's own names
        if k.startswith("language_model.lm_head."):
            return k.removeprefix("language_model.")
        return "model." + k.replace("language_model.model.", "language_model.")

    layouts = {"b": v5, "c": lambda k: k.replace("vision_tower.", "vision_tower.vision_model.")}
    ids, pix = _prompt(16), _pixels()
    for name, fn in layouts.items():
        (tmp_path / name).mkdir()
        save_file({fn(k): v for k, v in state.items()}, tmp_path / name / "model.safetensors")
        (tmp_path / name / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
        assert canonical_key(fn("language_model.model.norm.weight")) == "model.norm.weight"
        with torch.no_grad():
            assert torch.equal(qkv.from_pretrained(tmp_path / name)(ids, pix).logits, ref(ids, pix).logits)


def test_folder_errors_are_clear(tmp_path):
    hf_llava().save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())

    def load_with(**change):
        (tmp_path / "config.json").write_text(json.dumps({**meta, **change}))
        return qkv.from_pretrained(tmp_path)

    with pytest.raises(CheckpointError, match="num_hidden_layers is 3, but .* holds 2 layers"):
        load_with(vision_config={**meta["vision_config"], "num_hidden_layers": 3})
    with pytest.raises(CheckpointError, match="vision_feature_layer 5 is out of range"):
        load_with(vision_feature_layer=5)
    with pytest.raises(CheckpointError, match="lists of layers are not"):
        load_with(vision_feature_layer=[-2, -1])
    with pytest.raises(CheckpointError, match="'siglip_vision_model' is not supported"):
        load_with(vision_config={**meta["vision_config"], "model_type": "siglip_vision_model"})
    with pytest.raises(CheckpointError, match="text_config.hidden_size is 32"):
        load_with(text_config={**meta["text_config"], "hidden_size": 32})


def test_cli_chat_with_an_image_equals_transformers(tmp_path, capsys):
    from PIL import Image

    from qkv.cli.main import main

    folder = llava_folder(tmp_path / "llava")
    image = png(tmp_path / "cat.png")
    assert main(["chat", str(folder), "--image", str(image), "--message", "what is in the picture?",
                 "--max-new-tokens", "6", "--greedy"]) == 0
    answer = capsys.readouterr().out.strip()

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user",
                 "content": [{"type": "image"}, {"type": "text", "text": "what is in the picture?"}]}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    processor = transformers.LlavaProcessor(image_processor=transformers.AutoImageProcessor.from_pretrained(
        folder),
                                            tokenizer=tok, patch_size=8,
                                            vision_feature_select_strategy="default",
                                            num_additional_image_tokens=1)  # the class token, as llava-hf's
    inputs = processor(text=text, images=Image.open(image), return_tensors="pt", add_special_tokens=False)
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(folder).eval()
    out = hf.generate(**inputs, max_new_tokens=6, do_sample=False)
    want = tok.decode(out[0, inputs.input_ids.shape[1]:], skip_special_tokens=True).strip()
    assert answer == want and answer


@pytest.mark.parametrize("image, message", [("missing.png", "no such image file"),
                                            ("bad.png", "not a readable image")])
def test_cli_chat_bad_image_is_a_clear_error(tmp_path, capsys, image, message):
    from qkv.cli.main import main

    (tmp_path / "bad.png").write_bytes(b"not a png")
    rc = main(["chat", str(tmp_path / "no-model-needed"), "--image", str(tmp_path / image),
               "--message", "hi"])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_cli_image_needs_a_vision_folder(tmp_path, capsys):
    from qkv.cli.main import main

    llava_folder(tmp_path / "llava")
    from _llava_folder import save_tokenizer

    text = tmp_path / "text"
    transformers.LlamaForCausalLM(hf_llava().config.text_config).save_pretrained(text)
    save_tokenizer(text)
    rc = main(["chat", str(text), "--image", str(png(tmp_path / "x.png")), "--message", "hi"])
    assert rc == 2 and "--image needs a vision-language model folder" in capsys.readouterr().err
