"""SEANet encoder / decoder (Mimi's convolutional front and back end), causal and streaming.

Module indices inside `model` follow the published layout so checkpoint keys such as
`encoder.model.3.conv.conv.weight` load unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from personaplex_voice.model.conv import StreamingConv1d, StreamingConvTranspose1d
from personaplex_voice.model.streaming import StepContext


def _run(modules: nn.ModuleList, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    for module in modules:
        if isinstance(module, (StreamingConv1d, StreamingConvTranspose1d, SEANetResnetBlock)):
            x = module.forward(x, ctx)
        else:
            x = module.forward(x)
    return x


def _activation(cfg: dict[str, Any]) -> nn.Module:
    return getattr(nn, cfg.get("activation", "ELU"))(**cfg.get("activation_params", {"alpha": 1.0}))


class SEANetResnetBlock(nn.Module):
    def __init__(self, dim: int, cfg: dict[str, Any], dilation: int):
        super().__init__()
        if cfg.get("norm", "none") != "none":
            raise ValueError(
                "only norm='none' SEANet weights are supported (the published inference weights)"
            )
        hidden = dim // cfg["compress"]
        pad_mode = cfg["pad_mode"]
        self.block = nn.ModuleList(
            [
                _activation(cfg),
                StreamingConv1d(
                    dim, hidden, cfg["residual_kernel_size"], dilation=dilation, pad_mode=pad_mode
                ),
                _activation(cfg),
                StreamingConv1d(hidden, dim, 1, pad_mode=pad_mode),
            ]
        )
        self.shortcut: nn.Module
        if cfg["true_skip"]:
            self.shortcut = nn.Identity()
        else:
            self.shortcut = StreamingConv1d(dim, dim, 1, pad_mode=pad_mode)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        u = self.shortcut(x, ctx) if isinstance(self.shortcut, StreamingConv1d) else x
        return u + _run(self.block, x, ctx)


class SEANetEncoder(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        if not cfg.get("causal", True):
            raise ValueError("only causal SEANet is supported for streaming")
        n_filters = cfg["n_filters"]
        pad_mode = cfg["pad_mode"]
        ratios = list(reversed(cfg["ratios"]))
        mult = 1
        layers: list[nn.Module] = [
            StreamingConv1d(cfg["channels"], n_filters, cfg["kernel_size"], pad_mode=pad_mode)
        ]
        for ratio in ratios:
            for j in range(cfg["n_residual_layers"]):
                layers.append(SEANetResnetBlock(mult * n_filters, cfg, cfg["dilation_base"] ** j))
            layers += [
                _activation(cfg),
                StreamingConv1d(
                    mult * n_filters, mult * n_filters * 2, ratio * 2, stride=ratio, pad_mode=pad_mode
                ),
            ]
            mult *= 2
        layers += [
            _activation(cfg),
            StreamingConv1d(mult * n_filters, cfg["dimension"], cfg["last_kernel_size"], pad_mode=pad_mode),
        ]
        self.model = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return _run(self.model, x, ctx)


class SEANetDecoder(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        n_filters = cfg["n_filters"]
        pad_mode = cfg["pad_mode"]
        ratios = list(cfg["ratios"])
        mult = 2 ** len(ratios)
        layers: list[nn.Module] = [
            StreamingConv1d(cfg["dimension"], mult * n_filters, cfg["kernel_size"], pad_mode=pad_mode)
        ]
        for ratio in ratios:
            layers += [
                _activation(cfg),
                StreamingConvTranspose1d(mult * n_filters, mult * n_filters // 2, ratio * 2, stride=ratio),
            ]
            for j in range(cfg["n_residual_layers"]):
                layers.append(SEANetResnetBlock(mult * n_filters // 2, cfg, cfg["dilation_base"] ** j))
            mult //= 2
        layers += [
            _activation(cfg),
            StreamingConv1d(n_filters, cfg["channels"], cfg["last_kernel_size"], pad_mode=pad_mode),
        ]
        if cfg.get("final_activation"):
            layers.append(getattr(nn, cfg["final_activation"])(**(cfg.get("final_activation_params") or {})))
        self.model = nn.ModuleList(layers)

    def forward(self, z: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return _run(self.model, z, ctx)
