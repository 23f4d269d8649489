"""GGUF files (llama.cpp) into qkv: tiny random Llama / Mistral / Qwen2 / Qwen3 models written here as
convert_hf_to_gguf.py writes them (tests/interop/_gguf_files.py), in F32, F16, BF16, Q8_0, Q4_0, Q4_K and
Q6_K.

References: the Hugging Face model run on the weights the file holds (its float values after the type's round
trip, in HF's layout: no un-permute of ours involved), transformers' own GGUF loader
(`from_pretrained(dir, gguf_file=...)`, which dequantizes with its own torch code) and tokenizer, and the
SentencePiece model the vocabulary came from."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.generate import generate
from qkv.storage import CheckpointError

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
from _gguf_files import Q, bpe_vocab, spm_vocab, write_gguf  # noqa: E402

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.3)
# name: (config class, GGUF architecture, vocabulary, fields)
CASES = {
    "llama-spm-untied": ("LlamaConfig", "llama", "spm", dict(tie_word_embeddings=False, rope_theta=500.0)),
    "qwen2-bpe-bias-tied": ("Qwen2Config", "qwen2", "bpe", dict(tie_word_embeddings=True, rope_theta=1e6)),
    "mistral-spm-gqa": ("MistralConfig", "llama", "spm",
                        dict(tie_word_embeddings=False, sliding_window=None)),
    "llama3-bpe-ropefreqs-mqa": ("LlamaConfig", "llama", "bpe", dict(
        tie_word_embeddings=True, num_key_value_heads=1, head_dim=16,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}, rope_theta=500000.0)),  # all three bands
    "llama-spm-linear-rope": ("LlamaConfig", "llama", "spm", dict(
        tie_word_embeddings=False, num_attention_heads=8, num_key_value_heads=8,
        rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "qwen3-bpe-qknorm": ("Qwen3Config", "qwen3", "bpe", dict(tie_word_embeddings=True, head_dim=16)),
    # K-quants work on rows of 256: a wider model
    "llama-spm-wide": ("LlamaConfig", "llama", "spm", dict(hidden_size=256, intermediate_size=256,
                                                           num_hidden_layers=1, tie_word_embeddings=False)),
}
MODEL = {"LlamaConfig": "LlamaForCausalLM", "Qwen2Config": "Qwen2ForCausalLM",
         "MistralConfig": "MistralForCausalLM", "Qwen3Config": "Qwen3ForCausalLM"}


@pytest.fixture(scope="module")
def vocabs(tmp_path_factory):
    return {"bpe": bpe_vocab(), "spm": spm_vocab(tmp_path_factory.mktemp("spm"))}


def build(vocabs, tmp_path, case: str, qtype=Q.F32, seed: int = 0, **write):
    """(path of the GGUF file, the HF model holding the weights the file holds)."""
    cls, arch, vocab, fields = CASES[case]
    v = vocabs[vocab]
    config = getattr(transformers, cls)(**{**BASE, **fields, "vocab_size": len(v["tokens"]),
                                           "bos_token_id": v["bos"], "eos_token_id": v["eos"]})
    torch.manual_seed(seed)
    hf = getattr(transformers, MODEL[cls])(config).eval()
    with torch.no_grad():  # HF initialises biases and norms to constants: random, so they are tested
        for n, p in hf.named_parameters():
            if n.endswith(".bias") or "norm" in n:
                p.add_(torch.randn_like(p) * 0.2)
    path = tmp_path / f"{case}-{qtype.name}.gguf"
    ref = write_gguf(path, hf, arch, v, qtype, seed=seed, **write)
    if config.tie_word_embeddings:
        ref["lm_head.weight"] = ref["model.embed_tokens.weight"]
    hf.load_state_dict(ref)
    return path, hf


def assert_logits_equal(ours, hf, vocab_size: int, rtol: float = 1e-5) -> None:
    ids = torch.randint(0, vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        got = ours(ids).logits.float()
    assert want.std() > 0.3  # logits spread enough for the comparison to mean something
    err = (got - want).abs().max().item()
    assert err <= rtol * want.abs().max().item() + 1e-6, err


@pytest.mark.parametrize("case", [c for c in CASES if c != "llama-spm-wide"])
def test_f32_logits_and_16_greedy_tokens_equal_transformers(vocabs, tmp_path, case):
    path, hf = build(vocabs, tmp_path, case)
    ours = qkv.from_pretrained(path)
    assert next(ours.parameters()).dtype == torch.float32  # an F32 file keeps its type
    assert_logits_equal(ours, hf, hf.config.vocab_size)
    prompt = torch.tensor([[5, 17, 42, 99, 7]])
    with torch.no_grad():
        want = hf.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    got = generate(ours, prompt, max_new_tokens=20, min_new_tokens=20)
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0])
@pytest.mark.parametrize("case", ["llama-spm-untied", "qwen2-bpe-bias-tied"])
def test_quantized_files_equal_transformers_on_the_same_weights(vocabs, tmp_path, case, qtype):
    path, hf = build(vocabs, tmp_path, case, qtype)
    ours = qkv.from_pretrained(path, dtype=torch.float32)
    assert_logits_equal(ours, hf, hf.config.vocab_size)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K])
def test_k_quants_equal_transformers_own_gguf_loader(vocabs, tmp_path, qtype):
    """K-quant blocks (random, with sane scales) dequantized by gguf and un-permuted by us, against
    transformers' own torch dequantization and un-permute of the same file, and against the HF model given
    gguf's values."""
    path, hf = build(vocabs, tmp_path, "llama-spm-wide", qtype)
    ours = qkv.from_pretrained(path, dtype=torch.float32)
    assert_logits_equal(ours, hf, hf.config.vocab_size)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                               dtype=torch.float32).eval()
    assert_logits_equal(ours, theirs, hf.config.vocab_size)


