"""qkv.memory and `qkv info`'s memory lines: the KV-cache formula against the bytes of the cache tensors qkv
allocates when it decodes (and those transformers allocates for the same Hugging Face folder), the training
estimate against a measured step's peak of live tensor storage, LiveTensorBytes against known allocations."""

from __future__ import annotations

import json

import pytest
import torch

import qkv
from qkv.cli.main import main
from qkv.generate import generate
from qkv.memory import LiveTensorBytes, kv_cache_size, train_memory
from qkv.models.gpt import GPT, GPTConfig
from qkv.models.whisper import Whisper, WhisperConfig
from qkv.nn.mla import MLAConfig
from qkv.train.optim import build_optimizer


def tiny_gpt(**kw) -> GPT:
    cfg = dict(vocab_size=40, n_layers=2, d_model=32, n_heads=4, context_length=32)
    return GPT(GPTConfig(**{**cfg, **kw})).eval()


MLA = MLAConfig(kv_lora_rank=12, q_lora_rank=None, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5)
LAYOUTS = {
    "MHA": lambda: tiny_gpt(),
    "GQA": lambda: tiny_gpt(n_kv_heads=2, position="rope"),
    "MQA": lambda: tiny_gpt(n_kv_heads=1, position="rope", head_dim=16),
    "MLA": lambda: tiny_gpt(position="rope", head_dim=MLA.qk_rope_head_dim, norm="rmsnorm", bias=False,
                            mla=MLA),
}


def decoded_cache(model, ids: torch.Tensor, new: int, **options):
    """The cache generate() allocates and fills for `model` (recorded from make_cache)."""
    made = []
    make = model.make_cache

    def recording(*args, **kw):
        made.append(make(*args, **kw))
        return made[-1]

    model.make_cache = recording
    generate(model, ids, max_new_tokens=new, do_sample=False, **options)
    assert len(made) == 1
    return made[0]


def tensor_bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kv_formula_matches_the_cache_qkv_decodes_with(layout, dtype):
    model = LAYOUTS[layout]().to(dtype)
    kv = kv_cache_size(model)
    assert kv.layout == layout and kv.dtype == dtype
    B, T, new = 3, 5, 4
    cache = decoded_cache(model, torch.randint(0, 40, (B, T)), new)
    assert cache.length >= T + new - 1
    positions = cache.k.shape[0 + 3]  # (layers, batch, heads, positions, width)
    assert tensor_bytes(cache.k, cache.v) == kv.bytes_at(positions, batch=B)
    # the formula written out by hand, for one of them
    if layout == "GQA":
        assert kv.bytes_per_token == 2 * 2 * 2 * 8 * dtype.itemsize  # layers x K,V x kv heads x head_dim
    if layout == "MLA":
        assert kv.bytes_per_token == 2 * (12 + 4) * dtype.itemsize  # layers x (latent + rotary key)


def test_kv_formula_of_an_encoder_decoder_counts_the_cross_attention_cache():
    model = qkv.build("transformer-tiny", n_kv_heads=2).eval()
    kv = kv_cache_size(model)
    B, S = 2, 7
    cache = decoded_cache(model, torch.randint(4, 60, (B, S)), 3)
    layers = range(model.config.n_decoder_layers)
    cross = tensor_bytes(*(t for i in layers for t in cache.get_cross(i)))
    assert cross == kv.bytes_at(0, batch=B, source_tokens=S)
    assert tensor_bytes(cache.k, cache.v) == kv.bytes_at(cache.k.shape[3], batch=B)
    assert kv.layout == "GQA" and kv.source_context == model.config.context_length


