"""Streaming transformer with per-slot ring KV caches.

Each slot has its own position counter `pos` and, per layer, a ring of `context` keys/values.
`kpos[b, i]` is the absolute position held by ring entry i of slot b (-1 = empty); attention
masks are built from it, so slots at different positions share one batched forward.

Long calls: by default the ring simply rolls (position p goes to entry p % context), which is the
published behaviour: after `context` steps the oldest frames, system prompt included, leave
attention. With a per-slot `pin` > 0 the first `pin` positions (the system prompt) keep their
entries and only the remaining `context - pin` entries roll; pinned entries stay attendable.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from personaplex_voice.model.attention import sdpa_context
from personaplex_voice.model.quant import linear
from personaplex_voice.model.streaming import StepContext, StreamingModule, StreamState, commit

# Decode attention reading a float8 KV cache directly (model/fp8_attention.py):
# (q [B, H, 1, D], k_cache, v_cache [B, H, N, D], mask [B, 1, 1, N]) -> [B, H, 1, D].
Fp8DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# The largest finite float8_e4m3fn: keys and values are clamped to it before an fp8 cache write
# (a cast of anything larger gives NaN, e4m3fn has no infinity).
FP8_MAX = 448.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, compute_dtype: torch.dtype | None):
        super().__init__()
        self.eps = eps
        self.compute_dtype = compute_dtype
        self.alpha = nn.Parameter(torch.ones(1, 1, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The published arithmetic; conversions are skipped (not changed) when they are no-ops.
        x_dtype = x.dtype
        if self.compute_dtype is not None and x_dtype != self.compute_dtype:
            x = x.to(self.compute_dtype)
        var = self.eps + torch.mean(x**2, dim=2, keepdim=True)
        alpha = self.alpha if self.alpha.dtype == var.dtype else self.alpha.to(var)
        y = x * (alpha * torch.rsqrt(var))
        return y if y.dtype == x_dtype else y.to(x_dtype)


class LayerNormF32(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.float()).to(x.dtype)


def make_norm(kind: str, dim: int) -> nn.Module:
    if kind == "layer_norm":
        return nn.LayerNorm(dim, eps=1e-5)
    if kind == "layer_norm_f32":
        return LayerNormF32(dim, eps=1e-8)
    if kind == "rms_norm":
        return RMSNorm(dim, eps=1e-5, compute_dtype=None)
    if kind == "rms_norm_f32":
        return RMSNorm(dim, eps=1e-8, compute_dtype=torch.float32)
    raise ValueError(f"unknown norm {kind!r}")


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), float(init)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "relu": torch.relu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "elu": F.elu,
    "leaky_relu": F.leaky_relu,
    "mish": F.mish,
    "softsign": F.softsign,
    "identity": lambda x: x,
}


def gating_hidden(dim: int, dim_feedforward: int) -> int:
    """Hidden width of a gated FFN for a given `dim_feedforward` (the published rule)."""
    if dim_feedforward == 4 * dim:
        return (21 * dim) // 8
    return (2 * dim_feedforward) // 3


class ActivationGating(nn.Module):
    def __init__(self, dim: int, dim_feedforward: int, activation: str):
        super().__init__()
        hidden = gating_hidden(dim, dim_feedforward)
        self.linear_in = nn.Linear(dim, 2 * hidden, bias=False)
        self.linear_out = nn.Linear(hidden, dim, bias=False)
        self.activation = _ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = linear(x, self.linear_in.weight)
        x = x.view(*x.shape[:-1], 2, -1)
        x = self.activation(x[..., 0, :]) * x[..., 1, :]
        return linear(x, self.linear_out.weight)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, max_period: float):
    """Rotary embedding of q, k [B, H, T, D] at per-slot absolute `positions` [B, T]."""
    B, H, T, D = q.shape
    ds = torch.arange(D // 2, device=q.device, dtype=torch.float32)
    freqs = torch.exp(ds * (-math.log(max_period) * 2 / D))
    ts = positions.to(torch.float32).view(B, 1, T, 1)
    q = q.view(B, H, T, D // 2, 2)
    k = k.view(B, H, T, D // 2, 2)
    qr, qi = q[..., 0].float(), q[..., 1].float()
    kr, ki = k[..., 0].float(), k[..., 1].float()
    rotr = torch.cos(freqs * ts)
    roti = torch.sin(freqs * ts)
    qor = qr * rotr - qi * roti
    qoi = qr * roti + qi * rotr
    kor = kr * rotr - ki * roti
    koi = kr * roti + ki * rotr
    dtype = q.dtype
    qo = torch.stack([qor.to(dtype), qoi.to(dtype)], dim=-1)
    ko = torch.stack([kor.to(dtype), koi.to(dtype)], dim=-1)
    return qo.view(B, H, T, D), ko.view(B, H, T, D)


def _gather_fp8(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8).gather(2, index).view(cache.dtype)


@dataclass
class AttentionPlan:
    """Shared by every layer of one transformer call: where to write, what to attend."""

    positions: torch.Tensor  # long [B, T] absolute query positions
    index: torch.Tensor  # long [B, T] ring entries written
    mask: torch.Tensor  # bool [B, 1, T, capacity]
    # bool [1, T]: which positions are real; padding (False) is computed but written nowhere.
    # None = all real.
    real: torch.Tensor | None = None


class StreamingAttention(StreamingModule):
    def __init__(self, dim: int, num_heads: int, capacity: int, rope_period: float | None):
        super().__init__()
        self.dim = dim
        self.num_heads = num_heads
        self.capacity = capacity
        self.rope_period = rope_period
        self.in_proj_weight = nn.Parameter(torch.empty(3 * dim, dim))
        self.out_proj = nn.Linear(dim, dim, bias=False)
        nn.init.xavier_uniform_(self.in_proj_weight)
        # The KV cache's dtype when it differs from the compute dtype (fp8 for low VRAM); None =
        # the dtype the state is created with.
        self.kv_dtype: torch.dtype | None = None
        # Set by the engine once checked: one-query attention read straight from an fp8 cache.
        self.fp8_decode: Fp8DecodeAttention | None = None

    def init_own_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> StreamState:
        shape = (batch, self.num_heads, self.capacity, self.dim // self.num_heads)
        kv_dtype = self.kv_dtype or dtype
        return {
            "k": torch.zeros(shape, device=device, dtype=kv_dtype),
            "v": torch.zeros(shape, device=device, dtype=kv_dtype),
        }

    def forward(self, x: torch.Tensor, plan: AttentionPlan, ctx: StepContext) -> torch.Tensor:
        B, T, C = x.shape
        H = self.num_heads
        projected = linear(x, self.in_proj_weight)
        q, k, v = projected.view(B, T, 3, H, C // H).permute(2, 0, 3, 1, 4).unbind(0)
        if self.rope_period is not None:
            q, k = apply_rope(q, k, plan.positions, self.rope_period)
        k_cache, v_cache = self.st(ctx, "k"), self.st(ctx, "v")
        index = plan.index[:, None, :, None].expand(B, H, T, C // H)
        # Rows that must keep what the cache holds: inactive slots, padding positions.
        keep = None if ctx.active is None else ~ctx.active.view(B, 1, 1, 1)
        if plan.real is not None:
            pad = ~plan.real.view(1, 1, T, 1)
            keep = pad if keep is None else keep | pad
        fp8 = k_cache.dtype.itemsize == 1
        if fp8:  # an fp8 cache: clamp to its range, move raw bytes
            k, v = k.clamp(-FP8_MAX, FP8_MAX), v.clamp(-FP8_MAX, FP8_MAX)
            if keep is not None:
                k = torch.where(keep, _gather_fp8(k_cache, index).to(k.dtype), k)
                v = torch.where(keep, _gather_fp8(v_cache, index).to(v.dtype), v)
            # gather/scatter have no float8 kernels: the same bytes as uint8
            k_cache.view(torch.uint8).scatter_(2, index, k.to(k_cache.dtype).view(torch.uint8))
            v_cache.view(torch.uint8).scatter_(2, index, v.to(v_cache.dtype).view(torch.uint8))
        else:
            if keep is not None:
                k = torch.where(keep, k_cache.gather(2, index), k)
                v = torch.where(keep, v_cache.gather(2, index), v)
            k_cache.scatter_(2, index, k.to(k_cache.dtype))
            v_cache.scatter_(2, index, v.to(v_cache.dtype))
        if fp8 and T == 1 and self.fp8_decode is not None:
            out = self.fp8_decode(q, k_cache, v_cache, plan.mask)
        else:
            # A cache in another dtype is read back in the compute dtype (one layer at a time).
            keys, values = k_cache.to(q.dtype), v_cache.to(q.dtype)
            out = F.scaled_dot_product_attention(q, keys, values, plan.mask)
        out = out.transpose(1, 2).reshape(B, T, C)
        return linear(out, self.out_proj.weight)


class StreamingTransformerLayer(nn.Module):
    def __init__(
        self,
        dim: int,
        num_heads: int,
        dim_feedforward: int,
        capacity: int,
        rope_period: float | None,
        norm: str,
        layer_scale: float | None,
        gating: str,
    ):
        super().__init__()
        self.self_attn = StreamingAttention(dim, num_heads, capacity, rope_period)
        self.norm1 = make_norm(norm, dim)
        self.norm2 = make_norm(norm, dim)
        self.gating: nn.Module | None = None
        self.linear1: nn.Module | None = None
        self.linear2: nn.Module | None = None
        if gating == "none":
            self.linear1 = nn.Linear(dim, dim_feedforward, bias=False)
            self.linear2 = nn.Linear(dim_feedforward, dim, bias=False)
        else:
            self.gating = ActivationGating(dim, dim_feedforward, gating)
        self.layer_scale_1: nn.Module = nn.Identity() if layer_scale is None else LayerScale(dim, layer_scale)
        self.layer_scale_2: nn.Module = nn.Identity() if layer_scale is None else LayerScale(dim, layer_scale)
        self._no_scale = layer_scale is None

    def forward(self, x: torch.Tensor, plan: AttentionPlan, ctx: StepContext) -> torch.Tensor:
        # `.forward` calls skip nn.Module dispatch: this runs once per layer per 80 ms tick.
        update = self.self_attn.forward(self.norm1.forward(x), plan, ctx)
        x = x + (update if self._no_scale else self.layer_scale_1.forward(update))
        h = self.norm2.forward(x)
        if self.gating is not None:
            update = self.gating.forward(h)
        else:
            assert self.linear1 is not None and self.linear2 is not None
            update = linear(F.gelu(linear(h, self.linear1.weight)), self.linear2.weight)
        return x + (update if self._no_scale else self.layer_scale_2.forward(update))


class StreamingTransformer(StreamingModule):
    """Causal transformer over per-slot streams. forward(x [B, T, C]) advances each slot by T."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_layers: int,
        dim_feedforward: int,
        context: int,
        positional_embedding: str = "rope",
        max_period: float = 10000,
        norm: str = "layer_norm",
        layer_scale: float | None = None,
        gating: str = "none",
        causal: bool = True,
    ):
        super().__init__()
        if not causal:
            raise ValueError("streaming needs a causal transformer")
        if positional_embedding not in ("rope", "none"):
            raise ValueError(f"unsupported positional embedding {positional_embedding!r}")
        if not context or context <= 0:
            raise ValueError("a streaming transformer needs a finite context")
        self.context = int(context)
        rope_period = float(max_period) if positional_embedding == "rope" else None
        self.layers = nn.ModuleList(
            [
                StreamingTransformerLayer(
                    d_model, num_heads, dim_feedforward, self.context, rope_period, norm, layer_scale, gating
                )
                for _ in range(num_layers)
            ]
        )
        # SDPA backends pinned per phase (model/attention.py): one query per slot (the tick) and
        # several (prefill). None = torch's own choice.
        self.sdpa_decode: tuple[str, ...] | None = None
        self.sdpa_prefill: tuple[str, ...] | None = None

    def init_own_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> StreamState:
        return {
            "pos": torch.zeros(batch, dtype=torch.long, device=device),
            "kpos": torch.full((batch, self.context), -1, dtype=torch.long, device=device),
            "pin": torch.zeros(batch, dtype=torch.long, device=device),
        }

    def plan(self, T: int, ctx: StepContext, real: int | None = None) -> AttentionPlan:
        """Where this call's T positions go and what each attends. With `real` < T, the last
        T - real positions are padding: computed, but they write no entry, move no position and
        are invisible to the real ones (a fixed chunk length, whatever the prompt's length)."""
        pos, kpos, pin = self.st(ctx, "pos"), self.st(ctx, "kpos"), self.st(ctx, "pin")
        B = pos.shape[0]
        steps = torch.arange(T, device=pos.device)
        positions = pos[:, None] + steps
        pin_ = pin[:, None]
        rolling = pin_ + torch.remainder(positions - pin_, self.context - pin_)
        index = torch.where(positions < pin_, positions, rolling)
        is_real = None
        written = positions
        if real is not None and real < T:
            is_real = (steps < real)[None, :]
            written = torch.where(is_real, positions, kpos.gather(1, index))
        n = T if is_real is None else real
        kpos_after = kpos.scatter(1, index, written)
        delta = positions[:, :, None] - kpos_after[:, None, :]
        allowed = (kpos_after >= 0)[:, None, :] & (delta >= 0)
        # The published ring gives its oldest entry, once the ring is full, the position of the
        # next write, which masks it: only the last `context - 1` positions are attended
        # (`kpos > end - context`). Reproduced so long calls stay exact; pinned entries are exempt.
        end = (pos + n)[:, None]
        recent = (kpos_after > end - self.context)[:, None, :] & (delta < self.context)
        pinned = (kpos_after < pin_)[:, None, :]
        allowed = allowed & (recent | pinned)
        commit(kpos, kpos_after, ctx.active)
        commit(pos, pos + n, ctx.active)
        mask = allowed.view(B, 1, T, self.context)
        return AttentionPlan(positions=positions, index=index, mask=mask, real=is_real)

    def forward(self, x: torch.Tensor, ctx: StepContext, real: int | None = None) -> torch.Tensor:
        """Advance each slot by T = x.shape[1] positions (by `real` of them when padded)."""
        if x.shape[1] > self.context:
            raise ValueError(f"cannot process {x.shape[1]} steps at once with a context of {self.context}")
        plan = self.plan(x.shape[1], ctx, real)
        with sdpa_context(self.sdpa_decode if x.shape[1] == 1 else self.sdpa_prefill):
            for layer in self.layers:
                x = layer.forward(x, plan, ctx)
        return x


