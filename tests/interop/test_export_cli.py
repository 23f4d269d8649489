"""`qkv export SOURCE OUT`: a real `qkv train` run, qkv folders of GPT-2-, Llama- and Qwen3-shaped GPTs and a
BERT classifier (random weights, saved here) written as Hugging Face folders, then loaded by transformers:
logits against qkv's on the same ids (fp32, 1e-4), AutoTokenizer against qkv's tokenizer (char, word, BPE),
and the refusals (one line, exit status 2, OUT never created)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import qkv
from qkv.cli.main import EXIT_USER_ERROR, main
from qkv.run import load_model_any
from qkv.tasks.tokenizers import BPETokenizer, WordTokenizer, load_tokenizer, save_tokenizer

transformers = pytest.importorskip("transformers")

TINY = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "task.context=16", "train.batch_size=4",
        "train.warmup=1", "eval.n=4", "eval.samples=0", "--no-progress"]
# a special token's name typed as text, a character no vocabulary has, newlines and a tab
SAMPLE = "def f(x):\n\treturn x + 1  # <bos> is five characters here, \u6f22 unknown\n"


@pytest.fixture(scope="module")
def charlm_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "charlm"
    assert main(["train", "charlm", "--out", str(out), "--max-steps", "2", *TINY]) == 0
    return out


def perturbed(model: torch.nn.Module, scale: float = 0.05) -> torch.nn.Module:
    """Norm weights and biases start as constants: random ones make the comparison see every tensor."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model.eval()


