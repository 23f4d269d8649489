"""Mixtral / Qwen2-MoE / Qwen3-MoE folders: qkv against transformers on random-weight models built and saved
here. Logits to 1e-4 relative (fp32), 24 greedy tokens through qkv's generate (KV cache) equal to
transformers', the load-balancing loss equal to transformers' load_balancing_loss_func, export back to a
folder transformers loads (same logits), and the refusals."""

from __future__ import annotations

import json

import pytest
import torch

import qkv
from qkv.generate import generate
from qkv.interop.moe import config_from_hf, export_moe
from qkv.nn.moe import MoEFeedForward
from qkv.storage import CheckpointError

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=300, hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.3,
            num_experts_per_tok=2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)

CASES = {
    # name: (config class, model class, fields)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, rope_theta=1e6)),
    "qwen2_moe-shared-sparse-step": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=6, moe_intermediate_size=24, shared_expert_intermediate_size=40, decoder_sparse_step=1,
        mlp_only_layers=[1], norm_topk_prob=False)),
    "qwen3_moe-renorm": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, head_dim=16, norm_topk_prob=True,
        tie_word_embeddings=True)),
}


def build_hf(name: str, seed: int = 0, **extra):
    cls, model_cls, fields = CASES[name]
    config = getattr(transformers, cls)(**{**BASE, **fields, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    # HF initialises biases and norms to constants, the router to zeros: make them random
    with torch.no_grad():
        for n, p in model.named_parameters():
            if (n.endswith(".bias") or "norm" in n or n.endswith("mlp.gate.weight")
                or "shared_expert_gate" in n):
                p.add_(torch.randn_like(p) * 0.3)
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
    assert want.std() > 0.5


def test_layers_are_moe_where_transformers_has_experts(pair):
    name, hf, _, ours = pair
    theirs = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    assert [isinstance(b.ffn, MoEFeedForward) for b in ours.decoder.blocks] == theirs
    assert any(theirs)


def test_greedy_24_tokens_equal_transformers(pair):
    name, hf, _, ours = pair
    prompt = torch.randint(3, BASE["vocab_size"], (2, 9))
    with torch.no_grad():
        want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24,
                           min_new_tokens=24, do_sample=False)
    got = generate(ours, prompt, max_new_tokens=24, min_new_tokens=24)
    uncached = generate(ours, prompt, max_new_tokens=24, min_new_tokens=24, use_cache=False)
    assert torch.equal(got, want[:, :got.shape[1]]) and got.shape == want.shape
    assert torch.equal(got, uncached)


def test_aux_loss_equals_transformers(pair):
    name, hf, _, ours = pair
    ids = torch.randint(0, BASE["vocab_size"], (2, 17))
    with torch.no_grad():
        hf_out = hf(ids, output_router_logits=True)
    ours.train()
    try:
        out = ours(ids, labels=ids)
    finally:
        ours.eval()
    torch.testing.assert_close(out.aux_loss.double(), hf_out.aux_loss.double(), atol=1e-5, rtol=1e-5)
    plain = ours(ids, labels=ids).loss  # eval: the LM loss alone
    torch.testing.assert_close(out.loss, plain + ours.config.moe.aux_loss_coef * out.aux_loss,
                               atol=1e-5, rtol=0)


def test_export_round_trip(pair, tmp_path):
    name, hf, folder, ours = pair
    export_moe(ours, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == json.loads((folder / "config.json").read_text())["model_type"]
    back = getattr(transformers, CASES[name][1]).from_pretrained(tmp_path).eval()
    again = qkv.from_pretrained(tmp_path)
    ids = torch.randint(0, BASE["vocab_size"], (1, 20))
    with torch.no_grad():
        want = hf(ids).logits
        _close(back(ids).logits, want, 1e-6)  # transformers reads back its own weights
        assert torch.equal(again(ids).logits, ours(ids).logits)  # and qkv reads back the same model
    assert again.config == ours.config


def test_config_translation():
    cfg = config_from_hf(build_hf("qwen2_moe-shared-sparse-step").config.to_dict())
    m = cfg.moe
    assert (m.n_experts, m.n_experts_per_tok, m.ffn_dim, m.layers, m.shared_ffn_dim, m.shared_expert_gate,
            m.norm_topk) == (6, 2, 24, [0, 2], 40, True, False)
    assert cfg.d_ff == 64 and cfg.qkv_bias


@pytest.mark.parametrize("change, message", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_local_experts": 0}, "num_experts must be positive"),
    ({"model_type": "olmoe"}, "not a mixture-of-experts decoder"),
])
def test_unsupported_configs_are_clear_errors(change, message):
    hf = {**build_hf("mixtral").config.to_dict(), **change}
    with pytest.raises(CheckpointError, match=message):
        config_from_hf(hf)


@pytest.mark.parametrize("name", list(CASES))
def test_the_fused_layout_loads_as_the_per_expert_one(tmp_path, name):
    """save_pretrained(save_original_format=False) keeps transformers 5's fused 3-D expert parameters."""
    from safetensors import safe_open

    hf = build_hf(name)
    hf.save_pretrained(tmp_path / "fused", save_original_format=False)
    hf.save_pretrained(tmp_path / "plain")
    with safe_open(str(tmp_path / "fused" / "model.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in f.keys()
    fused, plain = qkv.from_pretrained(tmp_path / "fused"), qkv.from_pretrained(tmp_path / "plain")
    assert fused.state_dict().keys() == plain.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(fused.state_dict().values(), plain.state_dict().values()))


def test_a_fused_folder_with_a_wrong_expert_shape_is_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    build_hf("mixtral").save_pretrained(tmp_path, save_original_format=False)
    state = load_file(tmp_path / "model.safetensors")
    state["model.layers.1.mlp.experts.down_proj"] = state["model.layers.1.mlp.experts.down_proj"][
        :, :, :-1].clone()
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="experts.0.w2.weight have shape"):
        qkv.from_pretrained(tmp_path)


def test_dense_export_refuses_an_moe_model(pair, tmp_path):
    from qkv.interop.llama import export_llama

    with pytest.raises(CheckpointError, match="mixture-of-experts"):
        export_llama(pair[3], tmp_path)


def test_cli_info_and_generate_take_a_mixtral_folder(tmp_path, capsys):
    """qkv info / generate on a Mixtral folder with a tokenizer.json: the text transformers generates."""
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
    hf = build_hf("mixtral")
    hf.save_pretrained(tmp_path)

    assert main(["info", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "mixtral" in out and f"{sum(p.numel() for p in hf.parameters()):,}" in out

    prompt = "The with statement"
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids = ref(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    want_text = prompt + ref.decode(want[0, ids.shape[1]:], skip_special_tokens=True)
    assert main(["generate", str(tmp_path), "--prompt", prompt, "--greedy", "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out == want_text + "\n"


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe-shared-sparse-step"])
def test_bf16_folder_loads_in_bf16_and_each_moe_layer_matches_transformers(tmp_path, name):
    """Whole-model bf16 logits are not compared: one token whose two best experts are within bf16 rounding of
    each other may be routed differently after an earlier layer rounds differently (a jump, not an error), so
    each MoE layer is compared on the same bf16 input, where the router sees identical numbers."""
    hf = build_hf(name).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    ours = qkv.from_pretrained(tmp_path)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    x = torch.randn(2, 16, BASE["hidden_size"], dtype=torch.bfloat16)
    compared = 0
    for layer, block in zip(hf.model.layers, ours.decoder.blocks):
        if isinstance(block.ffn, MoEFeedForward):
            with torch.no_grad():
                want, got = layer.mlp(x).float(), block.ffn(x).float()
            _close(got, want, 2e-2)  # measured 2e-3 to 4e-3: bf16 rounding of a sum formed in another order
            compared += 1
    assert compared
    out = generate(ours, torch.randint(3, BASE["vocab_size"], (1, 6)), max_new_tokens=8, min_new_tokens=8)
    assert out.shape == (1, 14)


def test_qkv_finetune_on_a_qwen2_moe_chat_folder_writes_a_qwen2_moe_folder(tmp_path, capsys):
    """qkv finetune (full) on a Qwen2-MoE folder: the aux loss is logged, OUT is a qwen2_moe folder
    transformers loads with qkv's logits."""
    import sys
    from pathlib import Path

    from qkv.cli.main import main

    sys.path.insert(0, str(Path(__file__).parents[1] / "finetune"))
    from _chatfolders import write_tokenizer

    src, out = tmp_path / "src", tmp_path / "out"
    ids = write_tokenizer(src, vocab=BASE["vocab_size"])
    hf = build_hf("qwen2_moe-shared-sparse-step", bos_token_id=ids["<|endoftext|>"],
                  eos_token_id=ids["<|im_end|>"])
    hf.save_pretrained(src)
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in (("Who wrote Hamlet?", "Shakespeare."), ("What do bees make?", "Honey."))] * 4
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    assert main(["finetune", str(src), "--data", str(data), "--out", str(out), "--no-progress",
                 "train.max_steps=4",
                 "train.batch_size=4", "train.plot=false", "train.tensorboard=false"]) == 0
    capsys.readouterr()
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2_moe"
    logged = [json.loads(line) for line in next(out.rglob("metrics.jsonl")).read_text().splitlines()]
    assert any("aux_loss" in r for r in logged)
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.randint(0, BASE["vocab_size"], (1, 12))
    with torch.no_grad():
        _close(qkv.from_pretrained(out)(x).logits, back(x).logits)


def test_aux_loss_skips_padding_as_transformers_does(pair):
    name, hf, _, ours = pair
    ids = torch.randint(3, BASE["vocab_size"], (3, 12))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    mask[2, :7] = 0
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, output_router_logits=True).aux_loss
    ours.train()
    try:
        got = ours(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).aux_loss
        unmasked = ours(ids, labels=ids).aux_loss
    finally:
        ours.eval()
    torch.testing.assert_close(got.double(), want.double(), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(unmasked, got)  # the control: the padding did count without the mask
