import torch

from qkv.train import param_groups


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
        assert changed == (n.endswith("weight") and p.dim() == 2 and "emb" not in n and "position" not in n), n