def test_kv_formula_of_whisper_counts_the_audio_cross_attention_cache():
    model = Whisper(WhisperConfig(vocab_size=13, n_encoder_layers=2, n_decoder_layers=2, d_model=16,
                                  n_heads=2, n_kv_heads=1, d_ff=32, n_audio_ctx=10, n_text_ctx=12,
                                  n_mels=8)).eval()
    kv = kv_cache_size(model)
    B = 2
    # 0.2 s of audio: 10 encoder frames; no eos, so every row decodes all 4 tokens
    cache = decoded_cache(model, torch.randn(B, 3200) * 0.1, 4, eos_token_id=[])
    cross = tensor_bytes(*(t for i in range(2) for t in cache.get_cross(i)))
    assert cross == kv.bytes_at(0, batch=B, source_tokens=kv.source_context) and kv.source_context == 10
    assert tensor_bytes(cache.k, cache.v) == kv.bytes_at(cache.k.shape[3], batch=B)
    assert kv.layout == "MQA" and kv.context == 12


def test_models_without_a_kv_cache_say_so():
    for name in ("bert-tiny", "vit-digits", "lstm-tiny"):
        assert kv_cache_size(qkv.build(name)) is None


def hf_cache_bytes(out) -> tuple[int, int]:
    """(self-attention, cross-attention) bytes of a transformers forward's cache."""
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    cross = 0
    if hasattr(cache, "cross_attention_cache"):
        cross = sum(tensor_bytes(layer.keys, layer.values) for layer in cache.cross_attention_cache.layers)
        cache = cache.self_attention_cache
    return sum(tensor_bytes(layer.keys, layer.values) for layer in cache.layers), cross


def hf_models():
    transformers = pytest.importorskip("transformers")
    small = dict(vocab_size=64, max_position_embeddings=48)
    llama = dict(small, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    return {
        "gpt2 (MHA)": transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=64, n_positions=48, n_embd=32, n_layer=3, n_head=4)),
        "llama (GQA)": transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **llama, num_key_value_heads=2)),
        "llama (MQA, head_dim 16)": transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **llama, num_key_value_heads=1, head_dim=16)),
        "bart (cross-attention)": transformers.BartForConditionalGeneration(transformers.BartConfig(
            **small, d_model=32, encoder_layers=1, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64)),
    }


@pytest.mark.parametrize("name", ["gpt2 (MHA)", "llama (GQA)", "llama (MQA, head_dim 16)",
                                  "bart (cross-attention)"])
def test_kv_formula_of_a_hugging_face_folder_matches_transformers_cache(name, tmp_path):
    hf = hf_models()[name].eval()
    hf.save_pretrained(tmp_path)
    kv = kv_cache_size(qkv.from_pretrained(tmp_path))
    B, T, S = 2, 6, 9
    with torch.no_grad():
        if "bart" in name:
            out = hf(input_ids=torch.randint(3, 64, (B, S)), decoder_input_ids=torch.randint(3, 64, (B, T)),
                     use_cache=True)
        else:
            out = hf(torch.randint(0, 64, (B, T)), use_cache=True)
    own, cross = hf_cache_bytes(out)
    assert own == kv.bytes_at(T, batch=B)
    assert cross == kv.bytes_at(0, batch=B, source_tokens=S if "bart" in name else 0)
    assert kv.context == 48