@pytest.mark.parametrize("case", ["llama-spm-untied", "qwen2-bpe-bias-tied"])
def test_transformers_gguf_loader_agrees(vocabs, tmp_path, case):
    path, _ = build(vocabs, tmp_path, case, Q.Q8_0)
    ours = qkv.from_pretrained(path, dtype=torch.float32)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                               dtype=torch.float32).eval()
    assert_logits_equal(ours, theirs, ours.config.vocab_size)


@pytest.mark.parametrize("qtype, dtype",
                         [(Q.F32, torch.float32), (Q.F16, torch.float16), (Q.BF16, torch.bfloat16),
                                          (Q.Q8_0, torch.bfloat16)])
def test_dtype_follows_the_file_or_the_caller(vocabs, tmp_path, qtype, dtype):
    path, hf = build(vocabs, tmp_path, "qwen2-bpe-bias-tied", qtype)
    ours = qkv.from_pretrained(path)
    assert {p.dtype for p in ours.parameters()} == {dtype}
    assert ours.lm_head.weight is ours.tok_emb.weight  # the tied head stays tied
    assert ours.generation_defaults()["eos_token_id"] == hf.config.eos_token_id
    if qtype == Q.F16:
        assert torch.equal(ours.tok_emb.weight, hf.model.embed_tokens.weight.half())


TEXTS = ["Hello world, this is a test.", "  two  spaces\n\nand newlines\t tab", "café naïve Ünïcödé 12345",
         "emoji 😀 and ∑ symbols outside the vocabulary", "<|im_start|>user\nhi<|im_end|>",
         "<s>[INST] hi [/INST]", "", " leading space"]


@pytest.mark.parametrize("case", ["llama-spm-untied", "qwen2-bpe-bias-tied", "llama3-bpe-ropefreqs-mqa"])
def test_tokenizer_equals_transformers_gguf_tokenizer(vocabs, tmp_path, case):
    from qkv.interop.gguf_tokenizer import load_gguf_tokenizer

    path, _ = build(vocabs, tmp_path, case)
    ours = load_gguf_tokenizer(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"], text
        assert ours.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False)["input_ids"]
        for skip in (False, True):
            assert (ours.decode(ids, skip_special_tokens=skip)
                    == ref.decode(ids, skip_special_tokens=skip)), text
    assert (ours.bos_token, ours.eos_token) == (ref.bos_token, ref.eos_token)
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Bye"}]
    assert ours.has_chat_template
    want = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == want
    assert ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=True) == \
        ref(want, add_special_tokens=False)["input_ids"]