class ProjectedTransformer(nn.Module):
    """Mimi's transformer: [B, C, T] in and out, optional input/output projections."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        d_model = cfg["d_model"]
        self.transformer = StreamingTransformer(
            d_model=d_model,
            num_heads=cfg["num_heads"],
            num_layers=cfg["num_layers"],
            dim_feedforward=cfg["dim_feedforward"],
            context=cfg["context"],
            positional_embedding=cfg.get("positional_embedding", "rope"),
            max_period=cfg.get("max_period", 10000),
            norm=cfg.get("norm", "layer_norm"),
            layer_scale=cfg.get("layer_scale"),
            gating=cfg.get("gating", "none"),
            causal=cfg.get("causal", True),
        )
        self.conv_layout = cfg.get("conv_layout", True)
        input_dim = cfg["input_dimension"]
        self.input_proj = nn.Linear(input_dim, d_model, bias=False) if input_dim != d_model else None
        outs = cfg["output_dimensions"]
        if len(outs) != 1:
            raise ValueError("Mimi transformers have exactly one output")
        self.output_projs = nn.ModuleList(
            [nn.Identity() if d == d_model else nn.Linear(d_model, d, bias=False) for d in outs]
        )

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        if self.conv_layout:
            x = x.transpose(1, 2)
        if self.input_proj is not None:
            x = self.input_proj(x)
        z = self.transformer(x, ctx)
        y = self.output_projs[0](z)
        return y.transpose(1, 2) if self.conv_layout else y
