"""Causal streaming 1-d convolutions with per-slot buffers.

A streaming conv keeps the last `effective_kernel - stride` input samples of each slot; each call
convolves `[buffer, x]` with no padding. With inputs whose length is a multiple of the stride this
equals the published streaming convs exactly (their first call left-pads with zeros, or with the
first sample for `replicate` padding, which a per-slot `fresh` flag reproduces here).
A transposed conv keeps the overlapping tail of its last output (`partial`) and adds it to the
head of the next one. Attribute nesting (`conv.conv`, `convtr.convtr`) matches the published
checkpoint key names.
"""

from __future__ import annotations

import torch
from torch import nn

from personaplex_voice.model.streaming import StepContext, StreamingModule, StreamState, commit


class _Conv(nn.Module):
    def __init__(self, conv: nn.Conv1d):
        super().__init__()
        self.conv = conv


class _ConvTr(nn.Module):
    def __init__(self, convtr: nn.ConvTranspose1d):
        super().__init__()
        self.convtr = convtr


class StreamingConv1d(StreamingModule):
    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        dilation: int = 1,
        groups: int = 1,
        bias: bool = True,
        pad_mode: str = "constant",
    ):
        super().__init__()
        if pad_mode not in ("constant", "replicate"):
            raise ValueError(f"unsupported streaming pad mode {pad_mode!r}")
        self.conv = _Conv(
            nn.Conv1d(
                in_channels, out_channels, kernel_size, stride, dilation=dilation, groups=groups, bias=bias
            )
        )
        self.in_channels = in_channels
        self.stride = stride
        self.pad_mode = pad_mode
        self.padding = (kernel_size - 1) * dilation + 1 - stride

    def init_own_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> StreamState:
        if self.padding <= 0:
            return {}
        out = {"buf": torch.zeros(batch, self.in_channels, self.padding, device=device, dtype=dtype)}
        if self.pad_mode == "replicate":
            out["fresh"] = torch.ones(batch, dtype=torch.bool, device=device)
        return out

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        if self.padding <= 0:
            return self.conv.conv.forward(x)
        buf = self.st(ctx, "buf")
        head = buf
        if self.pad_mode == "replicate":
            fresh = self.st(ctx, "fresh")
            head = torch.where(fresh.view(-1, 1, 1), x[..., :1].expand_as(buf), buf)
            commit(fresh, torch.zeros_like(fresh), ctx.active)
        xx = torch.cat([head, x], dim=-1)
        commit(buf, xx[..., xx.shape[-1] - self.padding :], ctx.active)
        return self.conv.conv.forward(xx)


class StreamingConvTranspose1d(StreamingModule):
    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        groups: int = 1,
        bias: bool = True,
    ):
        super().__init__()
        self.convtr = _ConvTr(
            nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride, groups=groups, bias=bias)
        )
        self.out_channels = out_channels
        self.overlap = kernel_size - stride

    def init_own_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> StreamState:
        if self.overlap <= 0:
            return {}
        partial = torch.zeros(batch, self.out_channels, self.overlap, device=device, dtype=dtype)
        bias = self.convtr.convtr.bias
        if bias is not None:
            # A fresh slot "adds" partial - bias = 0 exactly, like the published first call.
            partial += bias.detach().to(device=device, dtype=dtype)[:, None]
        return {"partial": partial}

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        y = self.convtr.convtr.forward(x)
        if self.overlap <= 0:
            return y
        partial = self.st(ctx, "partial")
        bias = self.convtr.convtr.bias
        carried = partial - bias[:, None] if bias is not None else partial
        pt = self.overlap
        head = y[..., :pt] + carried
        y = torch.cat([head, y[..., pt:]], dim=-1)
        n = y.shape[-1]
        commit(partial, y[..., n - pt :], ctx.active)
        return y[..., : n - pt]
