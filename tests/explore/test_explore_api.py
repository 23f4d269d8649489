"""The JSON API the page draws from, checked against independent references: Hugging Face `transformers`
(eager attention, logits, greedy generate) for a GPT-2 folder, the formulas for rows, causality, entropy,
KV-cache bytes and positional encodings, and qkv's own model for the run folders."""

from __future__ import annotations

import math

import pytest
import torch
from _exploremodels import N_EMBD, N_HEAD, N_LAYER, N_POSITIONS

TOL = 1e-3  # the API rounds probabilities to 5 decimals


def _rows_sum_to_one(m: list[list[float]]) -> None:
    for row in m:
        assert sum(row) == pytest.approx(1.0, abs=TOL)


def _hf(folder):
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2LMHeadModel.from_pretrained(folder, attn_implementation="eager").eval()


def _hf_ids(folder, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids


TEXT = "def getsource(object):"


# -- attention maps --------------------------------------------------------------------------------------
def test_gpt2_folder_maps_equal_transformers_attentions(hf_gpt2, clients):
    r = clients(hf_gpt2).post("/api/analyze", json={"input": TEXT})
    assert r.status_code == 200, r.text
    data = r.json()
    ids = _hf_ids(hf_gpt2, TEXT)
    assert data["ids"]["input"] == ids and len(data["tokens"]["input"]) == len(ids)
    [view] = data["views"]
    assert view["name"] == "self" and view["causal"] is True
    with torch.no_grad():
        ref = _hf(hf_gpt2)(torch.tensor([ids]), output_attentions=True).attentions  # L x (1, H, T, T)
    got = torch.tensor(view["layers"], dtype=torch.float64)  # (L, H, T, T)
    assert got.shape == (N_LAYER, N_HEAD, len(ids), len(ids))
    assert ref[0].std() > 0.05  # maps with structure: the comparison means something
    torch.testing.assert_close(got, torch.stack([a[0] for a in ref]).double(), atol=2e-5, rtol=0)


def test_causal_rows_sum_to_one_and_zero_above_the_diagonal(charlm_run, clients):
    text = "The return statement"
    data = clients(charlm_run).post("/api/analyze", json={"input": text}).json()
    # one per character, spaces shown
    assert data["tokens"]["input"] == [c if c != " " else "␣" for c in text]
    [view] = data["views"]
    assert view["causal"]
    T = len(text)
    for heads in view["layers"]:
        for m in heads:
            assert len(m) == T and all(len(r) == T for r in m)
            _rows_sum_to_one(m)
            assert all(m[i][j] == 0 for i in range(T) for j in range(i + 1, T))


def test_encoder_decoder_has_encoder_decoder_and_cross_attention(rev_run, clients):
    src = "31415"
    data = clients(rev_run).post("/api/analyze", json={"input": src, "target": "51413"}).json()
    names = [v["name"] for v in data["views"]]
    assert names == ["encoder self", "decoder self", "cross"]
    assert data["tokens"]["source"] == list(src)
    assert data["tokens"]["target"] == ["<bos>"] + list("51413")  # the decoder input starts with <bos>
    enc, dec, cross = data["views"]
    S, T = len(src), 6
    assert not enc["causal"] and dec["causal"] and not cross["causal"]
    for v, (tq, tk) in zip((enc, dec, cross), ((S, S), (T, T), (T, S))):
        assert len(v["layers"]) == 2  # transformer-tiny: 2 encoder + 2 decoder layers
        for m in (m for heads in v["layers"] for m in heads):
            assert (len(m), len(m[0])) == (tq, tk)
            _rows_sum_to_one(m)
    # the encoder sees both ways (its first query attends to later keys); the decoder does not
    assert any(m[0][S - 1] > 0 for heads in enc["layers"] for m in heads)
    assert all(m[i][j] == 0 for heads in dec["layers"] for m in heads for i in range(T)
                   for j in range(i + 1, T))


def test_encoder_decoder_default_target_is_the_greedy_output(rev_run, clients):
    import qkv

    c = clients(rev_run)
    data = c.post("/api/analyze", json={"input": "2718"}).json()
    model = qkv.run.load_model_any(rev_run)
    from qkv.run import load_run_task

    tok = load_run_task(rev_run).tokenizer
    out = model.generate(torch.tensor([tok.encode("2718")]), 8, eos_token_id=tok.eos_id)[0].tolist()
    n = min(len(out), len(data["ids"]["target"]) - 1)
    assert n >= 4 and data["ids"]["target"][1: n + 1] == out[:n]


def test_head_statistics_match_the_formula(charlm_run, clients):
    data = clients(charlm_run).post("/api/analyze", json={"input": "import os"}).json()
    view = data["views"][0]
    for s in view["stats"]:
        m = view["layers"][s["layer"]][s["head"]]
        rows = [(row[: i + 1]) for i, row in enumerate(m)][1:]  # causal: row i sees i + 1 keys; skip row 0
        ent = [-sum(p * math.log(p) for p in r if p > 0) for r in rows]
        assert s["entropy_nats"] == pytest.approx(sum(ent) / len(ent), abs=2e-3)
        norm = [e / math.log(len(r)) for e, r in zip(ent, rows)]
        assert s["entropy"] == pytest.approx(sum(norm) / len(norm), abs=2e-3)
        assert s["max_prob"] == pytest.approx(sum(max(r) for r in rows) / len(rows), abs=2e-3)
        want = "one-hot" if s["max_prob"] >= 0.9 else "uniform" if s["entropy"] >= 0.95 else ""
        assert s["flag"] == want


# -- generation step by step -----------------------------------------------------------------------------
def test_generation_matches_transformers_tokens_rows_probabilities(hf_gpt2, clients):
    n_new = 6
    r = clients(hf_gpt2).post("/api/generate", json={"input": TEXT, "max_new_tokens": n_new})
    assert r.status_code == 200, r.text
    g = r.json()
    ids = _hf_ids(hf_gpt2, TEXT)
    hf = _hf(hf_gpt2)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=n_new, do_sample=False, pad_token_id=0,
                          eos_token_id=None)[0, len(ids):].tolist()
    assert [s["token"] for s in g["steps"]] == ref
    assert g["prefix_ids"] == ids
    for s, step in enumerate(g["steps"]):
        seq = torch.tensor([ids + ref[:s]])
        with torch.no_grad():
            out = hf(seq, output_attentions=True)
        p = out.logits[0, -1].double().softmax(-1)
        top = torch.topk(p, 10)
        assert [t["id"] for t in step["top"]] == top.indices.tolist()
        assert [t["p"] for t in step["top"]] == pytest.approx(top.values.tolist(), abs=2e-5)
        assert step["top"][0]["id"] == step["token"]  # greedy: the chosen token is the most likely
        # the attention row that chose the token = the last query row of a full forward
        rows = torch.tensor(step["rows"]["self"], dtype=torch.float64)  # (L, H, Tk)
        want = torch.stack([a[0, :, -1] for a in out.attentions]).double()
        torch.testing.assert_close(rows, want, atol=2e-5, rtol=0)


