"""Synthetic seq2seq tasks: batch layout per family, targets, determinism, held-out split, evaluation
(against an oracle and after real training), options and rebuild from a run folder."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from qkv.config import ConfigError
from qkv.tasks import build_task, load_task, task_from_dict
from qkv.tasks.tokenizers import EOS, PAD, SEP

TASKS = ["copy", "reverse", "sort", "addition"]


def reference(task: str, src: str, alphabet: str = "0123456789") -> str:
    """Independent definition of each task's answer."""
    if task == "copy":
        return src
    if task == "reverse":
        return "".join(reversed(src))
    if task == "sort":
        counts = {c: src.count(c) for c in alphabet}
        return "".join(c * counts[c] for c in alphabet)
    a, b = src.split("+")
    return str(int(a) + int(b))


def strip(row: list[int]) -> list[int]:
    return [i for i in row if i != -100]


@pytest.mark.parametrize("name", TASKS)
@pytest.mark.parametrize("family", ["encdec", "gpt"])
def test_batch_layout_decodes_to_the_examples(name, family):
    task = build_task(name, family=family, seed=3)
    tok = task.tokenizer
    pairs = task.pairs(7, 16, "train")
    batch = task.batch(7, 16)
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    assert ids.dtype == labels.dtype == torch.long
    assert ids.shape == mask.shape and ids.shape[0] == 16
    assert torch.equal(mask.bool(), mask.bool().cumprod(1).bool())  # right padding: 1...1 0...0
    assert bool((ids[~mask.bool()] == PAD).all())
    for b, (src, tgt) in enumerate(pairs):
        assert tgt == reference(name, src)
        n = int(mask[b].sum())
        row, lab = ids[b, :n].tolist(), labels[b].tolist()
        if family == "encdec":
            assert tok.decode(row) == src and len(row) == len(src)
            assert strip(lab)[-1] == EOS and tok.decode(strip(lab)) == tgt
            assert len(strip(lab)) == len(tgt) + 1
        else:
            assert row.count(SEP) == 1 and row[-1] == EOS
            cut = row.index(SEP)
            assert tok.decode(row[:cut]) == src and tok.decode(row[cut + 1:]) == tgt
            # labels: -100 on the prompt and the padding, the ids themselves on target + eos
            assert lab[: cut + 1] == [-100] * (cut + 1)
            assert lab[cut + 1: n] == row[cut + 1:]
            assert lab[n:] == [-100] * (len(lab) - n)
    assert ids.shape[1] <= task.context_length
    if family == "encdec":  # decoder positions: [bos, target] in, [target, eos] out
        assert labels.shape[1] <= task.context_length


@pytest.mark.parametrize("name", TASKS)
def test_lengths_and_symbols_follow_the_options(name):
    if name == "addition":
        task = build_task(name, digits=4, min_digits=3)
        for src, tgt in task.pairs(0, 200, "train"):
            a, b = src.split("+")
            assert 3 <= len(a) <= 4 and 3 <= len(b) <= 4 and a[0] != "0" and b[0] != "0"
            assert tgt == reference(name, src)
        assert {len(s.split("+")[0]) for s, _ in task.pairs(1, 200, "train")} == {3, 4}
        rev = build_task(name, reverse_answer=True)
        s, t = rev.pairs(0, 1, "train")[0]
        assert t[::-1] == reference(name, s)
        return
    task = build_task(name, min_len=4, max_len=6, symbols="abc")
    pairs = task.pairs(0, 300, "train")
    assert {len(s) for s, _ in pairs} == {4, 5, 6}
    assert set("".join(s for s, _ in pairs)) == set("abc")
    assert all(t == reference(name, s, "abc") for s, t in pairs)


@pytest.mark.parametrize("name", TASKS)
def test_deterministic_in_seed_split_and_index(name):
    a, b = build_task(name, seed=1), build_task(name, seed=1)
    for split in ("train", "val"):
        assert all(torch.equal(a.batch(5, 8, split)[k], b.batch(5, 8, split)[k])
                       for k in a.batch(5, 8, split))
    assert a.pairs(5, 8, "train") != a.pairs(6, 8, "train")
    assert a.pairs(5, 8, "train") != build_task(name, seed=2).pairs(5, 8, "train")
    assert a.eval_pairs(20) == b.eval_pairs(20) == a.eval_pairs(30)[:20]


@pytest.mark.parametrize("name,opts", [
    ("reverse", dict(min_len=3, max_len=6)),
    ("copy", dict(min_len=1, max_len=3, symbols="01")),  # 14 sources in all: the split must still hold
    ("addition", dict(digits=2)),
])
def test_held_out_split_is_disjoint(name, opts):
    task = build_task(name, val_fraction=0.3, **opts)
    train = {s for i in range(40) for s, _ in task.pairs(i, 64, "train")}
    val = {s for i in range(10) for s, _ in task.pairs(i, 64, "val")} | {s for s, _ in task.eval_pairs(200)}
    assert train and val
    assert not train & val
    if name == "copy":  # the tiny space is covered completely by the two splits
        space = {"".join(p) for n in (1, 2, 3) for p in itertools.product("01", repeat=n)}
        assert train | val == space


