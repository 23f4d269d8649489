"""DeepSeek-V3 folders (MLA + sigmoid-routed, group-limited experts with shared experts and dense first
layers):
qkv against transformers' DeepseekV3ForCausalLM on random-weight models built and saved here. Logits to 1e-4
relative (fp32), 24 greedy tokens through qkv's generate (the latent KV cache) equal to transformers', export
back to a folder transformers loads (same logits), the fused expert layout, and the refusals (with sizes that
would not fit in memory refused from the file's headers before anything is built)."""

from __future__ import annotations

import json
import math

import pytest
import torch

import qkv
from qkv.generate import generate
from qkv.interop.deepseek import config_from_hf, export_deepseek
from qkv.nn.mla import LatentCache, MultiHeadLatentAttention
from qkv.nn.moe import MoEFeedForward
from qkv.storage import CheckpointError

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
            num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=6,
            routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12,
            qk_nope_head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
            norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.2,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
CASES = {"q-lora": {}, "plain-q": {"q_lora_rank": None, "norm_topk_prob": False},
         "half-split-rope": {"rope_interleave": False, "first_k_dense_replace": 2},
         # DeepSeek-V3's long-context setting: YaRN frequencies, cos/sin times mscale ratio, softmax times
         # mscale^2
         "yarn": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0,
                                      "factor": 4.0, "mscale": 0.8,
                                      "mscale_all_dim": 1.0, "original_max_position_embeddings": 64,
                                      "beta_fast": 32, "beta_slow": 1}}}


def build_hf(name: str = "q-lora", seed: int = 0, **extra):
    config = transformers.DeepseekV3Config(**{**BASE, **CASES[name], **extra})
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    # norms start at 1, the selection bias at 0: make them random so their use is tested
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.3)
        for layer in model.model.layers[config.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = build_hf(request.param)
    hf.save_pretrained(folder)
    return request.param, hf, folder, qkv.from_pretrained(folder)


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-4) -> None:
    err = (got - want).abs().max() / want.abs().max()
    assert err < rel, f"max error {err:.2e} of the largest logit"


def test_logits_equal_transformers(pair):
    name, hf, _, ours = pair
    ids = torch.randint(0, BASE["vocab_size"], (2, 33))
    with torch.no_grad():
        want = hf(ids).logits
        got = ours(ids).logits
    _close(got, want)
    assert want.std() > 0.1


def test_the_layers_are_what_transformers_builds(pair):
    name, hf, _, ours = pair
    theirs = [type(layer.mlp).__name__ == "DeepseekV3MoE" for layer in hf.model.layers]
    assert [isinstance(b.ffn, MoEFeedForward) for b in ours.decoder.blocks] == theirs
    assert theirs[0] is False and any(theirs)
    assert all(isinstance(b.attn, MultiHeadLatentAttention) for b in ours.decoder.blocks)
    bias = hf.model.layers[-1].mlp.gate.e_score_correction_bias
    assert torch.equal(ours.decoder.blocks[-1].ffn.router.score_bias, bias) and bias.abs().sum() > 0


def test_greedy_24_tokens_equal_transformers(pair):
    name, hf, _, ours = pair
    assert isinstance(ours.make_cache(1, 8), LatentCache)
    prompt = torch.randint(3, BASE["vocab_size"], (2, 9))
    with torch.no_grad():
        want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24,
                           min_new_tokens=24, do_sample=False)
    got = generate(ours, prompt, max_new_tokens=24, min_new_tokens=24)
    uncached = generate(ours, prompt, max_new_tokens=24, min_new_tokens=24, use_cache=False)
    assert torch.equal(got, want[:, :got.shape[1]]) and got.shape == want.shape
    assert torch.equal(got, uncached)


def test_export_round_trip(pair, tmp_path):
    name, hf, folder, ours = pair
    export_deepseek(ours, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "deepseek_v3" and written["rope_interleave"] is False
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path).eval()
    again = qkv.from_pretrained(tmp_path)
    ids = torch.randint(0, BASE["vocab_size"], (1, 20))
    with torch.no_grad():
        # transformers reads the exported folder as the same model
        _close(back(ids).logits, hf(ids).logits, 1e-5)
        assert torch.equal(again(ids).logits, ours(ids).logits)  # and qkv reads back the same model
    assert again.config == ours.config


