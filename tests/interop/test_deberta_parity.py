"""DeBERTa-v2/v3 folders (random tiny DebertaV2Config models built here) load into qkv's DeBERTa with the same
hidden states, attention maps and classifier logits as transformers, at every position of padded batches;
export writes folders transformers reads back to the same outputs; unsupported settings are refused by
name."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.models.deberta_v2 import modeling_deberta_v2 as hf_deberta  # noqa: E402

import qkv  # noqa: E402
from qkv.interop.deberta import export_deberta  # noqa: E402
from qkv.nn.disentangled import log_buckets, relative_positions  # noqa: E402
from qkv.storage import CheckpointError  # noqa: E402

CLASSES = {"none": "DebertaV2Model", "classify": "DebertaV2ForSequenceClassification",
           "tag": "DebertaV2ForTokenClassification"}
# (position_buckets, max_relative_positions, pos_att_type, norm_rel_ebd): v3's shape scaled down, no
# bucketing, one term only, c2p alone without the table norm, and max_relative_positions from the context
SETTINGS = [(8, 32, ["p2c", "c2p"], "layer_norm"), (-1, 6, ["p2c", "c2p"], "layer_norm"),
            (4, 16, ["p2c"], "layer_norm"), (16, 64, ["c2p"], "none"), (6, -1, "c2p|p2c", "layer_norm")]


def hf_config(buckets: int = 8, max_rel: int = 32, terms: object = ("p2c", "c2p"), norm: str = "layer_norm",
              **kw: object) -> object:
    base = dict(vocab_size=90, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=48,
                max_position_embeddings=40, relative_attention=True, position_buckets=buckets,
                max_relative_positions=max_rel,
                pos_att_type=list(terms) if not isinstance(terms, str) else terms,
                share_att_key=True, norm_rel_ebd=norm, position_biased_input=False, type_vocab_size=0,
                num_labels=3, pad_token_id=0)
    return transformers.DebertaV2Config(**{**base, **kw})


def randomise(model: torch.nn.Module) -> None:
    """LayerNorm scales and all biases away from their 1 / 0 initialisation, so a mapping that drops or
    swaps one of them cannot pass."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.3)
            elif "LayerNorm" in name:
                p.uniform_(0.6, 1.4)


def make_folder(path, head: str = "none", seed: int = 0, **cfg: object):
    torch.manual_seed(seed)
    model = getattr(transformers, CLASSES[head])(hf_config(**cfg)).eval()
    randomise(model)
    model.save_pretrained(path)
    return model


def batch(seed: int = 1, T: int = 23) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 90, (3, T), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    mask[2, 4:] = 0
    return ids.masked_fill(mask == 0, 0), mask


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).detach().abs().max() / ref.detach().abs().max())


@pytest.mark.parametrize("buckets", [4, 8, 32, 256])
@pytest.mark.parametrize("max_position", [16, 64, 512])
def test_log_buckets_equal_the_reference(buckets, max_position):
    rel = torch.arange(-700, 701)
    if max_position - 1 <= buckets // 2:
        # the reference's log scale is then <= 0: only the exact band is meaningful, and only it is compared
        rel = rel[rel.abs() <= buckets // 2]
    want = hf_deberta.make_log_bucket_position(rel, buckets, max_position).long()
    assert torch.equal(log_buckets(rel, buckets, max_position), want)
    q = torch.zeros(1, 37, 4)
    assert torch.equal(relative_positions(37, 37, buckets, max_position),
                       hf_deberta.build_relative_position(q, q, buckets, max_position)[0])


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: f"b{s[0]}-m{s[1]}-{s[2]}-{s[3]}")
@pytest.mark.parametrize("head", ["none", "classify", "tag"])
def test_outputs_equal_transformers_at_every_position(tmp_path, setting, head):
    buckets, max_rel, terms, norm = setting
    hf = make_folder(tmp_path, head, buckets=buckets, max_rel=max_rel, terms=terms, norm=norm)
    ours = qkv.from_pretrained(tmp_path)
    assert type(ours).__name__ == "DeBERTa" and ours.config.head == head and not ours.training
    ids, mask = batch()
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, output_attentions=True)
        got = ours(ids, attention_mask=mask, return_attentions=True)
    if head == "none":
        assert rel_err(got.last_hidden_state, ref.last_hidden_state) < 1e-4
        for mine, theirs in zip(got.attentions, ref.attentions):
            assert rel_err(mine["self"], theirs) < 1e-4  # padded query rows too: uniform, as there
    else:
        assert got.logits.shape == ref.logits.shape
        assert rel_err(got.logits, ref.logits) < 1e-4
    if head == "classify":  # the batch's rows are independent: one row alone gives its logits
        with torch.no_grad():
            alone = ours(ids[2:, :4]).logits
        assert rel_err(alone, ref.logits[2:]) < 1e-4


