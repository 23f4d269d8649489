import pytest
import torch

import qkv
from qkv.config import ConfigError, from_dict
from qkv.train import LambdaCallback, TrainConfig, Trainer, build_optimizer, param_groups
from qkv.train.optim import implementation, resolve_impl


def test_no_decay_on_norms_biases_embeddings(make_gpt):
    model = make_gpt()
    groups, summary = param_groups(model, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decay = {names[id(p)] for p in groups[0]["params"]}
    no_decay = {names[id(p)] for p in groups[1]["params"]}
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    # independent classification by module type
    expect_no = set()
    for mn, m in model.named_modules():
        for pn, _p in m.named_parameters(recurse=False):
            full = f"{mn}.{pn}" if mn else pn
            if isinstance(m, (torch.nn.Embedding, torch.nn.LayerNorm)) or pn == "bias" or "position" in full:
                expect_no.add(full)
    assert no_decay == expect_no
    assert decay == {n for n in names.values()} - expect_no
    assert all(model.get_parameter(n).dim() == 2 for n in decay)
    # tied LM head = token embedding: one tensor, in the no-decay group, counted once
    assert model.lm_head.weight is model.tok_emb.weight and "tok_emb.weight" in no_decay
    total = sum(p.numel() for g in groups for p in g["params"])
    assert total == model.num_parameters() == summary.decay_params + summary.no_decay_params


def test_weight_decay_reaches_only_matrices(make_gpt):
    # with zero gradients AdamW changes a parameter only through decay: norms/biases/embeddings stay put
    from qkv.train import build_optimizer

    model = make_gpt()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt, _ = build_optimizer(model, lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in model.named_parameters():
        changed = not torch.equal(before[n], p)
        assert (changed
                == (n.endswith("weight") and p.dim() == 2 and "emb" not in n and "position" not in n)), n


# -- which AdamW implementation runs (TrainConfig.optimizer_impl) --------------------------------------------

def test_auto_is_fused_on_cpu_and_bad_values_are_clear_errors(make_gpt):
    for impl, want in (("auto", "fused"), ("fused", "fused"), ("foreach", "foreach"), ("loop", "loop")):
        opt, _ = build_optimizer(make_gpt(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                 impl=impl)
        assert implementation(opt) == want
        # both flags explicit: torch's foreach=None would mean the per-parameter loop on CPU
        assert all(g["fused"] is (want == "fused") and g["foreach"] is (want == "foreach")
                       for g in opt.param_groups)
    # torch's own default (what qkv built before optimizer_impl existed) is the loop on CPU
    assert implementation(torch.optim.AdamW(make_gpt().parameters())) == "loop"
    with pytest.raises(ConfigError, match="optimizer_impl.*'fast'.*auto.*fused.*foreach.*loop"):
        from_dict(TrainConfig, {"optimizer_impl": "fast"})
    with pytest.raises(ConfigError, match="optimizer_impl.*'fast'"):
        TrainConfig(optimizer_impl="fast").validate()
    # where torch has no fused kernel (here the meta device; also e.g. MPS/XPU in torch 2.6), auto takes
    # foreach and an explicit fused is refused in one sentence
    meta = [torch.zeros(3, device="meta")]
    assert resolve_impl("auto", meta) == "foreach" and resolve_impl("auto", [torch.zeros(3)]) == "fused"
    with pytest.raises(ConfigError,
                       match="fused AdamW needs floating-point parameters on cpu or cuda, these are meta"):
        resolve_impl("fused", meta)


def _reference_run(model, data, cfg: TrainConfig) -> torch.nn.Module:
    """nanoGPT-style loop with torch's reference (per-parameter loop) AdamW, torch's clip_grad_norm_ and the
    schedule's LR: what the Trainer's update must equal (one micro-batch, so the mean loss is the token
    mean)."""
    from qkv.train import lr_at

    groups, _ = param_groups(model, cfg.weight_decay)
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, foreach=False,
                            fused=False)
    for step in range(1, cfg.max_steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, schedule=cfg.schedule, lr=cfg.lr, warmup=cfg.warmup_steps(),
                            max_steps=cfg.max_steps, min_lr=cfg.min_lr)
        model(**data.batch(step - 1, cfg.batch_size)).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


@pytest.mark.parametrize("impl", ["auto", "foreach", "loop"])
def test_trainer_update_equals_torchs_loop_adamw(impl, make_gpt, toy_data, cfg_factory):
    # fp32, two weight-decay groups, warmup + cosine decay to min_lr, clipping that bites: several updates of
    # the chosen implementation equal torch's reference loop to float rounding
    cfg = cfg_factory(max_steps=6, warmup=2, schedule="cosine", lr=3e-3, min_lr=3e-4, weight_decay=0.1,
                      clip_grad=0.05, optimizer_impl=impl)
    norms = []
    tr = Trainer(make_gpt(), cfg, toy_data,
                 callbacks=[LambdaCallback(on_step_end=lambda t, s, rec: norms.append(rec["grad_norm"]))])
    tr.fit()
    assert tr.optimizer_impl == {"auto": "fused"}.get(impl, impl)
    assert min(norms) > cfg.clip_grad  # every update was clipped
    ref = _reference_run(make_gpt(), toy_data, cfg)
    for (name, p), q in zip(tr.model.named_parameters(), ref.parameters()):
        # ~1.5e-6 apart at most here (the Trainer's token-normalised gradient rounds differently from the
        # mean loss's), against ~2e-2 of updates and ~3e-5 of weight decay per matrix element
        torch.testing.assert_close(p, q, rtol=1e-5, atol=5e-6, msg=name)


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_decoding_after_an_update_uses_the_updated_weights(impl, make_gpt):
    # the decoding step reads the updated parameters (no stale copy of them survives an optimizer step, fused
    # or not). Reference: greedy decoding by full forward passes
    torch.manual_seed(0)
    model = make_gpt().eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    model.generate(ids, 6)
    opt, _ = build_optimizer(model, lr=0.05, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, impl=impl)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    x = ids
    with torch.no_grad():
        for _ in range(6):
            x = torch.cat([x, model(x).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(model.generate(ids, 6), x)


class _Named(torch.nn.Module):
    """Parameters named like (and unlike) embeddings, none of them in an nn.Embedding."""

    def __init__(self):
        super().__init__()
        for name in ("ensemble_weight", "decomposition", "cls_emb", "pos_table", "cls_token", "mask_token",
                     "position_bias_matrix", "proj"):
            setattr(self, name, torch.nn.Parameter(torch.zeros(2, 2)))


def test_no_decay_matches_whole_words_of_a_parameter_name():
    from qkv.train.optim import no_decay_names

    assert (no_decay_names(_Named())
            == {"cls_emb", "pos_table", "cls_token", "mask_token", "position_bias_matrix"})


def _substring_rule(model):
    """The rule before it matched whole words (the reference the shipped models must still agree with)."""
    from qkv.nn.position import PositionalEncoding

    names = set()
    for mod_name, mod in model.named_modules():
        for p_name, p in mod.named_parameters(recurse=False):
            if p.dim() < 2 or isinstance(mod, (torch.nn.Embedding, PositionalEncoding)) or any(
                    part in p_name.lower()
                        for part in ("emb", "cls_token", "pos_", "position", "mask_token")):
                names.add(f"{mod_name}.{p_name}" if mod_name else p_name)
    return names


@pytest.mark.parametrize("preset", qkv.presets())
def test_the_shipped_presets_keep_their_decay_groups(preset):
    from qkv.train.optim import no_decay_names

    try:
        with torch.device("meta"):  # shapes only: no memory or init time for the large presets
            model = qkv.build(preset)
    except Exception:  # a preset that computes something at build time (whisper's features)
        model = qkv.build(preset)
    assert no_decay_names(model) == _substring_rule(model)
