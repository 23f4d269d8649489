"""Llama / Qwen2 / Qwen3 / Mistral folders: qkv against transformers on random-weight models built and saved
here. Logits to 1e-4 (fp32), 64 greedy tokens equal to transformers.generate, cached == uncached, sharded ==
single file, bf16/fp16 kept, export back to a folder transformers loads, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch

import qkv
from qkv.generate import generate
from qkv.interop.llama import config_from_hf, export_llama
from qkv.storage import CheckpointError

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=320, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
            max_position_embeddings=256,
            rms_norm_eps=1e-5, initializer_range=0.3, bos_token_id=1, eos_token_id=2)

CASES = {
    # name: (config class, fields)
    "llama-gqa2-untied": ("LlamaConfig",
                          dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                              rope_theta=500.0)),
    "llama-gqa3-tied-llama3": ("LlamaConfig", dict(
        num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      # one frequency of each band
                      "original_max_position_embeddings": 100}, rope_theta=10000.0)),
    "llama-mqa-headdim-linear": ("LlamaConfig", dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False,
        rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "qwen2-bias-gqa3-tied": ("Qwen2Config", dict(num_attention_heads=6, num_key_value_heads=2,
                                                 tie_word_embeddings=True, rope_theta=1000000.0)),
    "mistral-gqa2-window": ("MistralConfig",
                            dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=128,
                                                  tie_word_embeddings=False)),
    "qwen3-qknorm-headdim": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                 tie_word_embeddings=True)),
}
MODEL = {"LlamaConfig": "LlamaForCausalLM", "Qwen2Config": "Qwen2ForCausalLM",
         "MistralConfig": "MistralForCausalLM", "Qwen3Config": "Qwen3ForCausalLM"}


def build_hf(name: str, seed: int = 0, **extra):
    cls, fields = CASES[name]
    config = getattr(transformers, cls)(**{**BASE, **fields, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, MODEL[cls])(config).eval()
    # HF initialises biases and norms to constants: make them random, so they are tested
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".bias") or "norm" in n:
                p.add_(torch.randn_like(p) * 0.2)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = build_hf(request.param)
    hf.save_pretrained(folder)
    return request.param, hf, folder, qkv.from_pretrained(folder)


def test_logits_equal_transformers(pair):
    name, hf, _, ours = pair
    ids = torch.randint(0, BASE["vocab_size"], (2, 40))
    with torch.no_grad():
        want = hf(ids).logits
        got = ours(ids).logits
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert want.std() > 0.5  # logits spread enough for the greedy comparison to mean something


def test_greedy_64_tokens_equal_transformers_and_cached_equals_uncached(pair):
    name, hf, _, ours = pair
    prompt = torch.randint(3, BASE["vocab_size"], (1, 12))
    with torch.no_grad():
        want = hf.generate(prompt, max_new_tokens=64, min_new_tokens=64, do_sample=False)
    got = generate(ours, prompt, max_new_tokens=64, min_new_tokens=64)
    uncached = generate(ours, prompt, max_new_tokens=64, min_new_tokens=64, use_cache=False)
    assert got.shape == (1, 76)
    assert got.tolist() == want.tolist()
    assert uncached.tolist() == got.tolist()


def test_greedy_batch_equals_transformers(pair):
    """A batch of 4 rows: the decoding step's batched products keep every greedy token equal to
    transformers'."""
    name, hf, _, ours = pair
    prompt = torch.randint(3, BASE["vocab_size"], (4, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32,
                           min_new_tokens=32, do_sample=False, pad_token_id=0)
    got = generate(ours, prompt, max_new_tokens=32, min_new_tokens=32)
    assert got.tolist() == want.tolist()


def test_config_translation(pair):
    name, hf, _, ours = pair
    c = ours.config
    assert (c.n_heads, c.n_kv_heads) == (hf.config.num_attention_heads, hf.config.num_key_value_heads)
    assert c.tie_embeddings == hf.config.tie_word_embeddings
    assert (ours.lm_head.weight is ours.tok_emb.weight) == c.tie_embeddings
    assert c.norm_eps == BASE["rms_norm_eps"]
    assert c.qkv_bias == (True if name.startswith("qwen2") else None)
    assert (c.head_dim is not None) == ("headdim" in name)
    assert ours.num_parameters() == sum(p.numel() for p in hf.parameters())


def test_sharded_equals_single_file(tmp_path):
    hf = build_hf("llama-gqa3-tied-llama3")
    hf.save_pretrained(tmp_path / "single")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 2
    a, b = qkv.from_pretrained(tmp_path / "single"), qkv.from_pretrained(tmp_path / "sharded")
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_folder_loads_in_its_dtype(tmp_path, dtype):
    hf = build_hf("qwen2-bias-gqa3-tied").to(dtype)
    hf.save_pretrained(tmp_path)
    ours = qkv.from_pretrained(tmp_path)
    assert {p.dtype for p in ours.parameters()} == {dtype}
    hf_state = {k: v for k, v in hf.state_dict().items()}
    assert torch.equal(ours.tok_emb.weight, hf_state["model.embed_tokens.weight"])  # bit-exact, no round trip
    ids = torch.randint(0, BASE["vocab_size"], (1, 24))
    with torch.no_grad():
        want, got = hf(ids).logits.float(), ours(ids).logits.float()
    assert (got - want).abs().max() < 0.1 * want.abs().max()  # same function up to half-precision rounding


@pytest.mark.parametrize("name", list(CASES))
def test_export_round_trip_loads_in_transformers(tmp_path, name):
    hf = build_hf(name, seed=1)
    hf.save_pretrained(tmp_path / "in")
    ours = qkv.from_pretrained(tmp_path / "in")
    export_llama(ours, tmp_path / "out")
    meta = json.loads((tmp_path / "out" / "config.json").read_text())
    assert meta["model_type"] == hf.config.model_type
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back) is type(hf)
    ids = torch.randint(0, BASE["vocab_size"], (2, 30))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, atol=1e-5, rtol=0)
    again = qkv.from_pretrained(tmp_path / "out")
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), ours.state_dict().values()))
    assert again.generation_defaults()["eos_token_id"] == 2


