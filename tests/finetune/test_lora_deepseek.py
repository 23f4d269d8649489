"""LoRA on a DeepSeek-V3 folder (multi-head latent attention + mixture of experts, nn/mla.py, nn/moe.py):
which layers the targets name (q, k, v on MLA's projections, DeepSeek's own names, every expert), decoding
with unmerged adapters (the absorbed step reads kv_b_proj's adapted weight), and `qkv finetune --task chat
--lora` end to end: the loss falls, only the adapted weights move (the router's selection bias stays too),
and the merged folder loads in transformers with qkv's logits."""

from __future__ import annotations

import shutil

import pytest
import torch
from _chatfolders import CHATML, _write_tokenizer_config
from test_chat_recipe import _finetune, chats, write_jsonl

from qkv import from_pretrained
from qkv.finetune.lora import LoRAConfig, apply_lora, lora_layers

transformers = pytest.importorskip("transformers")

R = 4
# every Linear of the DeepSeek attention by its transformers name, and the (per-expert) feed-forward ones
DEEPSEEK_NAMES = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
                  "down_proj"]


@pytest.fixture(scope="module")
def deepseek_chat(tmp_path_factory, gpt2_chat):
    """A random DeepseekV3ForCausalLM folder: layer 0 dense, layer 1 four routed experts (top 2 of 2 groups)
    and a shared one; gpt2_chat's tokenizer and ChatML template."""
    from tokenizers import Tokenizer

    folder = tmp_path_factory.mktemp("deepseek_chat") / "model"
    folder.mkdir(parents=True)
    shutil.copyfile(gpt2_chat / "tokenizer.json", folder / "tokenizer.json")
    _write_tokenizer_config(folder, CHATML)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    cfg = transformers.DeepseekV3Config(
        vocab_size=400, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
        q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, max_position_embeddings=128,
        tie_word_embeddings=False, initializer_range=0.1, bos_token_id=tok.token_to_id("<|endoftext|>"),
        eos_token_id=tok.token_to_id("<|im_end|>"), pad_token_id=tok.token_to_id("<|endoftext|>"))
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        hf.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    hf.save_pretrained(folder)
    return folder


def _modules(info) -> set[str]:
    return {name.split("attn.")[-1].split("ffn.")[-1] for name in info["modules"]}


def test_targets_on_latent_attention_and_experts(deepseek_chat):
    model = from_pretrained(deepseek_chat)
    qv = apply_lora(model, LoRAConfig(rank=R, targets=["q", "v"]))  # the default: W_q and W_v
    assert set(qv["modules"]) == {f"decoder.blocks.{i}.attn.{n}" for i in (0, 1)
                                  for n in ("q_b_proj", "kv_b_proj")}
    names = apply_lora(from_pretrained(deepseek_chat), LoRAConfig(rank=R, targets=DEEPSEEK_NAMES))
    every = apply_lora(from_pretrained(deepseek_chat), LoRAConfig(rank=R, targets=["all-linear"]))
    assert names["modules"] == every["modules"]
    experts = {f"experts.{e}.{w}" for e in range(4) for w in ("gate", "up", "down")}
    assert experts | {"shared.gate", "shared.up", "shared.down"} <= _modules(every)
    # r * (in + out) per adapted Linear, from the config's sizes
    attn = [(64, 24), (24, 4 * 24), (64, 16 + 8), (16, 4 * (16 + 12)), (4 * 12, 64)]
    dense = [(64, 96), (64, 96), (96, 64)]
    expert = [(64, 24), (64, 24), (24, 64)]
    per_layer = 2 * attn + dense + 5 * expert  # 4 routed experts and the shared one
    assert every["trainable"] == sum(R * (i + o) for i, o in per_layer)


def test_decoding_with_unmerged_adapters_equals_the_full_forward(deepseek_chat):
    """The absorbed decoding step folds kv_b_proj's weight into the query and output: with adapters on it the
    step must use W + scaling * B A, as the forward does (static cache, and the Engine's paged one)."""
    from qkv.generate import Engine, generate

    model = from_pretrained(deepseek_chat).double().eval()
    apply_lora(model, LoRAConfig(rank=R, targets=["all-linear"]))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, m in lora_layers(model):
            for B in m.lora_B:
                B.copy_(torch.randn(B.shape, generator=g, dtype=B.dtype) * 0.5)
    ids = torch.randint(3, 400, (1, 9), generator=g)
    with torch.no_grad():
        full = model(ids).logits[:, -1]
        cache = model.make_cache(1, 16)
        model.prefill(ids[:, :-1], cache)
        torch.testing.assert_close(model.step(ids[:, -1:], cache), full, rtol=1e-10, atol=1e-10)
    want = generate(model, ids, max_new_tokens=8, min_new_tokens=8, use_cache=False)
    assert torch.equal(generate(model, ids, max_new_tokens=8, min_new_tokens=8), want)
    engine = Engine(model, block_size=4)
    rid = engine.add_request(ids[0], max_new_tokens=8, min_new_tokens=8)
    assert engine.run()[rid] == want[0, 9:].tolist()


def test_finetune_chat_lora_on_deepseek_trains_and_exports(deepseek_chat, tmp_path, capsys):
    from qkv.finetune.chat import assistant_loss, build_examples, read_chats
    from qkv.interop.tokenizer import load_hf_tokenizer

    data = write_jsonl(tmp_path / "train.jsonl", chats())
    out = tmp_path / "out"
    assert _finetune(deepseek_chat, data, out, "--lora", "--lora-rank", str(R), "--lora-targets",
                     ",".join(DEEPSEEK_NAMES), "--lora-dropout", "0", "train.max_steps=60", "train.lr=1e-2",
                     "train.warmup=5", "train.batch_size=4") == 0
    assert "LoRA merged" in capsys.readouterr().out
    tok = load_hf_tokenizer(deepseek_chat)
    ex, _ = build_examples(tok, read_chats(data), 96, "train", "error")
    base, tuned = from_pretrained(deepseek_chat).eval(), from_pretrained(out).eval()
    assert assistant_loss(tuned, ex, 0) < 0.5 * assistant_loss(base, ex, 0)
    # only the adapted Linears moved: norms, embeddings, head, routers and their selection bias are the base's
    sd_base, sd_tuned = base.state_dict(), tuned.state_dict()
    changed = {k for k in sd_base if not torch.equal(sd_base[k], sd_tuned[k])}
    adapted = {f"{n}.weight" for n in apply_lora(from_pretrained(deepseek_chat),
                                                  LoRAConfig(rank=R, targets=DEEPSEEK_NAMES))["modules"]}
    assert changed == adapted and any(".experts." in k for k in changed)
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(out).eval()
    n = min(len(ex[0].input_ids), len(ex[1].input_ids))
    x = torch.tensor([ex[0].input_ids[:n], ex[1].input_ids[:n]])
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, tuned(x).logits, rtol=1e-4, atol=1e-4)
