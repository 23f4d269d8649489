"""The generic Hugging Face loaders stream: a safetensors folder is never read whole (safetensors' load_file
is not called), every tensor of the file is read at most once, and the model is built with its parameters on
the meta device (no random fp32 model first) while the buffers its constructor computes stay real. Plus the
checks the streaming path must keep: tied copies a file stores, and HFTensors itself (names without
reading)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import safetensors
import safetensors.torch
import torch
from _seq2seq_models import V, bart, marian, t5
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

import qkv  # noqa: E402
from qkv.checkpoint import CheckpointError  # noqa: E402
from qkv.interop import files  # noqa: E402
from qkv.interop.common import HFTensors, build_skeleton  # noqa: E402


def _gpt2(folder):
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=16)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(folder)


def _bert(folder):
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=24, max_position_embeddings=16)
    transformers.BertForMaskedLM(cfg).save_pretrained(folder)


def _distilbert(folder):
    cfg = transformers.DistilBertConfig(vocab_size=V, dim=16, n_layers=2, n_heads=2, hidden_dim=24,
                                        max_position_embeddings=16)
    transformers.DistilBertForSequenceClassification(cfg).save_pretrained(folder)


def _vit(folder):
    cfg = transformers.ViTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=24,
                                 image_size=8, patch_size=2, num_channels=1, num_labels=3)
    transformers.ViTForImageClassification(cfg).save_pretrained(folder)


def _whisper(folder):
    cfg = transformers.WhisperConfig(vocab_size=40, d_model=16, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=24,
                                     decoder_ffn_dim=24, num_mel_bins=8, max_source_positions=6,
                                     max_target_positions=10, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                     decoder_start_token_id=3, suppress_tokens=[], begin_suppress_tokens=[])
    transformers.WhisperForConditionalGeneration(cfg).save_pretrained(folder)


FAMILIES = {"gpt2": _gpt2, "bert": _bert, "distilbert": _distilbert, "t5": t5, "bart": bart, "marian": marian,
            "vit": _vit, "whisper": _whisper}


@pytest.fixture
def reads(monkeypatch):
    """Counts every tensor read through safe_open; safetensors' whole-file load_file raises."""
    counts: Counter[str] = Counter()
    real_open = safetensors.safe_open

    class Counting:
        def __init__(self, *args, **kwargs):
            self._f = real_open(*args, **kwargs)

        def __enter__(self):
            self._f.__enter__()
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

        def get_tensor(self, name):
            counts[name] += 1
            return self._f.get_tensor(name)

        def __getattr__(self, name):
            return getattr(self._f, name)

    def whole_file(*args, **kwargs):
        raise AssertionError("the loader read a whole safetensors file at once")

    monkeypatch.setattr(files, "safe_open", Counting)  # every loader reads its files through interop/files.py
    monkeypatch.setattr(files, "load_file", whole_file)
    return counts


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_tensor_is_read_once_and_the_file_never_whole(tmp_path, family, reads):
    torch.manual_seed(0)
    FAMILIES[family](tmp_path)
    names = set(load_file(str(tmp_path / "model.safetensors")))  # before the fixture's patch is used
    model = qkv.from_pretrained(tmp_path)
    assert reads, "nothing was read through safe_open"
    assert max(reads.values()) == 1, {k: n for k, n in reads.items() if n > 1}
    assert set(reads) <= names
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_the_loaded_weights_are_the_files_and_buffers_are_computed(tmp_path):
    """Marian: parameters straight from the file (through the skeleton), the sinusoidal table (a buffer its
    constructor computes, not in the file) equal to a model built the ordinary way."""
    marian(tmp_path)
    ours = qkv.from_pretrained(tmp_path)
    file = load_file(str(tmp_path / "model.safetensors"))
    torch.testing.assert_close(ours.src_emb.weight, file["model.shared.weight"], rtol=0, atol=0)
    fresh = type(ours)(ours.config)
    for name, buf in fresh.named_buffers():
        if name.endswith("position.table"):
            assert torch.equal(dict(ours.named_buffers())[name], buf), name


def test_whisper_keeps_its_computed_mel_filters(tmp_path):
    _whisper(tmp_path)
    ours = qkv.from_pretrained(tmp_path)
    fresh = type(ours)(ours.config)
    assert torch.equal(ours.melspec.filters, fresh.melspec.filters)
    assert torch.equal(ours.melspec.window, fresh.melspec.window)