class Oracle(nn.Module):
    """Answers with the reference answer (or a corrupted one), through the same generate() interface
    the real models have: encdec returns target ids, gpt returns prompt + continuation."""

    def __init__(self, task, corrupt: str | None = None) -> None:
        super().__init__()
        self.task, self.corrupt = task, corrupt
        self.w = nn.Parameter(torch.zeros(1))
        self.calls = []

    def generate(self, x, max_new_tokens, *, attention_mask=None, eos_token_id=None, do_sample=False):
        assert not do_sample  # a translation is decided, not sampled
        tok, fam = self.task.tokenizer, self.task.family
        self.calls.append(x.clone())
        rows = []
        for b in range(x.shape[0]):
            prompt = x[b].tolist()
            src = tok.decode(prompt if fam == "encdec" else prompt[:-1])
            ans = tok.encode(reference(self.task.name, src))
            if self.corrupt == "last":
                ans[-1] = tok.stoi["1"] if ans[-1] != tok.stoi["1"] else tok.stoi["2"]
            tail = ans + ([tok.stoi["7"]] if self.corrupt == "extra" else []) + [eos_token_id]
            rows.append(tail[:max_new_tokens])
        width = max(len(r) for r in rows)
        out = torch.full((len(rows), width), eos_token_id)
        for b, r in enumerate(rows):
            out[b, : len(r)] = torch.tensor(r)
        return out if fam == "encdec" else torch.cat([x, out], dim=1)


@pytest.mark.parametrize("family", ["encdec", "gpt"])
@pytest.mark.parametrize("name", TASKS)
def test_evaluate_scores_an_oracle(name, family):
    task = build_task(name, family=family, min_len=2, max_len=9) if name != "addition" else \
        build_task(name, family=family)
    m = Oracle(task)
    res = task.evaluate(m, n=50, batch_size=16)
    assert res["exact_match"] == 1.0 and res["token_accuracy"] == 1.0 and res["n"] == 50
    if family == "gpt":  # prompts grouped by length: no padding inside any generate call
        assert not any(bool((c == PAD).any()) for c in m.calls)
        assert len(m.calls) >= len({len(s) for s, _ in task.eval_pairs(50)}) > 1
    wrong = task.evaluate(Oracle(task, corrupt="last"), n=50)
    assert wrong["exact_match"] == 0.0 and 0.5 < wrong["token_accuracy"] < 1.0
    # one extra token before <eos> is wrong, even though every target position is right
    extra = task.evaluate(Oracle(task, corrupt="extra"), n=50)
    assert extra["exact_match"] == 0.0
    lines = task.samples(Oracle(task), n=3)
    assert len(lines) == 3 and all(line.endswith("(ok)") for line in lines)


def _train(task, model, steps, lr=3e-3, batch_size=32):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for i in range(steps):
        out = model(**task.batch(i, batch_size))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    return out.loss.item()


def test_tiny_encoder_decoder_learns_copy_end_to_end():
    task = build_task("copy", family="encdec", min_len=3, max_len=5)
    model = task.build_model("transformer-tiny", d_model=64, n_heads=4, d_ff=128, n_encoder_layers=1,
                             n_decoder_layers=1)
    _train(task, model, 200)
    res = task.evaluate(model, n=100)
    assert res["exact_match"] >= 0.9, res
    assert task.generate_text(model, "4321", num_beams=3) == task.generate_text(model, "4321") == "4321"


def test_tiny_gpt_learns_copy_end_to_end():
    task = build_task("copy", family="gpt", min_len=3, max_len=5)
    model = task.build_model("gpt-nano", d_model=64, n_heads=4, d_ff=128, n_layers=2)
    _train(task, model, 300)
    res = task.evaluate(model, n=100)
    assert res["exact_match"] >= 0.9, res
    assert task.generate_text(model, "123") == task.generate_text(model, "123", num_beams=3) == "123"


def test_tiny_lstm_learns_copy_end_to_end():
    """The LSTM baseline on the decoder-only layout, decoded by its own generate()."""
    task = build_task("copy", family="lstm", min_len=3, max_len=5)
    model = task.build_model("lstm-tiny", d_model=128, n_layers=1)
    _train(task, model, 300, lr=1e-2)
    res = task.evaluate(model, n=100)
    assert res["exact_match"] >= 0.9, res


