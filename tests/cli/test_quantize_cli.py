"""--quantize on qkv generate / chat / serve / explore: one flag, passed through to qkv.from_pretrained (the
model each command runs is quantized), the same text as the Python API, and a bad value refused by the
parser."""

from __future__ import annotations

import pydoc_data.topics

import pytest
import torch

import qkv
from qkv.cli.main import main
from qkv.nn.quant import MODES, quantized_layers
from qkv.run import generate_text
from qkv.serve.config import QUANTIZE_MODES

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A random Llama (tied head) with a byte-level BPE tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    path = tmp_path_factory.mktemp("llama-q")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(list(pydoc_data.topics.topics.values())[:20], trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                         eos_token="</s>").save_pretrained(path)
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128,
                                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture
def loaded(monkeypatch):
    """The quantize= of every qkv.from_pretrained call, and the layer counts of the model it returned."""
    calls = []
    real = qkv.from_pretrained

    def spy(path, **kwargs):
        model = real(path, **kwargs)
        calls.append((kwargs.get("quantize"), quantized_layers(model)))
        return model

    monkeypatch.setattr(qkv, "from_pretrained", spy)
    return calls


def test_generate_runs_the_quantized_model(folder, loaded, capsys):
    flags = ["--prompt", "The with statement", "--greedy", "--max-new-tokens", "8"]
    assert main(["generate", str(folder), *flags, "--quantize", "int8"]) == 0
    out = capsys.readouterr().out
    assert loaded == [("int8", {"int8": 11})]  # 2 blocks x 5 projections + the head
    want = generate_text(folder, "The with statement", greedy=True, max_new_tokens=8, quantize="int8")
    assert out == want + "\n"


def test_chat_and_explore_run_the_quantized_model(folder, loaded, tmp_path, capsys):
    assert main(["chat", str(folder), "--message", "hi", "--greedy", "--max-new-tokens", "4", "--quantize",
                 "int4"]) == 0
    page = tmp_path / "page.html"
    assert main(["explore", str(folder), "--input", "for x in y", "--export", str(page), "--quantize",
                 "int8"]) == 0
    assert page.is_file()
    assert [q for q, _ in loaded] == ["int4", "int8"]
    assert loaded[0][1] == {"int4": 11} and loaded[1][1] == {"int8": 11}


def test_serve_passes_the_flag_to_the_loader(folder, loaded, monkeypatch):
    import qkv.serve
    from qkv.serve.model import load_served

    seen = {}
    monkeypatch.setattr(qkv.serve, "serve", lambda model, **kw: seen.update(kw) or 0)
    assert main(["serve", str(folder), "--quantize", "int4"]) == 0
    assert seen["quantize"] == "int4"
    served = load_served(folder, quantize="int4")
    assert quantized_layers(served.model) == {"int4": 11} and not served.model.training


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "explore"])
def test_a_bad_mode_is_refused_by_the_parser(command, folder, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, str(folder), "--quantize", "int3"])
    assert e.value.code == 2
    # the quotes around the choices depend on the Python version
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"qkv {command}: error: argument --quantize: invalid choice: 'int3' (choose from ")
    assert "int8" in err and "int4" in err


def test_the_flag_lists_the_library_modes():
    assert QUANTIZE_MODES == MODES
