"""The speedrun's parts on their own: the scores against Google's rouge_score and hand-worked values, the
docstring and signature extraction, the module split, and the shipped profiles (every one loads; the cpu
profile's model is 10-20M parameters; every profile's model is Llama-shaped, so it exports as `llama`)."""

from __future__ import annotations

import pytest

from qkv.speedrun import load_profile, profile_names
from qkv.speedrun.data import documented, first_sentence, module_name, split_modules, synthetic
from qkv.speedrun.metrics import exact, function_source, parses, rouge_l, token_f1


def test_rouge_l_by_hand():
    # prediction: return the sum of a and b (7 words); reference: return a plus b (4); LCS: return a b (3)
    p, r = 3 / 7, 3 / 4
    assert rouge_l("Return the sum of a and b.", "Return a plus b") == pytest.approx(2 * p * r / (p + r))
    assert rouge_l("", "anything") == 0.0 and rouge_l("x y z", "a b c") == 0.0


def test_token_f1_by_hand():
    # prediction words: return the sum of a and b (7); reference: return a plus b (4); common: return a b (3)
    assert token_f1("Return the sum of a and b.", "Return a plus b") == pytest.approx(2 * 3 / 7 * 3 / 4 /
                                                                                     (3 / 7 + 3 / 4))
    assert token_f1("", "x") == 0.0 and token_f1("a a", "a") == pytest.approx(2 / 3)


def test_exact_and_parses():
    assert exact(" 85. ", "85") and not exact("185", "85")
    src = function_source("def f(x):\n", "    y = x + 1\n    return y\nprint(f)\nunfinished(")
    assert src == "def f(x):\n    y = x + 1\n    return y" and parses(src)
    assert not parses(function_source("def f(x):\n", "    return (x\n    +\n"))


SOURCE = '''
def dedent(text):
    """Remove any common leading whitespace from every line in `text`.

    More.
    """

def _private(x):
    """Hidden helper."""

class Wrapper:
    """Object for wrapping text. Long."""

    def fill(self, text, width=70):
        """Fill a single paragraph of text."""

    def _inner(self):
        """Not shown at all."""

def undocumented(a):
    pass
'''


def test_documented_names_signatures_and_first_sentences():
    got = {(d.dotted, d.signature, d.sentence) for d in documented("textwrap.py", SOURCE)}
    assert got == {("textwrap.dedent", "dedent(text)",
                    "Remove any common leading whitespace from every line in `text`."),
                   ("textwrap.Wrapper", "Wrapper", "Object for wrapping text."),
                   ("textwrap.Wrapper.fill", "fill(text, width=70)", "Fill a single paragraph of text.")}
    assert module_name("json/decoder.py") == "json.decoder" and module_name("email/__init__.py") == "email"
    assert first_sentence("e.g. short") is None and first_sentence("   ") is None


def test_module_split_is_disjoint_and_stable():
    full = split_modules(0.1)
    assert full["train"] and full["val"] and not set(full["train"]) & set(full["val"])
    small = split_modules(0.1, max_modules=8)
    assert len(small["train"]) == 8 and len(small["val"]) == 2
    assert set(small["train"]) <= set(full["train"]) and set(small["val"]) <= set(full["val"])


def test_synthetic_questions_skip_the_excluded_and_answer_right():
    seen = {q for q, _ in synthetic(50, ["parser", "token"], seed=0)}
    held = synthetic(50, ["lexer"], seed=1, exclude=seen)
    assert not {q for q, _ in held} & seen
    for q, a in held:
        if q.startswith("What is"):
            x, y = q[len("What is "):-1].split(" + ")
            assert int(a) == int(x) + int(y)
        else:
            assert a == "l e x e r"


@pytest.mark.parametrize("name", ["quick", "cpu", "gpu"])
def test_shipped_profiles_build_llama_shaped_models(name):
    from qkv.interop.export import decoder_type
    from qkv.models.gpt import GPTConfig
    from qkv.nn.params import count_parameters

    assert name in profile_names()
    p = load_profile(name)
    cfg = GPTConfig(vocab_size=p.tokenizer.vocab_size + 3, context_length=p.pretrain.context,
                    **p.pretrain.model)
    assert decoder_type(cfg) == "llama"
    if name == "cpu":
        from qkv.models.gpt import GPT

        n = count_parameters(GPT(cfg))
        assert 10e6 <= n <= 20e6, n


def test_default_profile_is_cpu():
    assert load_profile().name == "cpu"


def test_lm_task_reads_a_held_out_file_and_a_trained_tokenizer(tmp_path):
    from qkv.config import ConfigError
    from qkv.tasks import build_task
    from qkv.tasks.lm import LMOptions
    from qkv.tasks.tokenizers import BPETokenizer

    train, val = "def f(x):\n    return x\n" * 40, "class C:\n    pass\n" * 20
    (tmp_path / "train.txt").write_text(train)
    (tmp_path / "val.txt").write_text(val)
    tok = BPETokenizer.train([train], vocab_size=280, min_frequency=1, extra_specials=("<|user|>",))
    tok.save(tmp_path / "tok")
    task = build_task("lm", family="gpt", path=str(tmp_path / "train.txt"),
                      val_path=str(tmp_path / "val.txt"), tokenizer="bpe",
                      tokenizer_file=str(tmp_path / "tok" / "tokenizer.json"), context=8)
    assert task.tokenizer.hf.to_str() == tok.hf.to_str() and task.tokenizer.encode("<|user|>") == [6]
    assert task.data["val"].tolist() == tok.encode(val) and task.n_chars == {"train": len(train),
                                                                               "val": len(val)}
    with pytest.raises(ConfigError, match="val_path needs path"):
        LMOptions(val_path="v.txt").validate()
    with pytest.raises(ConfigError, match="set tokenizer=bpe"):
        LMOptions(tokenizer_file="t.json").validate()
