"""Log-mel spectrogram in torch: the audio front end of speech models (Whisper, Radford et al. 2022).

waveform (B, N) at `sample_rate` -> STFT (Hann window, n_fft, hop, centred with reflect padding)
-> power |X|^2 -> mel filterbank (Slaney scale and area normalisation, as librosa's default and Whisper)
-> log10(max(., 1e-10)) -> clamp to (max - 8) -> (x + 4) / 4                      => (B, n_mels, frames)

frames = N // hop (Whisper drops the last STFT frame). The filterbank is computed here from the formula,
nothing is downloaded; it matches transformers' WhisperFeatureExtractor (tested).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def hz_to_mel(f: Tensor) -> Tensor:
    """Slaney's mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above (librosa htk=False)."""
    f_sp = 200.0 / 3
    min_log_hz, min_log_mel = 1000.0, 1000.0 / f_sp
    logstep = math.log(6.4) / 27.0
    return torch.where(f >= min_log_hz,
                       min_log_mel + torch.log(f.clamp_min(1e-10) / min_log_hz) / logstep, f / f_sp)


def mel_to_hz(m: Tensor) -> Tensor:
    f_sp = 200.0 / 3
    min_log_hz, min_log_mel = 1000.0, 1000.0 / f_sp
    logstep = math.log(6.4) / 27.0
    return torch.where(m >= min_log_mel, min_log_hz * torch.exp(logstep * (m - min_log_mel)), f_sp * m)


def mel_filterbank(n_mels: int, n_fft: int, sample_rate: int, f_min: float = 0.0,
                   f_max: float | None = None) -> Tensor:
    """(n_mels, n_fft // 2 + 1) triangular filters, equally spaced on the Slaney mel scale, each scaled by
    2 / (f_right - f_left) so every filter has the same area ("slaney" normalisation)."""
    f_max = sample_rate / 2 if f_max is None else f_max
    fft_freqs = torch.linspace(0, sample_rate / 2, n_fft // 2 + 1, dtype=torch.float64)
    mels = torch.linspace(float(hz_to_mel(torch.tensor(f_min, dtype=torch.float64))),
                          float(hz_to_mel(torch.tensor(f_max, dtype=torch.float64))), n_mels + 2,
                          dtype=torch.float64)
    hz = mel_to_hz(mels)  # (n_mels + 2,) filter edges
    fdiff = hz.diff()  # (n_mels + 1,)
    ramps = hz.unsqueeze(1) - fft_freqs.unsqueeze(0)  # (n_mels + 2, n_freqs)
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = torch.clamp(torch.minimum(lower, upper), min=0.0)
    enorm = 2.0 / (hz[2:] - hz[:-2])
    return (weights * enorm[:, None]).float()


class LogMelSpectrogram(nn.Module):
    """Whisper's log-mel features. Defaults are Whisper's: 16 kHz, 25 ms window (400), 10 ms hop (160), 80
    mels."""

    def __init__(self, sample_rate: int = 16000, n_fft: int = 400, hop_length: int = 160,
                 n_mels: int = 80) -> None:
        super().__init__()
        if n_fft < 2 or hop_length < 1 or n_mels < 1:
            raise ValueError("n_fft must be >= 2 and hop_length, n_mels >= 1")
        self.sample_rate, self.n_fft, self.hop_length, self.n_mels = sample_rate, n_fft, hop_length, n_mels
        # buffers, not parameters: deterministic from the config, so they are not saved in checkpoints
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)
        self.register_buffer("filters", mel_filterbank(n_mels, n_fft, sample_rate), persistent=False)

    def frames(self, n_samples: int) -> int:
        return n_samples // self.hop_length

    def forward(self, audio: Tensor) -> Tensor:
        """audio: (B, N) or (N,) float waveform in [-1, 1]. Returns (B, n_mels, N // hop)."""
        if audio.dim() == 1:
            audio = audio.unsqueeze(0)
        if audio.dim() != 2 or not audio.is_floating_point():
            raise ValueError(f"audio must be a float waveform of shape (B, N), got {tuple(audio.shape)} "
                             f"{audio.dtype}")
        if audio.shape[1] <= self.n_fft // 2:
            raise ValueError(f"audio of {audio.shape[1]} samples is too short for n_fft={self.n_fft}")
        stft = torch.stft(audio.float(), self.n_fft, self.hop_length, window=self.window, return_complex=True)
        power = stft[..., :-1].abs() ** 2  # (B, n_freqs, frames); Whisper drops the last frame
        mel = self.filters @ power  # (B, n_mels, frames)
        log_spec = mel.clamp_min(1e-10).log10()
        # dynamic range of 80 dB below each example's loudest bin, then roughly into [-1, 1]
        peak = log_spec.amax(dim=(1, 2), keepdim=True)
        log_spec = torch.maximum(log_spec, peak - 8.0)
        return (log_spec + 4.0) / 4.0