def test_sentencepiece_vocabulary_encodes_as_sentencepiece(vocabs, tmp_path):
    """The merges rebuilt from a SentencePiece vocabulary's scores segment text as SentencePiece itself does.
    (Text that starts with a space is left out: SentencePiece and llama.cpp prefix one more "▁" to it than
    transformers' Metaspace does, and qkv follows transformers there.)"""
    import sentencepiece as spm

    from qkv.interop.gguf_tokenizer import load_gguf_tokenizer

    path, _ = build(vocabs, tmp_path, "llama-spm-untied")
    ours = load_gguf_tokenizer(path)
    sp = spm.SentencePieceProcessor(model_file=vocabs["spm"]["model_file"])
    for text in [t for t in TEXTS if t and not t.startswith(" ") and "<" not in t]:
        assert ours.encode(text) == [1, *sp.encode(text)], text
        assert ours.decode(ours.encode(text), skip_special_tokens=True) == sp.decode(sp.encode(text))


def test_chat_stops_on_the_templates_end_of_turn(vocabs, tmp_path):
    from qkv.interop.gguf_tokenizer import load_gguf_tokenizer

    path, _ = build(vocabs, tmp_path, "qwen2-bpe-bias-tied")
    tok = load_gguf_tokenizer(path)
    assert tok.token_to_id("<|im_end|>") in tok.end_of_turn_ids
    # kept whole
    assert tok.encode("<|im_start|>", add_special_tokens=False) == [tok.token_to_id("<|im_start|>")]


@pytest.mark.parametrize("case, qtype",
                         [("qwen2-bpe-bias-tied", Q.Q8_0), ("llama3-bpe-ropefreqs-mqa", Q.BF16),
                                         ("llama-spm-untied", Q.F16)])
def test_header_reads_as_ggufs_own_reader(vocabs, tmp_path, case, qtype):
    """qkv's header parser (gguf_header.py) against gguf.GGUFReader: every metadata value, every tensor's
    shape, type and bytes."""
    import numpy as np

    from qkv.interop.gguf_model import GGUFFile

    path, _ = build(vocabs, tmp_path, case, qtype)
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    want = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.meta.keys() == want.keys()
    for key, value in want.items():
        assert (ours.meta[key] == pytest.approx(value) if isinstance(value, float)
                else ours.meta[key] == value), key
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert (mine.shape, mine.ggml_type) == (tuple(reversed(t.shape.tolist())), int(t.tensor_type))
        raw = np.frombuffer(ours._buf, dtype=np.uint8, count=ours.nbytes(mine), offset=mine.start)
        assert raw.tobytes() == t.data.tobytes(), t.name


# -- bad input ---------------------------------------------------------------------------------------------
def test_truncated_and_foreign_files_are_clear_errors(vocabs, tmp_path):
    path, _ = build(vocabs, tmp_path, "qwen2-bpe-bias-tied")
    data = path.read_bytes()
    for n, cut in enumerate((2000, len(data) - 1000)):
        bad = tmp_path / f"cut{n}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="not a readable GGUF file, truncated or corrupt"):
            qkv.from_pretrained(bad)
    fake = tmp_path / "fake.gguf"
    fake.write_text("not gguf")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        qkv.from_pretrained(fake)