def test_the_fused_expert_layout_loads_as_the_per_expert_one(tmp_path):
    hf = build_hf()
    hf.save_pretrained(tmp_path / "fused", save_original_format=False)
    hf.save_pretrained(tmp_path / "plain")
    fused, plain = qkv.from_pretrained(tmp_path / "fused"), qkv.from_pretrained(tmp_path / "plain")
    assert fused.state_dict().keys() == plain.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(fused.state_dict().values(), plain.state_dict().values()))


def test_yarn_scales_the_softmax_as_transformers():
    cfg = config_from_hf(build_hf("yarn").config.to_dict())
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["mscale_all_dim"] == 1.0
    assert cfg.mla.softmax_scale == pytest.approx(24 ** -0.5 * (0.1 * math.log(4.0) + 1) ** 2)


def test_config_translation():
    cfg = config_from_hf(build_hf().config.to_dict())
    m, e = cfg.mla, cfg.moe
    assert ((m.kv_lora_rank, m.q_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim)
            == (16, 24, 16, 8, 12))
    assert (e.n_experts, e.n_experts_per_tok, e.ffn_dim, e.first_k_dense, e.n_shared_experts, e.score,
            e.n_group, e.topk_group, e.routed_scaling, e.bias_balance, e.norm_topk) == (
        6, 2, 24, 1, 1, "sigmoid", 2, 1, 2.5, True, True)
    assert cfg.head_dim == 8 and cfg.d_ff == 96 and cfg.position == "rope"


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "dynamic"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"attention_bias": True}, "attention_bias"),
    ({"quantization_config": {"quant_method": "fp8"}}, "fp8"),
])
def test_unsupported_configs_are_clear_errors(change, message):
    hf = {**build_hf().config.to_dict(), **change}
    with pytest.raises(CheckpointError, match=message):
        config_from_hf(hf)


@pytest.mark.parametrize("field, value", [("num_hidden_layers", 10**9), ("n_routed_experts", 10**9),
                                          ("kv_lora_rank", 10**9), ("q_lora_rank", 10**9),
                                          ("moe_intermediate_size", 10**9), ("vocab_size", 10**12)])
def test_absurd_sizes_are_refused_from_the_headers(tmp_path, field, value):
    build_hf().save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(CheckpointError, match=field):
        qkv.from_pretrained(tmp_path)


def test_deepseek_v2_is_refused(tmp_path):
    build_hf().save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "deepseek_v2"}))
    with pytest.raises(CheckpointError, match="deepseek_v2 is not supported"):
        qkv.from_pretrained(tmp_path)


def test_cli_generate_and_serve_decode_as_transformers(tmp_path, capsys):
    """qkv generate (the static latent cache) and qkv serve's app (the Engine over the paged latent cache)
    decode a DeepSeek folder as transformers does."""
    import pydoc_data.topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from qkv.cli.main import main

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(list(pydoc_data.topics.topics.values())[:20], trainers.BpeTrainer(
        vocab_size=BASE["vocab_size"], special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                         eos_token="</s>").save_pretrained(tmp_path)
    hf = build_hf()
    hf.save_pretrained(tmp_path)
    prompt = "The with statement"
    ids = transformers.AutoTokenizer.from_pretrained(tmp_path)(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    want_text = transformers.AutoTokenizer.from_pretrained(tmp_path).decode(want[0, ids.shape[1]:],
                                                                           skip_special_tokens=True)
    assert main(["generate", str(tmp_path), "--prompt", prompt, "--greedy", "--max-new-tokens", "12"]) == 0
    assert want_text.strip() and want_text.strip() in capsys.readouterr().out
    from fastapi.testclient import TestClient

    from qkv.serve import build_engine, create_app, load_served

    served = load_served(tmp_path)
    with TestClient(create_app(served, build_engine(served, block_size=4))) as client:
        r = client.post("/v1/completions", json={"model": served.name, "prompt": prompt, "max_tokens": 12,
                                                 "temperature": 0})
    assert r.status_code == 200 and want_text.strip() in r.json()["choices"][0]["text"]


def test_a_bf16_folder_loads_in_bf16_and_decodes(tmp_path):
    build_hf().to(torch.bfloat16).save_pretrained(tmp_path)
    ours = qkv.from_pretrained(tmp_path)
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    assert ours.make_cache(1, 4).k.dtype == torch.bfloat16
    out = generate(ours, torch.randint(3, BASE["vocab_size"], (1, 5)), max_new_tokens=6, min_new_tokens=6)
    assert out.shape == (1, 11)
