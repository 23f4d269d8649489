"""Attention maps are the naive backend's softmax probabilities; diagnostics flag one-hot / uniform heads."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.experiments.attention import attention_maps, collect_attentions, tokenize
from qkv.experiments.diagnostics import diagnose, flag_heads, head_stats, record_scores
from qkv.experiments.numeric import softmax_saturation


def _gpt(**kw):
    torch.manual_seed(0)
    cfg = dict(vocab_size=20, n_layers=2, d_model=32, n_heads=4, context_length=16, attention="fused")
    cfg.update(kw)
    return qkv.build("gpt-nano", **cfg).eval()


def test_gpt_maps_rows_sum_to_one_causal_and_padding_zero():
    model = _gpt()
    ids = torch.randint(0, 20, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0  # right padding in the second sequence
    maps = collect_attentions(model, {"input_ids": ids, "attention_mask": mask})
    assert list(maps) == ["self"] and len(maps["self"]) == 2
    upper = torch.triu(torch.ones(9, 9, dtype=torch.bool), diagonal=1)
    for w in maps["self"]:
        assert w.shape == (2, 4, 9, 9)
        assert torch.all(w[:, :, upper] == 0)  # causal: nothing above the diagonal
        assert torch.all(w[1, :, :, 6:] == 0)  # padding columns
        rows = w.sum(-1)
        torch.testing.assert_close(rows[0], torch.ones_like(rows[0]))
        torch.testing.assert_close(rows[1, :, :6], torch.ones_like(rows[1, :, :6]))


def test_first_layer_map_matches_formula_from_weights():
    """Independent reference: softmax(q k^T / sqrt(d_k)) recomputed from the first block's weights."""
    model = _gpt(position="learned", placement="pre")
    ids = torch.randint(0, 20, (1, 7))
    w = collect_attentions(model, ids)["self"][0]
    blk = model.decoder.blocks[0]
    x = model.tok_emb(ids) + model.decoder.position.weight[:7]
    h = F.layer_norm(x, (32,), blk.norm1.weight, blk.norm1.bias, blk.norm1.eps)
    q, k, _ = (h @ blk.attn.qkv_proj.weight.T + blk.attn.qkv_proj.bias).split(32, dim=-1)
    q = q.view(1, 7, 4, 8).transpose(1, 2)
    k = k.view(1, 7, 4, 8).transpose(1, 2)
    s = q @ k.transpose(-1, -2) / math.sqrt(8)
    s = s.masked_fill(torch.triu(torch.ones(7, 7, dtype=torch.bool), 1), float("-inf"))
    torch.testing.assert_close(w, torch.softmax(s, -1), atol=1e-5, rtol=1e-4)


def test_encdec_three_kinds_and_png(tmp_path):
    torch.manual_seed(0)
    model = qkv.build("transformer-tiny", src_vocab_size=12, d_model=32, n_heads=2, d_ff=64).eval()
    src = torch.randint(3, 12, (1, 6))
    maps = collect_attentions(model, {"input_ids": src, "decoder_input_ids": torch.tensor([[1, 5, 6]])})
    assert set(maps) == {"encoder self", "decoder self", "cross"}
    assert maps["cross"][0].shape == (1, 2, 3, 6)
    assert torch.all(maps["encoder self"][0] > 0)  # bidirectional: no zeros without padding
    for kind in maps:
        torch.testing.assert_close(maps[kind][1].sum(-1), torch.ones(maps[kind][1].shape[:-1]))
    res = attention_maps(model, src[0].tolist(), None, tmp_path / "m.png", max_new_tokens=4)
    assert len(res.pngs) == 3 and all(p.is_file() and p.stat().st_size > 1000 for p in res.pngs)
    assert len(res.stats) == 3 * 2 * 2  # kinds x layers x heads
    assert res.json_path.is_file()


def test_tokenize_with_hf_tokenizers_object():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    assert tokenize(tok, "a b zz") == ([0, 1, 2], ["a", "b", "[UNK]"])
    assert tokenize(torch.tensor([[3, 4]]), None) == ([3, 4], ["3", "4"])


def test_head_stats_flags_onehot_and_uniform_heads():
    T = 6
    onehot = torch.zeros(1, 1, T, T)
    onehot[0, 0, torch.arange(T), torch.arange(T)] = 1.0  # each query attends to exactly one key
    uniform = torch.full((1, 1, T, T), 1.0 / T)
    mixed = torch.softmax(torch.tensor([3.0, 1.0, 0.0, 0.0, -1.0, 0.5]), -1).expand(1, 1, T, T)
    w = torch.cat([onehot, uniform, mixed], dim=1)  # (1, 3, T, T)
    stats = head_stats(w)
    assert stats[0].max_prob == pytest.approx(1.0) and stats[0].entropy == pytest.approx(0.0, abs=1e-9)
    assert stats[1].entropy == pytest.approx(1.0) and stats[1].entropy_nats == pytest.approx(math.log(T))
    flagged = flag_heads(stats)
    assert [(s.head, s.flag) for s in flagged] == [(0, "one-hot"), (1, "uniform")]