def test_kv_cache_bytes_follow_the_formula(hf_gpt2, clients):
    n_new, bs = 9, 4
    g = clients(hf_gpt2).post("/api/generate",
                              json={"input": TEXT, "max_new_tokens": n_new, "block_size": bs}).json()
    T = len(_hf_ids(hf_gpt2, TEXT))
    head_dim, fp32 = N_EMBD // N_HEAD, 4
    assert len(g["steps"]) == n_new
    for s, step in enumerate(g["steps"]):
        c = step["cache"]
        pos = T + s  # the prompt, then one more position per step (the token that step chose is not in yet)
        assert c["positions"] == pos
        assert N_LAYER * c["used_per_layer"] == 2 * N_LAYER * N_HEAD * head_dim * pos * fp32
        blocks = math.ceil(pos / bs)
        assert c["paged_blocks"] == blocks
        assert N_LAYER * c["paged_per_layer"] == 2 * N_LAYER * N_HEAD * head_dim * blocks * bs * fp32
        # generate() preallocates prompt + new tokens for the static cache
        assert N_LAYER * c["static_per_layer"] == 2 * N_LAYER * N_HEAD * head_dim * (T + n_new) * fp32


def test_encoder_decoder_generation_has_cross_rows(rev_run, clients):
    g = clients(rev_run).post("/api/generate", json={"input": "1234", "max_new_tokens": 5}).json()
    assert g["prefix"] == ["<bos>"] and g["source"] == list("1234")
    assert 1 <= len(g["steps"]) <= 5
    for s, step in enumerate(g["steps"]):
        assert step["cache"]["positions"] == 1 + s
        cross = step["rows"]["cross"]  # (L, H, S)
        assert len(cross) == 2 and all(len(row) == 4 for head in cross for row in head)
        for head in cross:
            _rows_sum_to_one(head)
        for head in step["rows"]["self"]:
            assert all(len(row) == 1 + s for row in head)
    head_dim = 32 // 4
    assert g["cache"]["cross_bytes"] == 2 * 2 * 4 * head_dim * 4 * 4  # K+V x layers x heads x hd x S x fp32


