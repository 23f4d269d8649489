"""The explorer's generation view on a multi-head latent attention model (a tiny random-weight Hugging Face
DeepSeek-V3 folder): the replay runs through the model's own paged cache (latents, not per-head K/V), its
logits are a full forward's, and the cache bytes are the latent's."""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
KV_LORA, ROPE, LAYERS = 16, 8, 2


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    folder = tmp_path_factory.mktemp("explore_mla") / "model"
    cfg = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        kv_lora_rank=KV_LORA, q_lora_rank=24, qk_rope_head_dim=ROPE, qk_nope_head_dim=16, v_head_dim=12,
        max_position_embeddings=128,
        tie_word_embeddings=False, initializer_range=0.1, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.DeepseekV3ForCausalLM(cfg).save_pretrained(folder)
    return folder


def test_generation_view_runs_on_latent_attention(deepseek, clients):
    from qkv import from_pretrained

    prompt, n_new, bs = [5, 9, 3, 17, 40], 6, 4
    r = clients(deepseek).post("/api/generate", json={"input": " ".join(map(str, prompt)),
                                                      "max_new_tokens": n_new, "block_size": bs})
    assert r.status_code == 200, r.text
    g = r.json()
    model = from_pretrained(deepseek).eval()
    seq = prompt + [s["token"] for s in g["steps"]]
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0].double()
    per_pos = (KV_LORA + ROPE) * 4  # one position's latent and rotary key, fp32, one layer
    assert g["cache"]["bytes_per_position_per_layer"] == per_pos
    for s, step in enumerate(g["steps"]):
        p = logits[len(prompt) + s - 1].softmax(-1)
        assert step["top"][0]["id"] == step["token"] == int(p.argmax())
        assert step["top"][0]["p"] == pytest.approx(float(p.max()), abs=2e-5)
        c, pos = step["cache"], len(prompt) + s
        assert c["positions"] == pos and c["used_per_layer"] == per_pos * pos
        assert c["paged_blocks"] == math.ceil(pos / bs)
        assert c["paged_per_layer"] == per_pos * bs * c["paged_blocks"]
        assert c["static_per_layer"] == per_pos * (len(prompt) + n_new)