def test_sliding_window_is_refused_past_the_window(tmp_path):
    hf = build_hf("mistral-gqa2-window", sliding_window=16)
    hf.save_pretrained(tmp_path)
    ours = qkv.from_pretrained(tmp_path)
    assert ours.config.sliding_window == 16 and ours.context_limit == 16
    ids = torch.randint(0, BASE["vocab_size"], (1, 16))
    with torch.no_grad():  # within the window: the same function as transformers' sliding-window attention
        torch.testing.assert_close(ours(ids).logits, hf(ids).logits, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="context of 16"):
        generate(ours, ids[:, :10], max_new_tokens=8)
    with pytest.raises(ValueError):
        ours(torch.randint(0, BASE["vocab_size"], (1, 17)))


def test_a_window_as_long_as_the_context_is_kept(tmp_path):
    """RoPE runs past max_position_embeddings, and there transformers' window limits attention: a window equal
    to the context is kept (refusing longer sequences), not dropped (which computed another function past it),
    and exported back as mistral."""
    from qkv.models.decoding import configured_context

    hf = build_hf("mistral-gqa2-window", sliding_window=32, max_position_embeddings=32)
    hf.save_pretrained(tmp_path / "in")
    ours = qkv.from_pretrained(tmp_path / "in")
    assert ours.config.sliding_window == 32 and ours.context_limit == 32 and configured_context(ours) == 32
    ids = torch.randint(0, BASE["vocab_size"], (1, 40))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids[:, :32]).logits, hf(ids[:, :32]).logits, atol=1e-4, rtol=0)
        with pytest.raises(ValueError):
            ours(ids)
    export_llama(ours, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "mistral" and config["sliding_window"] == 32


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}},
     "rope scaling type 'longrope' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"lacks \['original_max_position_embeddings'\]"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
     "'dynamic' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"attention_bias": True}, "attention_bias without mlp_bias"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "sliding-window layers"),
])
def test_unsupported_configs_are_clear_errors(change, message):
    hf = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
          "num_hidden_layers": 1, "num_attention_heads": 2, **change}
    with pytest.raises(CheckpointError, match=message):
        config_from_hf(hf)