def test_float64_agrees_to_1e10_and_sequences_longer_than_the_buckets(tmp_path):
    """In float64 the two computations agree to rounding, so any term, scale or index that differs shows; a
    sequence of 60 tokens reaches far past the exact band (4 positions) into the log buckets."""
    hf = make_folder(tmp_path, "tag", buckets=8, max_rel=24, max_position_embeddings=64).double()
    ours = qkv.from_pretrained(tmp_path).double()
    ids, mask = batch(T=60)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    assert rel_err(got, ref) < 1e-10


def test_training_forward_on_real_tokens_equals_eval(tmp_path):
    """Training runs the token-wise layers on the real tokens only (unpadded rows): without dropout the real
    tokens' logits are the eval-mode ones, and gradients flow to the relative table."""
    make_folder(tmp_path, "tag", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ours = qkv.from_pretrained(tmp_path)
    ids, mask = batch()
    with torch.no_grad():
        want = ours(ids, attention_mask=mask).logits
    ours.train()
    labels = torch.randint(0, 3, ids.shape).masked_fill(mask == 0, -100)
    out = ours(ids, attention_mask=mask, labels=labels)
    real = mask.bool()
    assert rel_err(out.logits[real], want[real]) < 1e-5
    out.loss.backward()
    assert ours.encoder.position.rel_emb.weight.grad.abs().sum() > 0
    assert ours.encoder.position.norm.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("head", ["none", "classify", "tag"])
def test_export_round_trip(tmp_path, head):
    hf = make_folder(tmp_path / "src", head, buckets=4, max_rel=16)
    ours = qkv.from_pretrained(tmp_path / "src")
    names = {0: "neg", 1: "neu", 2: "pos"} if head != "none" else None
    export_deberta(ours, tmp_path / "out", base_config=hf.config.to_dict(), id2label=names)
    back = getattr(transformers, CLASSES[head]).from_pretrained(tmp_path / "out").eval()
    assert type(back).__name__ == CLASSES[head]
    want = hf.state_dict()
    for k, v in back.state_dict().items():
        assert torch.equal(v, want[k]), k
    if names:
        assert back.config.id2label[2] == "pos"
    again = qkv.from_pretrained(tmp_path / "out")
    ids, mask = batch()
    with torch.no_grad():
        a, b = ours(ids, attention_mask=mask), again(ids, attention_mask=mask)
    assert torch.equal(a.last_hidden_state, b.last_hidden_state)


def test_a_pretraining_checkpoint_loads_as_the_encoder(tmp_path):
    """Released v3 checkpoints carry the MLM head (lm_predictions.*) and the RTD discriminator
    (mask_predictions.*): they load as the bare encoder, equal to DebertaV2Model."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    cfg = hf_config(legacy=False)
    mlm = transformers.DebertaV2ForMaskedLM(cfg).eval()
    randomise(mlm)
    mlm.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in mlm.state_dict().items() if "decoder" not in k}
    d = cfg.hidden_size
    state.update({"mask_predictions.dense.weight": torch.randn(d, d),
                  "mask_predictions.dense.bias": torch.randn(d),
                  "mask_predictions.LayerNorm.weight": torch.ones(d),
                  "mask_predictions.LayerNorm.bias": torch.zeros(d),
                  "mask_predictions.classifier.weight": torch.randn(1, d),
                  "mask_predictions.classifier.bias": torch.zeros(1)})
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ours = qkv.from_pretrained(tmp_path)
    assert ours.config.head == "none"
    ids, mask = batch()
    with torch.no_grad():
        ref = mlm.deberta(input_ids=ids, attention_mask=mask).last_hidden_state
        got = ours(ids, attention_mask=mask).last_hidden_state
    assert rel_err(got, ref) < 1e-4


@pytest.mark.parametrize("field, value", [
    ("conv_kernel_size", 3), ("position_biased_input", True), ("share_att_key", False),
    ("relative_attention", False), ("embedding_size", 16), ("norm_rel_ebd", "batch_norm"),
    ("pos_att_type", ["p2p"]), ("hidden_act", "swish"),
])
def test_unsupported_settings_are_refused_by_name(tmp_path, field, value):
    make_folder(tmp_path)
    cfg = transformers.DebertaV2Config.from_pretrained(tmp_path)
    setattr(cfg, field, value)
    cfg.save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=field):
        qkv.from_pretrained(tmp_path)