# -- positional encodings --------------------------------------------------------------------------------
def test_learned_table_is_the_models_wpe(hf_gpt2, clients):
    p = clients(hf_gpt2).get("/api/positions").json()
    [e] = p["encodings"]
    assert e["kind"] == "learned" and e["n_positions"] == N_POSITIONS
    wpe = _hf(hf_gpt2).transformer.wpe.weight.detach()
    torch.testing.assert_close(torch.tensor(e["table"], dtype=torch.float64), wpe.double(), atol=1e-4, rtol=0)
    sim = torch.tensor(e["similarity"], dtype=torch.float64)
    torch.testing.assert_close(sim.diagonal(), torch.ones(N_POSITIONS, dtype=torch.float64), atol=1e-4,
                               rtol=0)


def test_sinusoidal_table_is_the_papers_formula(rev_run, clients):
    p = clients(rev_run).get("/api/positions").json()
    assert ([(e["where"], e["kind"]) for e in p["encodings"]]
            == [("encoder", "sinusoidal"), ("decoder", "sinusoidal")])
    t = p["encodings"][0]["table"]
    d = p["encodings"][0]["d_model"]
    for pos in (0, 3, 7):
        for i in range(0, d, 2):
            angle = pos / 10000 ** (i / d)
            assert t[pos][i] == pytest.approx(math.sin(angle), abs=1e-4)
            assert t[pos][i + 1] == pytest.approx(math.cos(angle), abs=1e-4)


@pytest.fixture(scope="module")
def rope_alibi(tmp_path_factory):
    import qkv

    folders = {}
    for pos in ("rope", "alibi"):
        m = qkv.build("gpt-nano", vocab_size=20, n_layers=1, d_model=32, n_heads=4, context_length=16,
                      position=pos)
        folders[pos] = m.save_pretrained(tmp_path_factory.mktemp(pos))
    return folders