def test_wrong_shapes_and_missing_keys_are_clear_errors(tmp_path):
    hf = build_hf("llama-gqa2-untied")
    hf.save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**meta, "num_key_value_heads": 4}))
    with pytest.raises(CheckpointError, match="k_proj.weight.*shape"):
        qkv.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**meta, "tie_word_embeddings": True}))
    with pytest.raises(CheckpointError, match="lm_head.weight differs"):
        qkv.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**meta, "num_hidden_layers": 3}))
    with pytest.raises(CheckpointError, match="num_hidden_layers is 3, but .* holds 2 layers"):
        qkv.from_pretrained(tmp_path)


def test_cli_info_generate_attention_take_a_model_folder(tmp_path, capsys):
    """qkv info / generate [--stream] / attention on a Llama folder with its tokenizer.json."""
    import pydoc_data.topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from qkv.cli.main import main

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(list(pydoc_data.topics.topics.values())[:20], trainers.BpeTrainer(
        vocab_size=BASE["vocab_size"], special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    # Llama's bos
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                         eos_token="</s>").save_pretrained(tmp_path)
    hf = build_hf("llama-gqa2-untied")
    hf.save_pretrained(tmp_path)

    assert main(["info", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Hugging Face llama folder, float32" in out
    total = next(line for line in out.splitlines() if line.startswith("total"))
    assert f"{sum(p.numel() for p in hf.parameters()):,}" in total

    prompt = "The with statement"
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids = ref(prompt, return_tensors="pt").input_ids
    assert ids[0, 0] == 1  # the post-processor's bos
    with torch.no_grad():  # both stop at the folder's eos (generation_config.json) if it comes
        want = hf.generate(ids, max_new_tokens=12, do_sample=False)
    want_text = prompt + ref.decode(want[0, ids.shape[1]:], skip_special_tokens=True)
    flags = ["--prompt", prompt, "--greedy", "--max-new-tokens", "12"]
    assert main(["generate", str(tmp_path), *flags]) == 0
    assert capsys.readouterr().out == want_text + "\n"
    assert main(["generate", str(tmp_path), *flags, "--stream"]) == 0
    assert capsys.readouterr().out == want_text + "\n"

    png = tmp_path / "att.png"
    assert main(["attention", str(tmp_path), "--input", "for x in range(3): pass", "--out", str(png)]) == 0
    assert png.is_file() and "| self | 1 | 3 |" in capsys.readouterr().out


def test_last_only_logits_equal_transformers_logits_to_keep(pair):
    """The prefill path (last_only: the top block works on the last position only) against transformers'
    logits_to_keep=1 on the same weights (benchmarks/prefill.py times these two calls)."""
    name, hf, _, ours = pair
    ids = torch.randint(0, BASE["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = hf(ids, logits_to_keep=1).logits[:, -1]
        got = ours(ids, last_only=True).logits[:, -1]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["llama-gqa3-tied-llama3", "qwen2-bias-gqa3-tied"])
def test_bf16_greedy_equals_transformers_up_to_near_ties(tmp_path, name):
    """A bf16 folder, batch 4 and batch 1: every greedy token equals transformers' bf16 generate up to where
    the two part, which may only be where transformers' own top two logits are closer than the two libraries'
    bf16 logits differ there (teacher-forced on transformers' tokens): qkv and transformers round differently
    (attention, norms), so in bf16 they may part at such near-ties."""
    hf = build_hf(name).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    ours = qkv.from_pretrained(tmp_path)
    for batch in (4, 1):
        prompt = torch.randint(3, BASE["vocab_size"], (batch, 10),
                               generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24,
                              min_new_tokens=24,
                              do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                              output_scores=True)
        got = generate(ours, prompt, max_new_tokens=24, min_new_tokens=24)
        for r in range(batch):
            differ = (got[r, 10:] != out.sequences[r, 10:]).nonzero()
            if len(differ):
                i = differ[0].item()
                hf_logits = out.scores[i][r].float()
                with torch.no_grad():  # qkv's logits on transformers' own tokens up to there (teacher-forced)
                    ours_logits = ours(out.sequences[r:r + 1, :10 + i]).logits[0, -1].float()
                gap = (ours_logits - hf_logits).abs()[hf_logits.isfinite()].max()
                top2 = hf_logits.topk(2).values
                assert gap <= 0.1 * hf_logits[hf_logits.isfinite()].abs().max()  # the same function in bf16
                assert top2[0] - top2[1] <= 2 * gap, (batch, r, i, top2, gap)  # a tie within that difference
