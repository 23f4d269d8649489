"""The explorer on the other kinds qkv loads: an encoder (BERT), an image model (ViT, patches over the
picture), an audio encoder-decoder (Whisper, a WAV upload); the frame pooling that keeps audio maps small."""

from __future__ import annotations

import base64
import io
import wave

import numpy as np
import pytest
import torch

import qkv
from qkv.explore.analysis import pool


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for preset in ("vit-digits", "bert-tiny", "whisper-digits"):
        torch.manual_seed(0)
        out[preset] = qkv.build(preset).save_pretrained(tmp_path_factory.mktemp(preset))
    return out


def _rows_sum_to_one(m):
    for row in m:
        assert sum(row) == pytest.approx(1.0, abs=1e-3)


def test_encoder_attention_is_bidirectional(folders, clients):
    c = clients(folders["bert-tiny"])
    assert c.get("/api/info").json()["can_generate"] is False
    [view] = c.post("/api/analyze", json={"input": "5 6 7 8 9"}).json()["views"]
    assert not view["causal"]
    for m in (m for heads in view["layers"] for m in heads):
        _rows_sum_to_one(m)
        assert m[0][4] > 0  # the first token sees the last one
    r = c.post("/api/generate", json={"input": "5 6"})
    assert r.status_code == 400 and "does not generate" in r.json()["error"]


def test_vit_patches_over_the_image(folders, clients):
    from sklearn.datasets import load_digits

    c = clients(folders["vit-digits"])
    data = c.post("/api/analyze", json={"image": 3}).json()
    cfg = qkv.from_pretrained(folders["vit-digits"]).config
    n = cfg.grid ** 2  # mean pooling: no class token
    assert data["tokens"]["input"] == [f"{r},{q}" for r in range(cfg.grid) for q in range(cfg.grid)]
    im = data["image"]
    assert im["grid"] == [cfg.grid, cfg.grid] and im["cls"] is False and "digit 3" in im["caption"]
    pixels = np.array(im["pixels"])  # (H, W, 3), min-max scaled for display
    assert pixels.shape == (cfg.image_size, cfg.image_size, 3)
    digit = load_digits().images[3]  # 8x8 at the model's 8x8 size: the same picture, scaled to [0, 1]
    assert np.allclose(pixels[..., 0], (digit - digit.min()) / (digit.max() - digit.min()), atol=1e-3)
    for m in (m for heads in data["views"][0]["layers"] for m in heads):
        assert len(m) == n
        _rows_sum_to_one(m)
    assert c.post("/api/analyze", json={"image": 99}).status_code == 400
    enc = c.get("/api/positions").json()["encodings"]
    assert enc[0]["where"] == "patches" and enc[0]["grid"] == [cfg.grid, cfg.grid]


def _wav(seconds: float, rate: int = 8000) -> str:
    t = np.arange(int(seconds * rate)) / rate
    x = (0.3 * np.sin(2 * np.pi * 697 * t) * 32767).astype(np.int16)
    b = io.BytesIO()
    with wave.open(b, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)  # resampled to the model's 16 kHz
        w.writeframes(x.tobytes())
    return base64.b64encode(b.getvalue()).decode()


def test_whisper_wav_upload_three_views_and_generation(folders, clients):
    c = clients(folders["whisper-digits"])
    data = c.post("/api/analyze", json={"wav": _wav(0.5), "target": "3 4"}).json()
    assert [v["name"] for v in data["views"]] == ["encoder self", "decoder self", "cross"]
    assert data["audio"]["seconds"] == pytest.approx(0.5) and data["audio"]["frames"] == 100
    assert data["tokens"]["target"] == ["1", "3", "4"]  # <bos> = id 1, then the typed target ids
    enc, dec, cross = data["views"]
    assert len(enc["layers"][0][0]) == 100 and len(cross["layers"][0][0][0]) == 100
    for v in (enc, dec, cross):
        for m in (m for heads in v["layers"] for m in heads):
            _rows_sum_to_one(m)
    g = c.post("/api/generate", json={"wav": _wav(0.5), "max_new_tokens": 3}).json()
    assert len(g["steps"]) == 3 and len(g["steps"][0]["rows"]["cross"][0][0]) == 100
    r = c.post("/api/analyze", json={"wav": _wav(3.0)})  # the window is 2 s
    assert r.status_code == 400 and "window" in r.json()["error"]
    r = c.post("/api/analyze", json={"wav": base64.b64encode(b"not a wav").decode()})
    assert r.status_code == 400 and "WAV" in r.json()["error"]


