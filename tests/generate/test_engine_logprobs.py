"""The Engine's log-probabilities (a prompt's, computed in prefill; each new token's with its most likely
alternatives) equal transformers' log-softmax of the same model's logits, whatever the chunking and the
prefix cache; n > 1 samples share the prompt's blocks (copy-on-write) and each equals the request it stands
for alone (seed + i)."""

from __future__ import annotations

import pytest
import torch

from qkv.generate import GenerationConfig
from qkv.generate.engine import Engine


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """(transformers GPT-2 with random weights, the same folder loaded by qkv)."""
    import transformers

    from qkv.run import load_model_any

    path = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=97, n_positions=128, n_embd=32, n_layer=2, n_head=2,
                                  bos_token_id=0, eos_token_id=1, initializer_range=0.3)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    hf.save_pretrained(path)
    return hf, load_model_any(path).eval()


def reference(hf, ids):
    """(T, V) log-softmax of transformers' logits, float64."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)


PROMPT = [(7 * i + 3) % 97 for i in range(45)]


@pytest.mark.parametrize("chunk", [None, 16, 7])
def test_prompt_logprobs_equal_transformers(gpt2, chunk):
    hf, model = gpt2
    engine = Engine(model, block_size=8, prefill_chunk=chunk)
    # the same prompt computed first: its blocks are in the prefix cache, which must not hide their logits
    engine.add_request(PROMPT, max_new_tokens=1)
    engine.run()
    rid = engine.add_request(PROMPT, max_new_tokens=0, prompt_logprobs=5)
    engine.run()
    got = engine.prompt_logprobs(rid)
    ref = reference(hf, PROMPT)
    assert got[0] is None and len(got) == len(PROMPT)
    for j in range(1, len(PROMPT)):
        assert got[j].logprob == pytest.approx(ref[j - 1, PROMPT[j]].item(), abs=1e-5)
        top = ref[j - 1].topk(5)
        assert [i for i, _ in got[j].top] == top.indices.tolist()
        assert [v for _, v in got[j].top] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert engine.pop_finished(rid) == ([], "length")


def test_token_logprobs_equal_transformers_with_other_requests_in_the_batch(gpt2):
    hf, model = gpt2
    engine = Engine(model, block_size=8, prefill_chunk=16)
    other = engine.add_request(PROMPT[:9], max_new_tokens=12, do_sample=True, seed=3)
    rid = engine.add_request(PROMPT, GenerationConfig(max_new_tokens=12, do_sample=True, temperature=0.7,
                                                      top_k=20, seed=5), logprobs=3, prompt_logprobs=0)
    engine.run()
    out = engine.finished[rid]
    ref = reference(hf, PROMPT + out)
    entries = engine.token_logprobs(rid)
    assert len(entries) == len(out) == 12 and engine.token_logprobs(other) == []
    P = len(PROMPT)
    for k, (tok, e) in enumerate(zip(out, entries)):
        # the model's own distribution: before temperature and top-k (OpenAI's and vLLM's)
        assert e.logprob == pytest.approx(ref[P - 1 + k, tok].item(), abs=1e-5)
        assert [i for i, _ in e.top] == ref[P - 1 + k].topk(3).indices.tolist()
    prompt = engine.prompt_logprobs(rid)
    assert prompt[0] is None and all(e.top == [] for e in prompt[1:])


def test_n_samples_share_the_prompt_and_equal_their_single_requests(gpt2):
    _, model = gpt2
    cfg = GenerationConfig(max_new_tokens=10, do_sample=True, seed=11)
    alone = Engine(model, block_size=8, prefix_caching=False)
    singles = []
    for i in range(4):
        rid = alone.add_request(PROMPT, cfg.replace(seed=11 + i))
        alone.run()
        singles.append(alone.pop_finished(rid)[0])
    assert len({tuple(s) for s in singles}) > 1  # the seeds draw different samples
    engine = Engine(model, block_size=8, prefix_caching=False)
    rid = engine.add_request(PROMPT, cfg, n=4)
    engine.run()
    assert [engine.finished[rid + i] for i in range(4)] == singles
    st = engine.stats()
    assert st["prefill_tokens"] == len(PROMPT)  # computed once for the four
    assert st["cow_copies"] >= 3  # the shared last, partial block copied by the writers
    assert st["blocks_used"] == 0


def test_n_samples_cancel_and_checks(gpt2):
    _, model = gpt2
    engine = Engine(model, block_size=8, max_batch_size=4)
    rid = engine.add_request(PROMPT, max_new_tokens=5, n=3)
    assert engine.cancel(rid)  # before its prompt ran: the samples waiting on it go too
    assert sorted(engine.take_finished()) == [rid, rid + 1, rid + 2]
    assert not engine.has_work and engine.stats()["blocks_used"] == 0
    rid = engine.add_request(PROMPT, max_new_tokens=5, n=3)
    engine.step()  # prompt done: all three run
    assert engine.cancel(rid + 1) and len(engine.running) == 2
    engine.run()
    assert engine.finish_reason[rid] == "length" and engine.finish_reason[rid + 2] == "length"
    assert engine.stats()["blocks_used"] == 0
    with pytest.raises(ValueError, match="n must be"):
        engine.add_request(PROMPT, n=5)
    with pytest.raises(ValueError, match="logprobs"):
        engine.add_request(PROMPT, logprobs=21)


def test_preemption_keeps_samples_and_prompt_logprobs(gpt2):
    """On a pool too small for everything at once, requests are preempted and recomputed: the n samples and
    the prompt's log-probabilities are those of a pool that never preempts."""
    _, model = gpt2
    cfg = GenerationConfig(max_new_tokens=20, do_sample=True, seed=4)
    prompts = [PROMPT, PROMPT[5:30], PROMPT[::-1]]

    def run(**engine_options):
        e = Engine(model, block_size=8, prefill_chunk=8, **engine_options)
        rids = [e.add_request(p, cfg.replace(seed=i), n=3, logprobs=1, prompt_logprobs=2)
                for i, p in enumerate(prompts)]
        out, lps = {}, {}
        while e.has_work:
            e.step()
            for r in rids:
                got = e.prompt_logprobs(r)
                if got is not None:
                    lps[r] = [None if x is None else round(x.logprob, 4) for x in got]
        out = {r + j: e.finished[r + j] for r in rids for j in range(3)}
        return out, [lps[r] for r in rids], e.stats()

    want, want_lp, _ = run()
    got, got_lp, st = run(num_blocks=14)
    assert st["preemptions"] > 0
    assert got == want and got_lp == want_lp