def test_build_skeleton_puts_parameters_on_meta_and_keeps_buffers_and_ties():
    from qkv.models.encdec import EncoderDecoder, EncoderDecoderConfig

    cfg = EncoderDecoderConfig(src_vocab_size=V, n_encoder_layers=1, n_decoder_layers=1,
                               d_model=16, n_heads=2,
                               d_ff=24, position="sinusoidal", sinusoidal_layout="halves",
                               share_embeddings=True)
    model = build_skeleton(lambda: EncoderDecoder(cfg))
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert all(b.device.type == "cpu" for b in model.buffers())
    assert model.tgt_emb.weight is model.src_emb.weight
    # the patch is undone: a model built afterwards is an ordinary one
    assert {p.device.type for p in EncoderDecoder(cfg).parameters()} == {"cpu"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_random_model_is_initialised_first(tmp_path, monkeypatch, dtype):
    """The skeleton's parameters are on meta while the constructor initialises them, and get storage in the
    file's dtype afterwards: no random fp32 model is drawn and then overwritten (or cast)."""
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=16, n_layer=1, n_head=2, n_positions=16)
    transformers.GPT2LMHeadModel(cfg).to(dtype).save_pretrained(tmp_path)
    drawn = []
    real = torch.nn.init.normal_

    def normal_(tensor, *args, **kwargs):
        if tensor.device.type != "meta":
            drawn.append(tuple(tensor.shape))
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.nn.init, "normal_", normal_)
    model = qkv.from_pretrained(tmp_path)
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert drawn == []


# -- the checks the streaming path keeps ---------------------------------------------------------------------
def _edit(folder, fn):
    f = folder / "model.safetensors"
    state = load_file(str(f))
    fn(state)
    save_file(state, str(f), metadata={"format": "pt"})


def test_a_stored_tied_gpt2_head_is_checked(tmp_path):
    _gpt2(tmp_path)
    _edit(tmp_path, lambda s: s.update({"lm_head.weight": s["transformer.wte.weight"].clone()}))
    model = qkv.from_pretrained(tmp_path)
    assert model.lm_head.weight is model.tok_emb.weight
    _edit(tmp_path, lambda s: s.update({"lm_head.weight": s["transformer.wte.weight"] + 1}))
    with pytest.raises(CheckpointError,
                       match="lm_head.weight differs from wte.weight although tie_word_embeddings"):
        qkv.from_pretrained(tmp_path)


def test_a_stored_bert_decoder_that_is_not_tied_is_refused(tmp_path):
    _bert(tmp_path)
    _edit(tmp_path,
          lambda s: s.update({"cls.predictions.decoder.weight": s["bert.embeddings.word_embeddings.weight"]
                                        + 1}))
    with pytest.raises(CheckpointError,
                       match="cls.predictions.decoder.weight is not tied as this loader assumes"):
        qkv.from_pretrained(tmp_path)


@pytest.mark.parametrize("family, copy, shared, message", [
    ("t5", "encoder.embed_tokens.weight", "shared.weight", "differs from shared.weight"),
    ("bart", "model.decoder.embed_tokens.weight", "model.shared.weight", "differs from model.shared.weight"),
])
def test_a_stored_embedding_copy_is_compared_with_the_shared_one(tmp_path, family, copy, shared, message):
    FAMILIES[family](tmp_path)
    _edit(tmp_path, lambda s: s.update({copy: s[shared].clone()}))
    qkv.from_pretrained(tmp_path)  # an equal copy carries nothing
    _edit(tmp_path, lambda s: s.update({copy: s[shared] * 2}))
    with pytest.raises(CheckpointError, match=message):
        qkv.from_pretrained(tmp_path)


def test_a_fused_piece_of_the_wrong_width_names_the_files_keys(tmp_path):
    _bert(tmp_path)
    _edit(tmp_path,
          lambda s: s.update({"bert.encoder.layer.1.attention.self.value.weight": torch.zeros(16, 15)}))
    with pytest.raises(CheckpointError,
                       match=r"cannot concatenate \[.*layer\.1\.attention\.self\.query\.weight.*"
                             r"value\.weight'\] into 'encoder\.blocks\.1\.attn\.qkv_proj\.weight'"):
        qkv.from_pretrained(tmp_path)


