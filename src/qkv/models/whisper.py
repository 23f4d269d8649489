"""A Whisper-like speech recogniser (Radford et al. 2022): log-mel audio encoder + text decoder.

waveform (B, N) -> log-mel (B, n_mels, 2T) -> conv1d k3 + GELU -> conv1d k3 stride 2 + GELU -> (B, T, d)
  -> + sinusoidal positions (Whisper's table: sines in the first half of the channels, cosines in the second;
       a FixedTable encoding behind the encoder stack's embed hook) -> Pre-LN encoder blocks -> final norm
       -> memory (B, T, d)
tokens (B, L) -> embedding + learned positions -> Pre-LN decoder blocks (causal self-attention,
cross-attention
  over memory) -> final norm -> LM head tied to the embedding -> logits (B, L, vocab)

The blocks are the shared nn.Block/Stack; the decoder half (decode, the decoder protocol, caches) is
Seq2SeqModel's, so greedy/beam decoding with a KV cache is the generic
qkv.generate.generate(model, audio_or_features, ...).
Audio shorter than the encoder window is padded with silence (Whisper pads every clip to 30 s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.config import ConfigError, TransformerConfig, setting
from qkv.models.base import ModelOutput, Seq2SeqModel, build_stack
from qkv.models.registry import register_family, register_preset
from qkv.nn.checks import check_length
from qkv.nn.linear import Linear
from qkv.nn.melspec import LogMelSpectrogram
from qkv.nn.position import FixedTable


def whisper_sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> Tensor:
    """Whisper's encoder positions: [sin(t * w_i) | cos(t * w_i)], w_i = max_timescale^(-i / (C/2 - 1))."""
    if channels % 2:
        raise ConfigError(f"sinusoidal audio positions need an even d_model, got {channels}")
    inc = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-inc * torch.arange(channels // 2, dtype=torch.float64))
    t = torch.arange(length, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([t.sin(), t.cos()], dim=1).float()


@dataclass
class WhisperConfig(TransformerConfig):
    """The TransformerConfig fields describe both stacks' blocks; `position` is the decoder's (the encoder's
    are the fixed sinusoids)."""

    vocab_size: int = setting(51865, "token vocabulary", ge=1)
    n_encoder_layers: int = setting(4, "audio encoder blocks", ge=1)
    n_decoder_layers: int = setting(4, "text decoder blocks", ge=1)
    n_audio_ctx: int = setting(1500, "encoder positions = mel frames / 2 (30 s at 10 ms hop)", ge=1)
    n_text_ctx: int = setting(448, "longest token sequence", ge=1)
    sample_rate: int = setting(16000, "audio samples per second", unit="Hz")
    n_fft: int = setting(400, "STFT window of the mel features")
    hop_length: int = setting(160, "samples between mel frames", ge=1)
    n_mels: int = setting(80, "mel bands", ge=1)
    pad_token_id: int = setting(0, "padding token")
    bos_token_id: int = setting(1, "decoder start token (<|startoftranscript|> in Whisper)")
    eos_token_id: int = setting(2, "end-of-text token")
    tie_embeddings: bool = setting(True, "share the token embedding with the output projection")
    label_smoothing: float = setting(0.0, "of the training cross-entropy")
    d_model: int = TransformerConfig.override("d_model", 384)
    n_heads: int = TransformerConfig.override("n_heads", 6)

    def validate(self) -> None:
        super().validate()
        if self.placement != "pre":
            raise ConfigError("WhisperConfig.placement must be 'pre' (Whisper is Pre-LN)")
        if self.d_model % 2 or self.d_model < 4:
            raise ConfigError("WhisperConfig.d_model must be even and at least 4 (sinusoidal audio "
                              f"positions: their frequencies step over d_model / 2 - 1), got {self.d_model}")

    @property
    def target_vocab_size(self) -> int:  # the names Seq2SeqModel reads from every seq2seq config
        return self.vocab_size

    @property
    def context_length(self) -> int:
        return self.n_text_ctx

    @property
    def n_samples(self) -> int:
        """Audio samples that fill the encoder window."""
        return 2 * self.n_audio_ctx * self.hop_length


class Whisper(Seq2SeqModel):
    kinds: ClassVar[tuple[str, ...]] = ("audio",)
    # before the table moved
    renamed_keys: ClassVar[dict[str, str]] = {"audio_pos": "encoder.position.weight"}

    @classmethod
    def config_for_task(cls, kind: str, needs: dict[str, Any]) -> dict[str, Any]:
        """The text side's context is n_text_ctx; the audio fields keep their names."""
        out = dict(needs)
        if "context_length" in out:
            out["n_text_ctx"] = out.pop("context_length")
        return out

    def __init__(self, config: WhisperConfig) -> None:
        super().__init__(config)
        c = config
        self.melspec = LogMelSpectrogram(c.sample_rate, c.n_fft, c.hop_length, c.n_mels)
        self.conv1 = nn.Conv1d(c.n_mels, c.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(c.d_model, c.d_model, kernel_size=3, stride=2, padding=1)
        # fixed, not trained (as in Whisper); a persistent buffer, so a loaded checkpoint carries its own
        # table
        audio_pos = FixedTable(whisper_sinusoids(c.n_audio_ctx, c.d_model))
        self.encoder = build_stack(c, c.n_encoder_layers, max_len=c.n_audio_ctx, causal=False,
                                   position=audio_pos)
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
        self.decoder = build_stack(c, c.n_decoder_layers, max_len=c.n_text_ctx, causal=True, cross=True)
        self.lm_head = Linear(c.d_model, c.vocab_size, bias=False)
        self.init_weights(c.n_encoder_layers + c.n_decoder_layers)
        # He init for the GELU conv front end: with N(0, 0.02) the audio content entering the encoder is ~50x
        # smaller than the sinusoidal positions added to it, and a model trained from scratch takes hundreds
        # of steps to notice its input at all (measured on DTMF: the loss sat at the label prior)
        for conv in (self.conv1, self.conv2):
            nn.init.kaiming_normal_(conv.weight, nonlinearity="relu")
        if c.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    # -- encoder -----------------------------------------------------------------------------------------
    def features(self, audio: Tensor) -> Tensor:
        """(B, N) waveform -> (B, n_mels, 2 * n_audio_ctx) log-mel, padding with silence to the window."""
        c = self.config
        if audio.shape[-1] > c.n_samples:
            raise ValueError(f"audio of {audio.shape[-1]} samples is longer than the model's window of "
                             f"{c.n_samples} samples ({c.n_samples / c.sample_rate:.2f} s)")
        audio = F.pad(audio, (0, c.n_samples - audio.shape[-1]))
        return self.melspec(audio)

    def encode(self, inputs: Tensor, attention_mask: Tensor | None = None,
               return_attentions: bool = False) -> tuple[Tensor, list | None]:
        """inputs: a waveform (B, N) or log-mel features (B, n_mels, frames). Returns memory (B, T, d)."""
        c = self.config
        if attention_mask is not None:
            raise ValueError("Whisper's encoder attends over the whole (silence-padded) window; pass no "
                             "attention_mask")
        if inputs.dim() == 2:
            inputs = self.features(inputs)
        if inputs.dim() != 3 or inputs.shape[1] != c.n_mels:
            raise ValueError(f"expected a waveform (B, N) or log-mel features (B, {c.n_mels}, frames), "
                             f"got shape {tuple(inputs.shape)}")
        x = F.gelu(self.conv1(inputs.to(self.conv1.weight.dtype)))
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # (B, T, d), T = ceil(frames / 2)
        check_length(x.shape[1], c.n_audio_ctx, "audio (in encoder positions)")
        out = self.encoder(x, return_weights=return_attentions)  # + the audio position table (FixedTable)
        return out.hidden, out.attentions or None

    # -- decoder: decode(), shift_right(), make_cache() come from Seq2SeqModel, so generate() works unchanged
    def embed_target(self, ids: Tensor) -> Tensor:
        return self.tok_emb(ids)

    def forward(
        self,
        audio: Tensor | None = None,
        *,
        input_features: Tensor | None = None,
        decoder_input_ids: Tensor | None = None,
        labels: Tensor | None = None,
        decoder_attention_mask: Tensor | None = None,
        return_attentions: bool = False,
    ) -> ModelOutput:
        """audio: (B, N) waveform, or input_features: (B, n_mels, frames) log-mel. labels: (B, L) target ids
        ending in eos, -100 on padding; decoder_input_ids default to labels shifted right behind bos."""
        if (audio is None) == (input_features is None):
            raise ValueError("Whisper.forward needs exactly one of audio (waveform) or input_features "
                             "(log-mel)")
        return self.seq2seq_forward(audio if audio is not None else input_features,
                                    decoder_input_ids=decoder_input_ids, labels=labels, attention_mask=None,
                                    decoder_attention_mask=decoder_attention_mask,
                                    return_attentions=return_attentions)


register_family("whisper", WhisperConfig, Whisper)
register_preset("whisper-tiny", "whisper", WhisperConfig(),
                "Whisper tiny's shape: 4+4 layers, 384 wide, 6 heads, 80 mels, 30 s window (39M)")
register_preset("whisper-digits", "whisper", WhisperConfig(
    vocab_size=16, n_encoder_layers=2, n_decoder_layers=2, d_model=128, n_heads=4, d_ff=512, n_audio_ctx=100,
    n_text_ctx=16, n_mels=40), "2+2 layers, 128 wide, 2 s window, 40 mels: spoken/DTMF digit strings on CPU")