def test_head_stats_skips_single_key_rows_of_causal_maps():
    """Row 0 of a causal map sees one key and is one-hot by construction: it must not count."""
    T = 5
    causal = torch.tril(torch.ones(T, T))
    w = (causal / causal.sum(-1, keepdim=True)).view(1, 1, T, T)  # uniform over visible keys
    (s,) = head_stats(w, visible=causal.bool())
    assert s.entropy == pytest.approx(1.0)
    assert s.max_prob == pytest.approx(sum(1 / n for n in range(2, T + 1)) / (T - 1))
    assert flag_heads([s])[0].flag == "uniform"


def test_diagnose_scores_match_manual_and_unscaled_is_larger():
    ids = torch.randint(0, 20, (2, 10))
    d_scaled = diagnose(_gpt(d_model=64, n_heads=1, init_std=0.5), ids)
    d_raw = diagnose(_gpt(d_model=64, n_heads=1, init_std=0.5, scaled=False), ids)
    assert len(d_scaled.scores) == 2 and d_scaled.scores[0].module == "decoder.blocks.0.attn"
    assert d_scaled.scores[0].scale == pytest.approx(1 / 8) and d_raw.scores[0].scale == 1.0
    # Same weights (same seed), only the factor differs: the std of the scores differs by exactly sqrt(64).
    assert d_raw.scores[0].std == pytest.approx(8 * d_scaled.scores[0].std, rel=1e-4)
    assert len(d_raw.heads) == 2
    assert d_raw.heads[0].max_prob > d_scaled.heads[0].max_prob


def test_record_scores_restores_attention_function():
    import qkv.nn.attention as A

    before = A.scaled_dot_product_attention
    model = _gpt()
    with record_scores(model) as stats:
        model(torch.randint(0, 20, (1, 4)))
    assert A.scaled_dot_product_attention is before and len(stats) == 2


def test_qk_variance_grows_like_dk_and_softmax_saturates():
    rows = softmax_saturation((16, 256), n_queries=256, n_keys=64)
    by = {(r.d_k, r.scaled): r for r in rows}
    for d in (16, 256):  # Var(sum of d products of independent N(0,1)) = d
        assert by[(d, False)].var_qk == pytest.approx(d, rel=0.15)
        assert by[(d, True)].var_scores == pytest.approx(1.0, rel=0.15)
    assert by[(256, False)].max_prob > 0.8 > by[(256, True)].max_prob
    assert by[(256, False)].entropy < 0.15 < by[(256, True)].entropy


def test_attention_from_checkpoint_uses_saved_tokenizer(tmp_path):
    from qkv.checkpoint import save_model
    from qkv.experiments.attention import attention_from_checkpoint
    from qkv.tasks import build_task

    task = build_task("reverse", family="gpt", min_len=2, max_len=4)
    torch.manual_seed(0)
    model = task.build_model("gpt-nano", d_model=16, n_heads=2, n_layers=1)
    save_model(model, tmp_path / "final")
    task.save(tmp_path / "final")
    res = attention_from_checkpoint(tmp_path / "final", "3141", tmp_path / "maps.png")
    assert res.tokens["input"] == ["3", "1", "4", "1"]
    assert res.pngs == [tmp_path / "maps.png"] and res.pngs[0].is_file()
    assert [(s.layer, s.head) for s in res.stats] == [(0, 0), (0, 1)]
    # without a tokenizer the input is token ids
    save_model(model, tmp_path / "bare")
    res = attention_from_checkpoint(tmp_path / "bare", "5 6 7", tmp_path / "ids.png")
    assert res.tokens["input"] == ["5", "6", "7"]
    with pytest.raises(ValueError, match="token ids"):
        attention_from_checkpoint(tmp_path / "bare", "hello", tmp_path / "x.png")


def test_maps_of_hf_loaded_bert_equal_transformers_attentions(tmp_path):
    """Independent reference: a random Hugging Face BERT saved locally, loaded through qkv's HF loader; our
    maps must equal the probabilities transformers' eager attention returns."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=32,
                                  attn_implementation="eager")
    torch.manual_seed(0)
    hf = transformers.BertModel(cfg).eval()
    hf.save_pretrained(tmp_path / "bert")
    model = qkv.from_pretrained(tmp_path / "bert").eval()
    ids = torch.randint(0, 50, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    mine = collect_attentions(model, {"input_ids": ids, "attention_mask": mask})["self"]
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, output_attentions=True).attentions
    assert len(mine) == len(ref) == 2
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert torch.all(mine[0][1, :, :, 5:] == 0)
