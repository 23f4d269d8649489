"""The log-mel front end against transformers' WhisperFeatureExtractor (numpy implementation) and the Slaney
mel scale's defining formulas."""

import math

import numpy as np
import pytest
import torch

from qkv.nn.melspec import LogMelSpectrogram, hz_to_mel, mel_filterbank, mel_to_hz

transformers = pytest.importorskip("transformers")


# (HF fixes f_max at 8 kHz, Whisper's Nyquist; ours is sample_rate / 2, so compare at 16 kHz only)
@pytest.mark.parametrize("sr,n_fft,hop,n_mels",
                         [(16000, 400, 160, 80), (16000, 400, 160, 40), (16000, 512, 128, 64)])
def test_log_mel_matches_whisper_feature_extractor(sr, n_fft, hop, n_mels):
    fe = transformers.WhisperFeatureExtractor(feature_size=n_mels, sampling_rate=sr, hop_length=hop,
                                              n_fft=n_fft, chunk_length=1)
    rng = np.random.default_rng(0)
    t = np.arange(sr) / sr
    audio = (0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(sr)).astype(np.float32)
    ref = fe(audio, sampling_rate=sr, return_tensors="np").input_features[0]
    ours = LogMelSpectrogram(sr, n_fft, hop, n_mels)(torch.from_numpy(audio))[0].numpy()
    assert ours.shape == ref.shape == (n_mels, sr // hop)
    np.testing.assert_allclose(ours, ref, atol=1e-4)
    np.testing.assert_allclose(mel_filterbank(n_mels, n_fft, sr).numpy(), fe.mel_filters.T, atol=1e-6)


def test_slaney_mel_scale():
    assert hz_to_mel(torch.tensor(1000.0)).item() == pytest.approx(15.0)
    assert hz_to_mel(torch.tensor(200.0)).item() == pytest.approx(3.0)  # linear part: 3 mels per 200 Hz
    assert hz_to_mel(torch.tensor(2000.0)).item() == pytest.approx(15 + 27 * math.log(2) / math.log(6.4))
    f = torch.tensor([0.0, 300.0, 999.0, 1000.0, 4321.0, 8000.0], dtype=torch.float64)
    torch.testing.assert_close(mel_to_hz(hz_to_mel(f)), f)


def test_pure_tone_lands_in_its_band_and_batch_is_per_example():
    spec = LogMelSpectrogram(16000, 400, 160, 40)
    t = torch.arange(16000) / 16000
    tone = 0.5 * torch.sin(2 * math.pi * 1000 * t)
    out = spec(torch.stack([tone, 0.01 * tone]))
    centers = mel_to_hz(torch.linspace(0, hz_to_mel(torch.tensor(8000.0)).item(), 42))[1:-1]
    band = int(out[0, :, 50].argmax())
    assert abs(centers[band].item() - 1000) < 150
    # each example keeps 80 dB below its own peak: log10 range 8, i.e. 2 after (x + 4) / 4
    for b in range(2):
        assert out[b].amax() - out[b].amin() <= 2.0 + 1e-6
    # 40 dB quieter = 4 lower in log10 = 1 lower in features, in the bands that hold the tone
    torch.testing.assert_close(out[1, band], out[0, band] - 1.0, atol=1e-3, rtol=0)
    with pytest.raises(ValueError, match="waveform"):
        spec(torch.zeros(2, 3, 100))