def test_pool_keeps_rows_stochastic_and_sums_key_bins():
    w = torch.rand(2, 6, 9).softmax(-1).double()
    p = pool(w, 3, 3)
    assert p.shape == (2, 3, 3)
    torch.testing.assert_close(p.sum(-1), torch.ones(2, 3, dtype=torch.float64))
    # bin (0, 0): mean over queries 0-1 of the summed keys 0-2
    torch.testing.assert_close(p[0, 0, 0], w[0, 0:2, 0:3].sum(-1).mean())
    torch.testing.assert_close(pool(w, 6, 9), w)


def test_dtmf_run_renders_typed_digits(tmp_path_factory, clients):
    from qkv.run import load_run_config, train_run

    out = tmp_path_factory.mktemp("explore") / "dtmf"
    cfg = load_run_config("whisper_dtmf", ["train.max_steps=1", "train.batch_size=2", "train.progress=false",
                                           "eval.n=2", "eval.samples=0", "train.save_every=0"])
    train_run(cfg, out=out)
    c = clients(out)
    info = c.get("/api/info").json()
    assert info["kind"] == "audio" and info["renders_text"] is True
    data = c.post("/api/analyze", json={"input": "4096", "target": "4096"}).json()
    assert "'4096' rendered by the task" in data["audio"]["caption"]
    assert data["tokens"]["target"] == ["<bos>", "4", "0", "9", "6"]
    r = c.post("/api/analyze", json={"input": "12x"})
    assert r.status_code == 400 and "'x'" in r.json()["error"]
    # more digits than the clip holds were cut silently (their tones never reached the model): refused, as a
    # long WAV
    r = c.post("/api/analyze", json={"input": "9" * 40})
    assert (r.status_code == 400
            and "40 digits: type at most 4 (the task's max_digits" in r.json()["error"]), r.text


def test_export_of_image_and_audio_models(folders, tmp_path, capsys):
    import json

    from qkv.cli.main import main

    def exported(path):
        html = path.read_text(encoding="utf-8")
        start = html.index("window.QKV_EXPORT = ") + len("window.QKV_EXPORT = ")
        return json.loads(html[start: html.index(";</script>", start)].replace("<\\/", "</"))

    assert main(["explore", str(folders["vit-digits"]), "--input", "7", "--export",
                 str(tmp_path / "vit.html")]) == 0
    data = exported(tmp_path / "vit.html")
    assert "digit 7" in data["analysis"]["image"]["caption"] and data["generation"] is None
    wav = tmp_path / "a.wav"
    wav.write_bytes(base64.b64decode(_wav(0.4)))
    assert main(["explore", str(folders["whisper-digits"]), "--wav", str(wav), "--export",
                 str(tmp_path / "w.html")]) == 0
    data = exported(tmp_path / "w.html")
    assert (data["analysis"]["audio"]["seconds"] == pytest.approx(0.4)
            and len(data["generation"]["steps"]) >= 1)
    assert main(["explore", str(folders["vit-digits"]), "--input", "cat", "--export",
                 str(tmp_path / "x.html")]) == 2
    assert "index of a built-in image" in capsys.readouterr().err


def test_hf_vit_folder_maps_equal_transformers(tmp_path, clients):
    """A Hugging Face ViT folder with its preprocessor_config.json: the explorer normalises the built-in
    image as the folder says, and its maps equal transformers' eager attentions on the same pixels."""
    import json

    import torch.nn.functional as F
    from sklearn.datasets import load_digits

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                                 num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=64, num_labels=10)
    hf = transformers.ViTForImageClassification(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    hf.save_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"do_normalize": True, "image_mean": [0.5, 0.4, 0.3], "image_std": [0.5, 0.25, 0.2]}))
    data = clients(tmp_path).post("/api/analyze", json={"image": 4}).json()
    assert len(data["tokens"]["input"]) == 1 + 16 and data["tokens"]["input"][0] == "CLS"
    x = torch.from_numpy(load_digits().images[4] / 16.0).float()[None, None]
    x = F.interpolate(x, size=(16, 16), mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
    x = (x - torch.tensor([0.5, 0.4, 0.3]).view(1, 3, 1, 1)) / torch.tensor([0.5, 0.25, 0.2]).view(1, 3, 1, 1)
    hf = transformers.ViTForImageClassification.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(pixel_values=x, output_attentions=True)
    got = torch.tensor(data["views"][0]["layers"], dtype=torch.float64)
    torch.testing.assert_close(got, torch.stack([a[0] for a in ref.attentions]).double(), atol=2e-5, rtol=0)
    assert data["image"]["prediction"] == int(ref.logits.argmax())