def test_a_base_bart_of_half_dtype_stays_half(tmp_path):
    """A base BartModel has no final_logits_bias: the zeros put in its place take the file's dtype, so a bf16
    folder loads in bf16 (the fp32 zeros made it a folder of mixed dtypes, loaded in fp32)."""
    cfg = transformers.BartConfig(vocab_size=V, d_model=16, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=24,
                                  decoder_ffn_dim=24, max_position_embeddings=20)
    transformers.BartModel(cfg).to(torch.bfloat16).save_pretrained(tmp_path)
    model = qkv.from_pretrained(tmp_path)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert (model.lm_head.final_logits_bias.dtype == torch.bfloat16
            and not model.lm_head.final_logits_bias.any())


# -- HFTensors -----------------------------------------------------------------------------------------------
def test_hftensors_knows_names_shapes_and_dtypes_without_reading(tmp_path, reads):
    save_file({"a.w": torch.ones(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)},
              str(tmp_path / "model.safetensors"))
    t = HFTensors(tmp_path)
    t.rename(lambda k: k.removeprefix("a."))
    assert sorted(t) == ["b", "w"] and "w" in t and "a.w" not in t and len(t) == 2
    assert t.meta("w").shape == (2, 3) and t.meta("b").dtype == torch.bfloat16 and t.meta("b").is_meta
    t["z"] = torch.full((1,), 5.0)
    del t["b"]
    assert sorted(t) == ["w", "z"] and not reads  # nothing read so far
    assert torch.equal(t["w"], torch.ones(2, 3)) and reads["a.w"] == 1  # read under its name in the file
    assert t.pop("nope", None) is None
    with pytest.raises(KeyError):
        t["b"]


def test_a_sharded_bf16_folder_streams_from_its_shards(tmp_path, reads):
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_embd=16, n_layer=2, n_head=2,
                                                               n_positions=16)).eval()
    hf.to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="10KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model = qkv.from_pretrained(tmp_path)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert max(reads.values()) == 1 and set(reads) == set(index["weight_map"])
    ids = torch.randint(0, V, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits.float(), hf(ids).logits.float(), atol=2e-2, rtol=2e-2)


def test_a_skeleton_leaves_modules_other_threads_build_alone():
    """The hook that moves parameters to meta acts only in the thread inside build_skeleton, and is torch's
    own register_parameter again afterwards."""
    import threading

    from qkv.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=V, n_layers=1, d_model=16, n_heads=2, context_length=16)
    original = torch.nn.Module.register_parameter
    inside, done, other = threading.Event(), threading.Event(), {}

    def elsewhere():
        inside.wait()
        other["model"] = torch.nn.Linear(4, 4)
        done.set()

    def build():
        inside.set()
        done.wait(10)
        return GPT(cfg)

    t = threading.Thread(target=elsewhere)
    t.start()
    skeleton = build_skeleton(build)
    t.join()
    assert {p.device.type for p in skeleton.parameters()} == {"meta"}
    assert other["model"].weight.device.type == "cpu" and other["model"].weight.abs().sum() > 0
    assert torch.nn.Module.register_parameter is original


def test_a_pickles_tensors_are_released_as_they_are_copied(tmp_path):
    """pytorch_model.bin is read whole (a pickle), but each of its tensors is dropped once copied: the file's
    tensors and the model are not both held until the end. The tied head it stores is still compared."""
    import gc
    import weakref

    from qkv.interop.common import expand, load_hf_weights
    from qkv.interop.gpt2 import KEY_MAP, TRANSFORMS, config_from_hf
    from qkv.models.gpt import GPT

    _gpt2(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["lm_head.weight"] = state["transformer.wte.weight"].clone()
    torch.save({k.removeprefix("transformer."): v for k, v in state.items()}, tmp_path / "pytorch_model.bin")
    (tmp_path / "model.safetensors").unlink()
    tensors = HFTensors(tmp_path)
    refs = {k: weakref.ref(tensors[k]) for k in tensors}
    config = config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    model = build_skeleton(lambda: GPT(config))
    load_hf_weights(model, tensors, expand(KEY_MAP, config.n_layers), transforms=TRANSFORMS,
                    ignore=("lm_head.weight",), tied={"lm_head.weight": ("wte.weight", "differs")})
    gc.collect()
    alive = {k for k, r in refs.items() if r() is not None}
    assert alive == {"wte.weight", "lm_head.weight"}  # the tie's two sides, kept for the comparison
    assert torch.equal(model.tok_emb.weight, state["transformer.wte.weight"])
