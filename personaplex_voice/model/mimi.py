"""Mimi: the streaming neural audio codec (24 kHz <-> 12.5 Hz codes).

encode: SEANet encoder (25 Hz latents) -> encoder transformer -> strided conv down to 12.5 Hz
-> split RVQ codes. decode: RVQ decode -> transposed conv up to 25 Hz -> decoder transformer ->
SEANet decoder. Every stage streams with per-slot state (see `streaming.py`); one call of
`encode`/`decode` handles any whole number of 80 ms frames per slot.
"""

from __future__ import annotations

import torch
from torch import nn

from personaplex_voice.model.config import ModelConfig
from personaplex_voice.model.conv import StreamingConv1d, StreamingConvTranspose1d
from personaplex_voice.model.quantizer import SplitResidualVectorQuantizer
from personaplex_voice.model.seanet import SEANetDecoder, SEANetEncoder
from personaplex_voice.model.streaming import StepContext, StreamState, init_state, name_streaming_modules
from personaplex_voice.model.transformer import ProjectedTransformer


class _Downsample(nn.Module):
    def __init__(self, stride: int, dim: int):
        super().__init__()
        self.conv = StreamingConv1d(dim, dim, 2 * stride, stride=stride, bias=False, pad_mode="replicate")


class _Upsample(nn.Module):
    def __init__(self, stride: int, dim: int):
        super().__init__()
        # groups=dim reproduces the published "channel wise" upsampling.
        self.convtr = StreamingConvTranspose1d(dim, dim, 2 * stride, stride=stride, groups=dim, bias=False)


class Mimi(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        mc = cfg.mimi
        self.cfg = cfg
        self.sample_rate = cfg.sample_rate
        self.frame_rate = cfg.frame_rate
        self.frame_size = cfg.frame_size
        self.num_codebooks = mc.num_codebooks
        dim = mc.seanet["dimension"]
        self.encoder = SEANetEncoder(mc.seanet)
        self.decoder = SEANetDecoder(mc.seanet)
        self.encoder_transformer = ProjectedTransformer(mc.transformer)
        self.decoder_transformer = ProjectedTransformer(mc.transformer)
        self.quantizer = SplitResidualVectorQuantizer(mc.quantizer, mc.num_codebooks)
        encoder_rate = cfg.sample_rate / mc.hop_length
        stride = encoder_rate / cfg.frame_rate
        if stride != int(stride) or stride < 1:
            raise ValueError("the encoder frame rate must be an integer multiple of the frame rate")
        self.resample_stride = int(stride)
        self.downsample: _Downsample | None = None
        self.upsample: _Upsample | None = None
        if self.resample_stride > 1:
            self.downsample = _Downsample(self.resample_stride, dim)
            self.upsample = _Upsample(self.resample_stride, dim)
        name_streaming_modules(self)

    @property
    def max_frames_per_call(self) -> int:
        """Most frames one `encode` / `decode` call may take: its transformer positions
        (`resample_stride` per frame) must fit the transformer's context."""
        return max(1, self.encoder_transformer.transformer.context // self.resample_stride)

    def init_state(self, batch: int, device: torch.device | str | None = None) -> StreamState:
        p = next(self.parameters())
        return init_state(self, batch, device or p.device, p.dtype)

    @torch.no_grad()
    def encode(self, pcm: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """pcm [B, 1, n * frame_size] -> codes [B, num_codebooks, n]."""
        return self.quantizer.encode(self.encode_latents(pcm, ctx))

    @torch.no_grad()
    def encode_latents(self, pcm: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """pcm [B, 1, n * frame_size] -> the latents [B, dim, n] the quantizer turns into codes."""
        emb = self.encoder(pcm, ctx)
        emb = self.encoder_transformer(emb, ctx)
        if self.downsample is not None:
            emb = self.downsample.conv(emb, ctx)
        return emb

    @torch.no_grad()
    def decode(self, codes: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """codes [B, K, n] -> pcm [B, 1, n * frame_size]."""
        emb = self.quantizer.decode(codes)
        if self.upsample is not None:
            emb = self.upsample.convtr(emb, ctx)
        emb = self.decoder_transformer(emb, ctx)
        return self.decoder(emb, ctx)

    def refresh(self) -> None:
        """Recompute derived tensors (codebooks) after weights were loaded or moved."""
        self.quantizer.refresh()