def test_rope_and_alibi_pictures_follow_the_papers(rope_alibi, clients):
    e = clients(rope_alibi["rope"]).get("/api/positions").json()["encodings"][0]
    hd = 8
    theta = [10000 ** (-2 * i / hd) for i in range(hd // 2)]
    assert e["kind"] == "rope" and e["inv_freq"] == pytest.approx(theta, rel=1e-6)
    # q = k = ones rotated to positions m and 0: q_m . k_0 / hd = mean_i cos(m theta_i)
    for m, v in enumerate(e["dot_by_distance"]):
        assert v == pytest.approx(sum(math.cos(m * t) for t in theta) / len(theta), abs=1e-3)
    e = clients(rope_alibi["alibi"]).get("/api/positions").json()["encodings"][0]
    assert e["kind"] == "alibi" and e["slopes"] == pytest.approx([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8])
    bias = e["bias"]  # (H, 16, 16): -slope * |i - j|
    assert bias[1][5][2] == pytest.approx(-3 * 2 ** -4)


# -- bad input: a JSON error, never a traceback ----------------------------------------------------------
@pytest.mark.parametrize("body, status, words", [
    ({"input": ""}, 400, "empty"),
    ({"input": "   "}, 400, "empty"),
    ({"input": "x" * 40}, 400, "context is 32"),
    ({"input": "caf€ ☃"}, 400, "2 symbol(s) this model's vocabulary does not know: '€' '☃'"),
])
def test_bad_input_is_a_json_error(charlm_run, clients, body, status, words):
    r = clients(charlm_run).post("/api/analyze", json=body)
    assert r.status_code == status and r.headers["content-type"] == "application/json"
    assert words in r.json()["error"]
    assert "Traceback" not in r.text


@pytest.mark.parametrize("body, status, words", [
    ({"input": "ab", "max_new_tokens": 0}, 400, "max_new_tokens"),
    ({"input": "ab", "max_new_tokens": "many"}, 422, "max_new_tokens"),
    ({"input": "ab", "block_size": 0}, 400, "block_size"),
    ({"input": "ab", "do_sample": True, "temperature": -1}, 400, "temperature must be at least 0"),
    ({"input": "x" * 32}, 400, "context"),
])
def test_bad_generation_requests(charlm_run, clients, body, status, words):
    r = clients(charlm_run).post("/api/generate", json=body)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]


def test_temperature_zero_is_greedy_as_in_the_cli_and_the_server(charlm_run, clients):
    c = clients(charlm_run)
    greedy = c.post("/api/generate", json={"input": "The ", "max_new_tokens": 6}).json()
    zero = c.post("/api/generate", json={"input": "The ", "max_new_tokens": 6, "do_sample": True,
                                         "temperature": 0, "seed": 5}).json()
    assert [s["token"] for s in zero["steps"]] == [s["token"] for s in greedy["steps"]]
    assert len(greedy["steps"]) == 6


def test_top_k_follows_generation_configs_rule(charlm_run, clients):
    """top_k 0 is "no top-k" (GenerationConfig's rule, as the CLI and the server), below 0 a 400 naming it."""
    c = clients(charlm_run)
    body = {"input": "The ", "max_new_tokens": 6, "do_sample": True, "temperature": 1.5, "seed": 3}
    plain = c.post("/api/generate", json=body).json()
    zero = c.post("/api/generate", json={**body, "top_k": 0})
    assert zero.status_code == 200, zero.text
    assert [s["token"] for s in zero.json()["steps"]] == [s["token"] for s in plain["steps"]]
    r = c.post("/api/generate", json={**body, "top_k": -1})
    assert r.status_code == 400 and "top_k must be at least 0" in r.json()["error"]


def test_text_for_a_folder_without_tokenizer_asks_for_ids(rope_alibi, clients):
    c = clients(rope_alibi["rope"])
    r = c.post("/api/analyze", json={"input": "hello"})
    assert r.status_code == 400 and "token ids" in r.json()["error"]
    r = c.post("/api/analyze", json={"input": "3 99"})
    assert r.status_code == 400 and "outside the vocabulary [0, 20)" in r.json()["error"]
    data = c.post("/api/analyze", json={"input": "3 4 5"}).json()
    assert data["tokens"]["input"] == ["3", "4", "5"]
    assert c.get("/api/info").json()["input"] == "ids"


def test_sampling_is_reproducible_with_a_seed(charlm_run, clients):
    c = clients(charlm_run)
    body = {"input": "The ", "max_new_tokens": 8, "do_sample": True, "temperature": 1.5, "seed": 3}
    a, b = c.post("/api/generate", json=body).json(), c.post("/api/generate", json=body).json()
    assert [s["token"] for s in a["steps"]] == [s["token"] for s in b["steps"]]
    assert len(a["steps"]) == 8


def test_static_files_and_unknown_paths(charlm_run, clients):
    c = clients(charlm_run)
    page = c.get("/")
    assert page.status_code == 200 and 'src="static/explore.js"' in page.text
    assert c.get("/static/explore.js").headers["content-type"].startswith("text/javascript")
    assert c.get("/static/../../etc/passwd").status_code == 404
    assert c.get("/static/secret.py").status_code == 404


def test_a_bug_is_a_json_500_without_traceback(charlm_run, clients, monkeypatch):
    from qkv.explore import analysis

    def broken(*a, **k):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(analysis, "analyze", broken)
    r = clients(charlm_run).post("/api/analyze", json={"input": "abc"})
    assert r.status_code == 500 and r.json() == {"error": "internal error (RuntimeError); see the server log"}


def test_only_the_adapter_touches_the_rest_of_qkv():
    """analysis, server, export and cli import nothing of qkv but qkv.explore (function-level imports too),
    so a change of the model interfaces is absorbed by adapter.py alone."""
    import ast
    from pathlib import Path

    import qkv.explore

    pkg = Path(qkv.explore.__file__).parent
    for path in sorted(pkg.glob("*.py")):
        if path.name == "adapter.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            for name in names:
                if name == "qkv" or name.startswith("qkv."):
                    assert name.startswith("qkv.explore"), f"{path.name} imports {name}"


def test_an_input_too_large_to_draw_is_refused_before_computing(rope_alibi, clients, monkeypatch):
    from qkv.explore import adapter, analysis

    calls = []
    monkeypatch.setattr(adapter, "attention", lambda *a: calls.append(a))
    # 1 layer x 4 heads x 10 x 10 is one too many
    monkeypatch.setattr(analysis, "MAX_WEIGHTS", 1 * 4 * 10 * 10 - 1)
    r = clients(rope_alibi["rope"]).post("/api/analyze", json={"input": " ".join(["3"] * 10)})
    assert (r.status_code == 400 and "400 attention weights" in r.json()["error"]
            and "1 layers x 4 heads x 10 x 10" in r.json()["error"])
    assert calls == []