def export(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["export", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_same_logits(ours: torch.nn.Module, out: Path, ids: torch.Tensor) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = ours(ids).logits
        torch.testing.assert_close(hf(ids).logits, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


def test_trained_run_exports_as_gpt2_with_its_char_tokenizer(charlm_run, tmp_path, capsys):
    out = tmp_path / "hf"
    code, printed, _ = export(capsys, charlm_run, out)
    assert code == 0
    assert "gpt2" in printed and str(out) in printed
    meta = json.loads((out / "config.json").read_text())
    assert meta["model_type"] == "gpt2"
    assert (meta["pad_token_id"], meta["bos_token_id"], meta["eos_token_id"]) == (0, 1, 2)  # qkv's specials
    ours, tok = load_model_any(charlm_run).eval(), load_tokenizer(charlm_run)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok.encode(SAMPLE)
    assert hf_tok(SAMPLE)["input_ids"] == ids
    assert tok.unk_id in ids and len(ids) == len(SAMPLE)  # one id per character, the unknown one <unk>
    assert hf_tok.decode(ids, skip_special_tokens=True) == tok.decode(ids)
    assert hf_tok.decode([1, *ids[:5], 2]) == tok.decode([1, *ids[:5], 2], skip_special=False)
    n = ours.config.context_length
    assert_same_logits(ours, out, torch.tensor([ids[:n], ids[-n:]]))


def test_hugging_face_folder_is_exported_again_with_its_files(charlm_run, tmp_path, capsys):
    assert export(capsys, charlm_run, tmp_path / "a")[0] == 0
    assert export(capsys, tmp_path / "a", tmp_path / "b")[0] == 0
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "b" / name).read_bytes() == (tmp_path / "a" / name).read_bytes()
    ids = torch.randint(0, 100, (2, 16))
    assert_same_logits(load_model_any(charlm_run), tmp_path / "b", ids)


@pytest.mark.parametrize("shape, model_type", [
    (dict(position="rope", norm="rmsnorm", ffn="swiglu", bias=False, n_heads=4, n_kv_heads=2, d_ff=40,
          tie_embeddings=False), "llama"),
    (dict(position="rope", norm="rmsnorm", ffn="swiglu", bias=False, n_heads=4, n_kv_heads=1, qk_norm=True,
          head_dim=16), "qwen3"),
    (dict(position="rope", norm="rmsnorm", ffn="swiglu", bias=False, n_heads=4, d_ff=32,
          moe={"n_experts": 4, "n_experts_per_tok": 2}), "mixtral"),
    (dict(), "gpt2"),
])
def test_qkv_folder_exports_as_the_type_its_config_is(tmp_path, capsys, shape, model_type):
    ours = perturbed(qkv.build("gpt-nano", vocab_size=50, d_model=48, **shape))
    ours.save_pretrained(tmp_path / "src")
    code, printed, err = export(capsys, tmp_path / "src", tmp_path / "out")
    assert code == 0 and f"Hugging Face {model_type} folder" in printed
    assert "no tokenizer found" in err  # a bare model folder: said, not failed
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == model_type
    assert_same_logits(ours, tmp_path / "out", torch.randint(0, 50, (2, 20)))


def test_dtype_flag_writes_half_weights(tmp_path, capsys):
    qkv.build("gpt-nano").save_pretrained(tmp_path / "src")
    code, printed, _ = export(capsys, tmp_path / "src", tmp_path / "out", "--dtype", "bfloat16")
    assert code == 0 and "bfloat16" in printed
    from safetensors import safe_open

    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


@pytest.mark.parametrize("make", ["word", "bpe"])
def test_word_and_bpe_tokenizers_encode_and_decode_as_qkv(tmp_path, capsys, make):
    text = "[MAX 2 9 ]\x1c[MIN 3\u3000 4 ] 12 <eos> x"  # \x1c: whitespace to Python's str.split, not Rust's
    tok = (WordTokenizer.from_text("[MAX 2 9 ] [MIN 3 4 ] <eos>x") if make == "word"
           else BPETokenizer.train([text * 3, "more text 123"], vocab_size=280, min_frequency=1))
    ours = qkv.build("gpt-nano", vocab_size=tok.vocab_size)
    ours.save_pretrained(tmp_path / "src")
    save_tokenizer(tok, tmp_path / "src")
    assert export(capsys, tmp_path / "src", tmp_path / "out")[0] == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    ids = tok.encode(text)
    assert hf_tok(text)["input_ids"] == ids
    assert hf_tok.decode(ids, skip_special_tokens=True) == tok.decode(ids)


# strings a tokenizer port gets wrong: nothing, only spaces, CR LF, a combining accent (two code points),
# an ideographic space (whitespace to Python, not ASCII), an emoji (four UTF-8 bytes) and a character no
# vocabulary here has
TRICKY = ["", "   ", "a\r\nb", "cafe\u0301 e\u0301", "a\u3000b", "ok \U0001f600!", "\u6f22 x"]


@pytest.fixture(scope="module")
def exported_tokenizers(tmp_path_factory) -> dict:
    """qkv's char, word and BPE tokenizers, each exported with a model, and transformers' reading of them."""
    from qkv.tasks.tokenizers import CharTokenizer

    corpus = "def f(x): return x + 1\n a b cafe ok! \r\n"
    made = {"char": CharTokenizer.from_text(corpus), "word": WordTokenizer.from_text(corpus),
            "bpe": BPETokenizer.train([corpus * 3, "more text 123"], vocab_size=280, min_frequency=1)}
    found = {}
    for kind, tok in made.items():
        root = tmp_path_factory.mktemp(kind)
        qkv.build("gpt-nano", vocab_size=tok.vocab_size).save_pretrained(root / "src")
        save_tokenizer(tok, root / "src")
        assert main(["export", str(root / "src"), str(root / "out")]) == 0
        found[kind] = (tok, transformers.AutoTokenizer.from_pretrained(root / "out"))
    return found


@pytest.mark.parametrize("kind", ["char", "word", "bpe"])
@pytest.mark.parametrize("text", TRICKY)
def test_tricky_strings_encode_and_decode_as_qkv(exported_tokenizers, kind, text):
    tok, hf_tok = exported_tokenizers[kind]
    ids = tok.encode(text)
    assert hf_tok(text)["input_ids"] == ids
    assert hf_tok.decode(ids, skip_special_tokens=True) == tok.decode(ids)


def test_bert_classifier_exports_as_bert(tmp_path, capsys):
    ours = perturbed(qkv.build("bert-tiny", vocab_size=60, n_layers=2, d_model=32, head="classify",
                               num_labels=3))
    ours.save_pretrained(tmp_path / "src")
    assert export(capsys, tmp_path / "src", tmp_path / "out")[0] == 0
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    assert type(hf).__name__ == "BertForSequenceClassification"
    ids = torch.randint(0, 60, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids).logits, rtol=1e-4, atol=1e-5)


def one_line_error(capsys, *args: str) -> str:
    code, _, err = export(capsys, *args)
    assert code == EXIT_USER_ERROR
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qkv: error: "), err
    return lines[0]


@pytest.mark.parametrize("shape, named", [
    (dict(position="alibi"), "position='alibi'"),
    (dict(placement="post"), "placement='post'"),
    (dict(position="rope", norm="rmsnorm", ffn="gelu"), "ffn='gelu'"),
])
def test_config_no_format_holds_is_refused_and_writes_nothing(tmp_path, capsys, shape, named):
    qkv.build("gpt-nano", **shape).save_pretrained(tmp_path / "src")
    assert named in one_line_error(capsys, tmp_path / "src", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # neither OUT nor its staging folder
    # an OUT whose parents do not exist yet: the folders made for it go too
    assert named in one_line_error(capsys, tmp_path / "src", tmp_path / "a" / "b" / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_pre_ln_bert_is_refused(tmp_path, capsys):
    qkv.build("bert-tiny", head="classify", placement="pre").save_pretrained(tmp_path / "src")
    assert "placement='pre'" in one_line_error(capsys, tmp_path / "src", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_paths_are_checked(tmp_path, capsys):
    assert "no such run or model folder" in one_line_error(capsys, tmp_path / "missing", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    qkv.build("gpt-nano").save_pretrained(tmp_path / "src")
    assert "must be a new folder" in one_line_error(capsys, tmp_path / "src", tmp_path / "src")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert "--force" in one_line_error(capsys, tmp_path / "src", tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    assert export(capsys, tmp_path / "src", tmp_path / "out", "--force")[0] == 0
    assert not (tmp_path / "out" / "keep.txt").exists() and (tmp_path / "out" / "config.json").is_file()


def test_model_type_must_fit_the_model(tmp_path, capsys):
    qkv.build("gpt-nano").save_pretrained(tmp_path / "src")
    assert "cannot be written as 'bert'" in one_line_error(capsys, tmp_path / "src", tmp_path / "out",
                                                           "--model-type", "bert")
    assert "'t5'" in one_line_error(capsys, tmp_path / "src", tmp_path / "out", "--model-type", "t5")
    # a GPT-2-shaped model is no Llama: the exporter's refusal names what differs
    assert "position='learned'" in one_line_error(capsys, tmp_path / "src", tmp_path / "out", "--model-type",
                                                  "llama")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("preset, fields", [
    ("vit-digits", dict(n_layers=1, pooling="cls", dropout=0.0)),
    ("resnet-18", dict(depths=[1, 1], widths=[8, 16], stem_width=8, num_labels=3)),
])
def test_image_classifier_exports_with_its_preprocessing(tmp_path, capsys, preset, fields):
    ours = perturbed(qkv.build(preset, **fields))
    ours.save_pretrained(tmp_path / "src")
    code, printed, err = export(capsys, tmp_path / "src", tmp_path / "out")
    assert code == 0 and "no tokenizer found" not in err
    assert (tmp_path / "out" / "preprocessor_config.json").is_file()
    hf = transformers.AutoModelForImageClassification.from_pretrained(tmp_path / "out").eval()
    size = getattr(ours.config, "image_size", 32)
    x = torch.randn(2, ours.config.n_channels, size, size)
    with torch.no_grad():
        ref = ours(x).logits
        torch.testing.assert_close(hf(x).logits, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


def test_mean_pooled_vit_is_refused(tmp_path, capsys):
    qkv.build("vit-digits", n_layers=1).save_pretrained(tmp_path / "src")
    assert "pooling='mean'" in one_line_error(capsys, tmp_path / "src", tmp_path / "out")
    assert not (tmp_path / "out").exists()