def measured_peak(model: GPT, batch: int, seq: int, checkpointing: bool) -> int:
    """The peak of live tensor storage over one fp32 AdamW step (after a first step made the optimizer's
    state), weights and optimizer state included: what the Trainer's step allocates."""
    model.train()
    model.set_gradient_checkpointing(checkpointing)
    opt, _ = build_optimizer(model, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    x = torch.randint(0, model.config.vocab_size, (batch, seq))

    def step():
        model(x, labels=x).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    mem = LiveTensorBytes()
    mem.hold([*model.parameters(), *model.buffers(), *(t for s in opt.state.values() for t in s.values())])
    with mem:
        step()
    return mem.peak


TRAIN_CASES = {
    "gpt-tiny": ("gpt-tiny", {}, 4, 64),
    "naive attention, dropout": ("gpt-tiny", {"attention": "naive", "dropout": 0.1, "attn_dropout": 0.1},
                                 2, 64),
    "swiglu, rmsnorm, rope, GQA": ("gpt-tiny", {"ffn": "swiglu", "norm": "rmsnorm", "position": "rope",
                                                "n_kv_heads": 2, "bias": False}, 4, 48),
    "gpt-nano, more tokens than weights": ("gpt-nano", {}, 16, 32),
}


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("case", list(TRAIN_CASES))
def test_training_estimate_is_within_25_percent_of_the_measured_peak(case, checkpointing):
    preset, kw, batch, seq = TRAIN_CASES[case]
    model = qkv.build(preset, **{"dropout": 0.0, **kw})
    est = train_memory(model, batch, seq)
    got = measured_peak(model, batch, seq, checkpointing)
    assert abs(est.peak(checkpointing) / got - 1) < 0.25, (est, got)
    # what is not an estimate: the parts that are the parameters' own bytes
    params = sum(p.numel() for p in model.parameters()) * 4
    assert est.weights == est.gradients == params and est.optimizer == 2 * params


def test_checkpointing_keeps_less_and_the_estimate_says_how_much_less():
    model = qkv.build("gpt-tiny", dropout=0.0)
    est = train_memory(model, 8, 64)
    assert est.activations_checkpointed < est.activations / 2
    plain, ckpt = measured_peak(model, 8, 64, False), measured_peak(model, 8, 64, True)
    assert ckpt < plain
    saved_est = est.peak(False) - est.peak(True)
    assert abs(saved_est / (plain - ckpt) - 1) < 0.25


def test_live_tensor_bytes_counts_storages_once_and_frees_them():
    mem = LiveTensorBytes()
    with mem:
        a = torch.empty(1000)  # 4,000 bytes
        view = a[10:20]  # no new storage
        a.add_(1)  # in place: no new storage
        b = a * 2  # 4,000 more
        del b
        c = torch.ones(500, dtype=torch.float64)  # 4,000 after b's were freed
    assert mem.peak == 8000 and mem.current == 8000
    del a, view, c
    assert mem.current == 0


def test_estimate_refuses_what_it_does_not_model():
    with pytest.raises(qkv.ConfigError, match="GPT-family"):
        train_memory(qkv.build("bert-tiny"), 2, 16)
    with pytest.raises(qkv.ConfigError, match="latent"):
        train_memory(LAYOUTS["MLA"](), 2, 16)
    with pytest.raises(qkv.ConfigError, match="context_length"):
        train_memory(qkv.build("gpt-tiny"), 2, 65)


def test_qkv_info_prints_the_kv_cache_and_the_training_estimate(capsys):
    assert main(["info", "gpt-tiny", "--train", "--batch", "2", "--seq", "32", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    # gpt-tiny: 4 layers x K,V x 4 heads x 32 = 1,024 numbers, 2 bytes each in bfloat16; context 64, 2 rows
    assert "KV cache (MHA, bfloat16): 4 layers x K and V: 2 x 4 heads x 32 = 1,024 numbers = 2,048 by" in out
    assert "at the model's context (64 tokens), 2 sequences: 256.0 KiB" in out
    est = train_memory(qkv.build("gpt-tiny"), 2, 32)
    assert "training memory estimate (fp32, AdamW), batch 2 x 32 tokens" in out
    assert f"{est.peak(False) / 2**20:,.1f} MiB" in out and f"{est.peak(True) / 2**20:,.1f} MiB" in out


def test_qkv_info_names_the_field_a_folder_lacks(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=48))
    hf.save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    del meta["max_position_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(meta))
    capsys.readouterr()  # transformers' own progress lines
    assert main(["info", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lacks 'max_position_embeddings'" in err[0] and err[0].startswith("qkv: error:")


def test_qkv_info_names_the_field_a_qkv_folder_lacks(tmp_path, capsys):
    folder = tiny_gpt().save_pretrained(tmp_path / "gpt")
    meta = json.loads((folder / "config.json").read_text())
    del meta["config"]["n_layers"]  # the family's default (4) would size another model than the file's 2
    (folder / "config.json").write_text(json.dumps(meta))
    assert main(["info", str(folder)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lacks 'n_layers'" in err[0] and "(gpt)" in err[0]
