"""Whisper-like model: forward + backward over variants, KV-cache equality, greedy decoding through the
generic qkv.generate, waveform == features input, the sinusoid table, and errors."""

import itertools
import math

import pytest
import torch

import qkv
from qkv.models.whisper import Whisper, WhisperConfig, whisper_sinusoids


def tiny(**kw):
    base = dict(vocab_size=13, n_encoder_layers=2, n_decoder_layers=2, d_model=16, n_heads=2, d_ff=32,
                n_audio_ctx=10, n_text_ctx=12, n_mels=8, attention="naive")
    base.update(kw)
    return Whisper(WhisperConfig(**base))


def test_whisper_sinusoids_formula():
    t = whisper_sinusoids(7, 8)
    inc = math.log(10000) / 3
    for pos in (0, 3, 6):
        for i in range(4):
            assert math.isclose(t[pos, i].item(), math.sin(pos * math.exp(-inc * i)), abs_tol=1e-6)
            assert math.isclose(t[pos, 4 + i].item(), math.cos(pos * math.exp(-inc * i)), abs_tol=1e-6)


NORMS, FFNS, BACKENDS = ("layernorm", "rmsnorm"), ("gelu", "swiglu"), ("naive", "fused")


@pytest.mark.parametrize("norm,ffn,attention", list(itertools.product(NORMS, FFNS, BACKENDS)))
def test_whisper_forward_backward_variants(norm, ffn, attention):
    model = tiny(norm=norm, ffn=ffn, attention=attention, dropout=0.1)
    audio = torch.randn(2, 2500) * 0.1  # shorter than the 3200-sample window: padded with silence
    labels = torch.tensor([[5, 6, 7, 2], [8, 2, -100, -100]])
    out = model(audio, labels=labels)
    assert out.logits.shape == (2, 4, 13) and torch.isfinite(out.loss) and int(out.n_targets) == 6
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_cached_decoding_equals_full_recompute():
    model = tiny().eval()
    audio = torch.randn(2, 3200) * 0.1
    ids = torch.randint(3, 13, (2, 9))
    with torch.no_grad():
        memory, _ = model.encode(audio)
        full, _ = model.decode(ids, memory)
        cache = model.make_cache(2, 12)
        steps = [model.decode(ids[:, :3], memory, cache=cache)[0]]  # a 3-token prefix, then one at a time
        for t in range(3, 9):
            steps.append(model.decode(ids[:, t:t + 1], memory, cache=cache)[0])
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_greedy_generate_equals_argmax_loop():
    from qkv.generate import generate

    model = tiny().eval()
    audio = torch.randn(3, 3200) * 0.1
    seq = torch.full((3, 1), model.config.bos_token_id)
    with torch.no_grad():
        for _ in range(6):
            logits = model(audio, decoder_input_ids=seq).logits[:, -1]
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], 1)
    got = generate(model, audio, max_new_tokens=6, eos_token_id=[])  # no eos: never stop early
    assert torch.equal(got, seq[:, 1:])


def test_waveform_and_features_inputs_agree_and_errors():
    model = tiny().eval()
    audio = torch.randn(2, 3000) * 0.1
    dec = torch.tensor([[1, 4, 5], [1, 6, 7]])
    with torch.no_grad():
        a = model(audio, decoder_input_ids=dec).logits
        b = model(input_features=model.features(audio), decoder_input_ids=dec).logits
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="longer than the model's window"):
        model.encode(torch.randn(1, 4000))
    with pytest.raises(ValueError, match="exactly one"):
        model(audio, input_features=model.features(audio), decoder_input_ids=dec)
    with pytest.raises(ValueError, match="attention_mask"):
        model.encode(audio, torch.ones(2, 3000))
    with pytest.raises(ValueError, match="log-mel"):
        model.encode(torch.randn(2, 5, 20))
    with pytest.raises(qkv.ConfigError, match="placement"):
        qkv.build("whisper-digits", placement="post")


def test_whisper_round_trip(tmp_path):
    model = qkv.build("whisper-digits").eval()
    model.save_pretrained(tmp_path)
    again = qkv.from_pretrained(tmp_path).eval()
    audio = torch.randn(1, 16000) * 0.1
    dec = torch.tensor([[1, 5, 6]])
    assert torch.equal(again(audio, decoder_input_ids=dec).logits, model(audio, decoder_input_ids=dec).logits)