def test_unknown_architecture_tensor_type_and_missing_tensor_are_named(vocabs, tmp_path):
    path, _ = build(vocabs, tmp_path, "llama-spm-untied")
    # general.architecture = "llama" -> "gemma" (as long, so the file stays well formed): a real one qkv lacks
    key = b"general.architecture\x08\x00\x00\x00\x05" + b"\x00" * 7
    gemma = tmp_path / "gemma.gguf"
    gemma.write_bytes(path.read_bytes().replace(key + b"llama", key + b"gemma"))
    assert gemma.read_bytes() != path.read_bytes()
    with pytest.raises(CheckpointError, match="GGUF architecture 'gemma' is not supported; supported: "):
        qkv.from_pretrained(gemma)

    missing = tmp_path / "missing"
    missing.mkdir()
    path, _ = build(vocabs, missing, "llama-spm-untied", skip=("blk.1.ffn_up.weight",))
    with pytest.raises(CheckpointError, match=r"missing tensor 'blk\.1\.ffn_up\.weight'"):
        qkv.from_pretrained(path)


def test_unreadable_tensor_type_is_named(vocabs, tmp_path, monkeypatch):
    from qkv.interop import gguf_model

    path, _ = build(vocabs, tmp_path, "llama-spm-untied")
    f = gguf_model.GGUFFile(path)
    t = f.tensors["blk.0.attn_q.weight"]
    f.tensors["blk.0.attn_q.weight"] = t._replace(ggml_type=int(gguf.GGMLQuantizationType.F64))
    with pytest.raises(CheckpointError,
                       match=r"tensor 'blk\.0\.attn_q\.weight' has type F64, which qkv does not read"):
        gguf_model.GGUFTensors(f, gguf_model.hf_config(f), torch.float32)


def test_missing_gguf_package_says_how_to_install(vocabs, tmp_path, monkeypatch):
    import sys

    path, _ = build(vocabs, tmp_path, "llama-spm-untied")
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(CheckpointError, match=r"pip install qkv\[gguf\]"):
        qkv.from_pretrained(path)


# -- the commands ------------------------------------------------------------------------------------------
def test_cli_generate_info_and_errors_take_a_gguf_file(vocabs, tmp_path, capsys):
    from qkv.cli.main import main
    from qkv.interop.gguf_tokenizer import load_gguf_tokenizer

    # F32: loaded as float32, comparable to transformers
    path, hf = build(vocabs, tmp_path, "llama-spm-untied")
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    prompt = "Hello world"
    ids = ref(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        want = hf.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert load_gguf_tokenizer(path).encode(prompt) == ids[0].tolist()
    want_text = prompt + ref.decode(want[0, ids.shape[1]:], skip_special_tokens=True)
    flags = ["--prompt", prompt, "--greedy", "--max-new-tokens", "16", "--min-new-tokens", "16"]
    assert main(["generate", str(path), *flags]) == 0
    assert capsys.readouterr().out == want_text + "\n"

    assert main(["info", str(path)]) == 0
    assert "GGUF llama file, float32" in capsys.readouterr().out

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(path.read_bytes()[:5000])
    assert main(["generate", str(bad), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv: error: ") and "truncated or corrupt" in err and len(err.splitlines()) == 1


def test_serve_chat_and_explore_load_a_gguf_file(vocabs, tmp_path):
    from qkv.chat import ChatSession
    from qkv.explore.adapter import load
    from qkv.serve.model import load_served

    path, _ = build(vocabs, tmp_path, "qwen2-bpe-bias-tied")
    served = load_served(path)
    im_end = served.codec.tokenizer.token_to_id("<|im_end|>")
    assert (im_end in served.codec.eos_ids
            and served.codec.encode("Hello") == served.codec.tokenizer.encode("Hello"))
    session = ChatSession.from_folder(path)
    assert session.templated and session.tokenizer.token_to_id("<|im_end|>") in session.stop_ids
    loaded = load(path)
    assert loaded.kind == "decoder" and loaded.tokenizer.encode("Hello") == served.codec.encode("Hello") != []


def test_dtype_keyword_casts_a_folder_too(vocabs, tmp_path):
    """from_pretrained(..., dtype=) is not GGUF-only: a Hugging Face folder is loaded, then cast."""
    _, hf = build(vocabs, tmp_path, "qwen2-bpe-bias-tied")
    hf.save_pretrained(tmp_path / "folder")
    model = qkv.from_pretrained(tmp_path / "folder", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
