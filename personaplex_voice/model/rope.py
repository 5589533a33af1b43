"""Rotary position embedding, computed once per transformer call and applied per layer.

The published code recomputes the frequencies, the angles and their cosines in every layer and
rotates q and k separately, ~40 tensor operations a layer. Here the per-call part (`RopeTables`:
the angles of every slot's positions, as interleaved cos / signed-sin rows) is computed once in
the transformer's plan and shared by all its layers, and a layer rotates q and k together:

    out = x * cos2 + swap_pairs(x) * sin2,   cos2 = [c0, c0, c1, c1, ...], sin2 = [-s0, s0, -s1, s1, ...]

which is the published arithmetic bit for bit: the real part is `xr*c + xi*(-s)`, and
`xi*(-s) = -(xi*s)` and `a + (-b) = a - b` hold exactly in IEEE arithmetic; the imaginary part
`xi*c + xr*s` is the published `xr*s + xi*c` (addition commutes exactly). Angles are float32 as
published, whatever the compute dtype; the result is rounded back to it.

On a GPU the per-layer rotation is one fused kernel (`fused_ops.rope`) when it checked out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_FREQS: dict[tuple[int, float, torch.device], torch.Tensor] = {}
_PAIRED: dict[tuple[int, float, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


@dataclass
class RopeTables:
    """The rotation of one call's positions: float32 [B, T, 1, 1, D] each (broadcast over the
    q/k pair and the heads of a [B, T, 2, H, D] tensor)."""

    cos2: torch.Tensor
    sin2: torch.Tensor


def frequencies(head_dim: int, max_period: float, device: torch.device) -> torch.Tensor:
    """The published `exp(arange(D/2) * (-log(max_period) * 2 / D))`, float32, made once."""
    key = (head_dim, float(max_period), device)
    freqs = _FREQS.get(key)
    if freqs is None:
        ds = torch.arange(head_dim // 2, device=device, dtype=torch.float32)
        freqs = torch.exp(ds * (-math.log(max_period) * 2 / head_dim))
        _FREQS[key] = freqs
    return freqs


def _paired(head_dim: int, max_period: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each frequency twice ([f0, f0, f1, f1, ...]) and the signs [-1, 1, -1, 1, ...], made once."""
    key = (head_dim, float(max_period), device)
    pair = _PAIRED.get(key)
    if pair is None:
        freqs = frequencies(head_dim, max_period, device)
        signs = torch.tensor([-1.0, 1.0], device=device).repeat(head_dim // 2)
        pair = _PAIRED[key] = (torch.repeat_interleave(freqs, 2), signs)
    return pair


def rope_tables(positions: torch.Tensor, head_dim: int, max_period: float) -> RopeTables:
    """Tables for absolute `positions` [B, T] (long). The angles are the published
    `freqs * ts`, each computed twice (its pair's two slots) rather than copied: the same values;
    the sign flip is exact."""
    B, T = positions.shape
    freqs2, signs = _paired(head_dim, max_period, positions.device)
    angles = freqs2 * positions.to(torch.float32)[..., None]  # [B, T, D]
    cos2 = torch.cos(angles).view(B, T, 1, 1, head_dim)
    sin2 = (torch.sin(angles) * signs).view(B, T, 1, 1, head_dim)
    return RopeTables(cos2, sin2)


def rotate(qk: torch.Tensor, tables: RopeTables) -> torch.Tensor:
    """q and k [B, T, 2, H, D] (any strides) rotated, as a new [B, T, 2, H, D] tensor in qk's dtype."""
    x = qk.float()
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    out = x * tables.cos2 + swapped * tables.sin2
    return out if out.dtype == qk.dtype else out.to(qk.dtype)
