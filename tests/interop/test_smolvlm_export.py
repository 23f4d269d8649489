"""qkv's Idefics3 / SmolVLM export (qkv.interop.smolvlm) on tiny random-weight folders: the written folder
loads in transformers (AutoModelForImageTextToText, the family class) with qkv's logits, loads back in qkv
equal, holds the source's tensors bit for bit (the model was loaded from it unchanged), keeps the processor,
tokenizer and chat template; the llava export through the same writer; refusals."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import qkv
from qkv.interop.llava import canonical_key, export_llava
from qkv.interop.smolvlm import export_idefics3
from qkv.storage import CheckpointError

sys.path.insert(0, str(Path(__file__).parent))
from _llava_folder import llava_folder, png  # noqa: E402
from _smolvlm_folder import IMAGE_TOKEN_ID, hf_idefics3, smolvlm_folder  # noqa: E402

transformers = pytest.importorskip("transformers")


def _prompt(n_image_tokens: int) -> torch.Tensor:
    text = torch.randint(3, 100, (1, 9), generator=torch.Generator().manual_seed(0))
    return torch.cat([text[:, :2], torch.full((1, n_image_tokens), IMAGE_TOKEN_ID), text[:, 2:]], dim=1)


def _tiles(n: int, size: int = 32) -> torch.Tensor:
    return torch.randn(1, n, 3, size, size, generator=torch.Generator().manual_seed(1))


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool((got - want).abs().max() <= 1e-4 * want.abs().max())


def _hf(folder: Path):
    hf, info = transformers.AutoModelForImageTextToText.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return hf.eval()


@pytest.mark.parametrize("kind, tie", [("idefics3", False), ("smolvlm", True)])
def test_export_loads_in_transformers_and_qkv_with_equal_logits(tmp_path, kind, tie):
    source = smolvlm_folder(tmp_path / "source", kind=kind, tie=tie)
    (source / "finetune.json").write_text("{}")  # a run's record: not a file of the model, not carried
    ours = qkv.from_pretrained(source)
    with torch.no_grad():  # the export must carry the model's weights, not the source's
        ours.projector.proj.weight.mul_(1.5)
        ours.vision.encoder.blocks[1].attn.qkv_proj.bias.add_(0.1)
        ours.language_model.decoder.blocks[0].attn.qkv_proj.weight.mul_(0.9)
    out = export_idefics3(ours, tmp_path / "out", model_type=kind, source=source)
    hf = _hf(out)
    assert type(hf).__name__ == {"idefics3": "Idefics3", "smolvlm": "SmolVLM"}[kind] + \
        "ForConditionalGeneration"
    back = qkv.from_pretrained(out)
    ids, pix = _prompt(3 * 4), _tiles(3)
    with torch.no_grad():
        want = ours(ids, pix[0]).logits
        assert _close(hf(input_ids=ids, pixel_values=pix).logits, want)
        assert torch.equal(back(ids, pix[0]).logits, want)
    for name in ("processor_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    assert not (out / "finetune.json").exists()
    processor = transformers.AutoProcessor.from_pretrained(out)
    assert type(processor).__name__ == "Idefics3Processor" and processor.image_seq_len == 4


@pytest.mark.parametrize("kind", ["idefics3", "smolvlm"])
def test_an_unchanged_model_exports_the_source_tensors_bit_for_bit(tmp_path, kind):
    source = smolvlm_folder(tmp_path / "source", kind=kind)
    out = export_idefics3(qkv.from_pretrained(source), tmp_path / "out", model_type=kind, source=source)
    want, got = load_file(source / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_grid_whose_position_lookup_skips_rows(tmp_path):
    """25 x 25 patches: Idefics3's bucketed lookup reads some table rows twice and others never. With the
    source those rows come from it (bit for bit); without, the export still computes the same logits."""
    hf = hf_idefics3(image_size=50, patch_size=2, scale_factor=5)
    hf.save_pretrained(tmp_path / "source")
    ours = qkv.from_pretrained(tmp_path / "source")
    with_source = export_idefics3(ours, tmp_path / "a", source=tmp_path / "source")
    key = "model.vision_model.embeddings.position_embedding.weight"
    assert torch.equal(load_file(with_source / "model.safetensors")[key],
                       load_file(tmp_path / "source" / "model.safetensors")[key])
    alone = export_idefics3(ours, tmp_path / "b")
    assert not (alone / "tokenizer.json").exists()
    ids, pix = _prompt(25), _tiles(1, size=50)
    with torch.no_grad():
        assert _close(_hf(alone)(input_ids=ids, pixel_values=pix).logits, ours(ids, pix[0]).logits)


def test_bf16_export_keeps_the_dtype(tmp_path):
    hf = hf_idefics3("smolvlm").to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "source")
    ours = qkv.from_pretrained(tmp_path / "source")
    out = export_idefics3(ours, tmp_path / "out", model_type="smolvlm")
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.bfloat16}
    assert qkv.from_pretrained(out).language_model.lm_head.weight.dtype == torch.bfloat16


def test_llava_export_through_the_same_writer(tmp_path):
    source = llava_folder(tmp_path / "source")
    ours = qkv.from_pretrained(source)
    out = export_llava(ours, tmp_path / "out", source)
    # the source may be in the 4.x key layout, the export is in 5.x's: compared under one naming
    want, got = ({canonical_key(k): t for k, t in load_file(f / "model.safetensors").items()}
                 for f in (source, out))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert (out / "preprocessor_config.json").is_file() and (out / "tokenizer.json").is_file()
    assert type(_hf(out)).__name__ == "LlavaForConditionalGeneration"


def test_refusals(tmp_path):
    llava = qkv.from_pretrained(llava_folder(tmp_path / "llava"))
    with pytest.raises(CheckpointError, match="only Idefics3-shaped models"):
        export_idefics3(llava, tmp_path / "a")
    hf_idefics3().save_pretrained(tmp_path / "source")
    with pytest.raises(CheckpointError, match="cannot export to model_type 'llava'"):
        export_idefics3(qkv.from_pretrained(tmp_path / "source"), tmp_path / "b", model_type="llava")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_exported_folder_chats_like_the_source(tmp_path, capsys):
    """qkv chat --image on the export answers as on the source (processor files carried over)."""
    from qkv.cli.main import main

    source = smolvlm_folder(tmp_path / "source", kind="smolvlm")
    out = export_idefics3(qkv.from_pretrained(source), tmp_path / "out", model_type="smolvlm", source=source)
    image = png(tmp_path / "x.png", size=(40, 70))
    answers = []
    for folder in (source, out):
        assert main(["chat", str(folder), "--image", str(image), "--message", "what is in the picture?",
                     "--max-new-tokens", "6", "--greedy"]) == 0
        answers.append(capsys.readouterr().out)
    assert answers[0] == answers[1] and answers[0].strip()