def test_model_overrides_fit_the_batches():
    for family, preset in (("encdec", "transformer-tiny"), ("gpt", "gpt-nano"), ("lstm", "lstm-tiny")):
        task = build_task("reverse", family=family, min_len=10, max_len=20)
        model = task.build_model(preset, d_model=48) if family != "encdec" else task.build_model(preset)
        over = task.model_overrides()
        assert model.config.context_length == over["context_length"]
        longest = task.collate([("9" * 20, "9" * 20)])
        assert torch.isfinite(model(**longest).loss)
    enc = build_task("reverse", family="encdec").model_overrides()
    assert (enc["pad_token_id"], enc["bos_token_id"], enc["eos_token_id"]) == (0, 1, 2)
    with pytest.raises(ConfigError, match="built for family"):
        build_task("reverse", family="encdec").model_overrides("gpt")
    with pytest.raises(ConfigError, match="is a gpt model"):
        build_task("reverse", family="encdec").build_model("gpt-nano")


def test_option_and_name_errors():
    with pytest.raises(ConfigError, match="did you mean 'max_len'"):
        build_task("reverse", max_lenn=5)
    with pytest.raises(ConfigError, match=r"task.max_len must be at least min_len \(9\), got 3"):
        build_task("reverse", min_len=9, max_len=3)
    with pytest.raises(ConfigError, match="task.min_len: expected an integer"):
        build_task("reverse", min_len="three")
    with pytest.raises(ConfigError, match="did you mean 'reverse'"):
        build_task("reverce")
    with pytest.raises(ConfigError, match="supports model families"):
        build_task("reverse", family="bert")
    with pytest.raises(ConfigError, match="distinct"):
        build_task("copy", symbols="aab")
    with pytest.raises(ValueError, match="split"):
        build_task("copy").batch(0, 2, "test")


def test_rebuild_from_dict_and_run_folder(tmp_path):
    task = build_task("addition", family="gpt", digits=4, seed=9)
    d = task.to_dict()
    assert d == {"task": "addition", "family": "gpt", "options": {
        "digits": 4, "min_digits": 1, "reverse_answer": False, "seed": 9, "val_fraction": 0.1}}
    again = task_from_dict(d)
    assert torch.equal(again.batch(3, 8)["input_ids"], task.batch(3, 8)["input_ids"])
    task.save(tmp_path)
    loaded = load_task(tmp_path)
    assert loaded.to_dict() == d and loaded.tokenizer.itos == task.tokenizer.itos
    assert torch.equal(loaded.batch(3, 8)["labels"], task.batch(3, 8)["labels"])
    with pytest.raises(ConfigError, match="no task.json"):
        load_task(tmp_path / "nowhere")


# -- relative positions have no hard limit; qkv generate honours max_new_tokens ------------
def test_relative_positions_take_sources_longer_than_the_context():
    task = build_task("reverse", family="encdec", min_len=3, max_len=5)
    long_src = task.tokenizer.encode("0123456789012")  # 13 symbols; the context is max(5, 5 + 2) = 7
    for position in ("rope", "alibi", "none"):
        model = task.build_model("transformer-tiny", position=position, d_model=32, n_heads=2, d_ff=64).eval()
        assert model.config.context_length == 7 and model.context_limit is None
        (pred,) = task.predict_ids(model, [long_src])
        assert len(pred) <= task.max_tgt_tokens + 1
    absolute = task.build_model("transformer-tiny", position="sinusoidal", d_model=32, n_heads=2,
                                d_ff=64).eval()
    with pytest.raises(ValueError, match="source sequence of length 13 exceeds the model's context of 7"):
        task.predict_ids(absolute, [long_src])


def test_generate_text_honours_max_new_tokens_for_seq2seq_runs(tmp_path):
    from qkv.run import generate_text

    task = build_task("reverse", family="encdec", min_len=3, max_len=5)
    seven = task.tokenizer.encode("7")[0]

    def always_seven(position):
        """A model whose every next token is '7' (never <eos>): the output length is what the loop allows."""
        m = task.build_model("transformer-tiny", position=position, d_model=32, n_heads=2, d_ff=64,
                             share_embeddings=False)
        with torch.no_grad():  # the final (Pre-LN) norm emits one constant vector e; the head ranks '7' first
            m.decoder.final_norm.weight.zero_()
            m.decoder.final_norm.bias.copy_(torch.nn.functional.one_hot(torch.tensor(0), 32).float())
            m.lm_head.weight.zero_()
            m.lm_head.weight[seven, 0] = 1.0
        return m

    task.save(tmp_path)
    always_seven("rope").save_pretrained(tmp_path)
    assert generate_text(tmp_path, "123", max_new_tokens=30, greedy=True) == "7" * 30  # it used to stop at 6
    assert generate_text(tmp_path, "123", greedy=True) == "7" * (task.max_tgt_tokens + 1)  # the task's length
    # a decoder with an absolute position table stops at its last position, and says so
    always_seven("learned").save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="goes past this model's 7 decoder positions; generating at most 6"):
        assert generate_text(tmp_path, "123", max_new_tokens=30, greedy=True) == "7" * 6
