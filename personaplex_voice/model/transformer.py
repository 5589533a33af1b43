"""Streaming transformer with per-slot ring KV caches.

Each slot has its own position counter `pos` and, per layer, a ring of `context` keys/values.
`kpos[b, i]` is the absolute position held by ring entry i of slot b (-1 = empty); attention
masks are built from it, so slots at different positions share one batched forward.

Long calls: by default the ring simply rolls (position p goes to entry p % context), which is the
published behaviour: after `context` steps the oldest frames, system prompt included, leave
attention. With a per-slot `pin` > 0 the first `pin` positions (the system prompt) keep their
entries and only the remaining `context - pin` entries roll; pinned entries stay attendable.

Either way a slot's entries fill from entry 0 upwards, so its filled entries are always the
prefix [0, min(pos, context)) of its ring: the decode attention reads that prefix only
(`model/ring_attention.py` on a GPU; on the CPU the SDPA call is cut to it). Each ring has one
entry more than its context, never attended: rows that must not change the cache (an idle
slot, a padding position) write there, so a write is one scatter per layer for every slot.

Everything a call's layers share is computed once in `plan`: the write positions, the mask, the
filled lengths, the rotary tables. A layer hands its MLP's residual update to the next one
(`pending`), which adds it inside its first norm: on a GPU that sum and the RMSNorm are one
kernel (`fused_ops.add_rms_norm`); on the CPU the same two steps run as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from personaplex_voice.model import fused_ops
from personaplex_voice.model.attention import sdpa_context
from personaplex_voice.model.quant import linear
from personaplex_voice.model.rope import RopeTables, rope_tables, rotate
from personaplex_voice.model.streaming import StepContext, StreamingModule, StreamState, commit

# The largest finite float8_e4m3fn: keys and values are clamped to it before an fp8 cache write
# (a cast of anything larger gives NaN, e4m3fn has no infinity).
FP8_MAX = 448.0
# torch's CPU SDPA kernel walks the keys in blocks of 512 once there are that many (fewer: one
# block of them all). Cutting the keys at a multiple of 512 keeps its blocks, hence its result
# bit for bit (`tests/test_gpu_ring_attention.py` checks it); a cut elsewhere does not.
CPU_SDPA_KEY_BLOCK = 512


def rms_norm_reference(x: torch.Tensor, alpha: torch.Tensor, eps: float, f32: bool) -> torch.Tensor:
    """The published RMSNorm arithmetic (float32 inside when `f32`); no-op conversions skipped."""
    x_dtype = x.dtype
    if f32 and x_dtype != torch.float32:
        x = x.to(torch.float32)
    var = eps + torch.mean(x**2, dim=-1, keepdim=True)
    alpha = alpha if alpha.dtype == var.dtype else alpha.to(var)
    y = x * (alpha * torch.rsqrt(var))
    return y if y.dtype == x_dtype else y.to(x_dtype)


class RMSNorm(nn.Module):
    FUSED_FLAGS: ClassVar[dict[str, str]] = {"norm": "fused"}

    def __init__(self, dim: int, eps: float, compute_dtype: torch.dtype | None):
        super().__init__()
        self.eps = eps
        self.compute_dtype = compute_dtype
        self.alpha = nn.Parameter(torch.ones(1, 1, dim))
        self.fused = False  # the Triton kernel (float32 inside): only where the reference is too

    def _kernel_ok(self, x: torch.Tensor) -> bool:
        return self.fused and (self.compute_dtype == torch.float32 or x.dtype == torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel_ok(x):
            return fused_ops.norm_op(x, self.alpha, None, self.eps, False)
        return rms_norm_reference(x, self.alpha, self.eps, self.compute_dtype == torch.float32)

    def add_forward(
        self, x: torch.Tensor, update: torch.Tensor, scale: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + scale * update, the norm of that): one kernel when fused."""
        if self._kernel_ok(x):
            return fused_ops.add_norm_op(x, update, scale, self.alpha, None, self.eps, False)
        x = x + (update if scale is None else scale * update)
        return x, self.forward(x)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (its parameter names), whose residual sum and norm can be one kernel."""

    FUSED_FLAGS: ClassVar[dict[str, str]] = {"norm": "fused"}

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps=eps)
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return fused_ops.norm_op(x, self.weight, self.bias, self.eps, True)
        return super().forward(x)

    def add_forward(
        self, x: torch.Tensor, update: torch.Tensor, scale: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused:
            return fused_ops.add_norm_op(x, update, scale, self.weight, self.bias, self.eps, True)
        x = x + (update if scale is None else scale * update)
        return x, super().forward(x)


def add_then_norm(
    norm: nn.Module, x: torch.Tensor, update: torch.Tensor | None, scale: nn.Module | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream after adding `update` (times the layer scale `scale`, if any; None:
    nothing pending), and its norm: one kernel where the norm is fused."""
    if update is None:
        return x, norm.forward(x)
    factor = scale.scale if isinstance(scale, LayerScale) else None
    if isinstance(norm, (RMSNorm, LayerNorm)):
        return norm.add_forward(x, update, factor)
    x = x + (update if factor is None else factor * update)
    return x, norm.forward(x)


class LayerNormF32(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.float()).to(x.dtype)


def make_norm(kind: str, dim: int) -> nn.Module:
    if kind == "layer_norm":
        return LayerNorm(dim, eps=1e-5)
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
    FUSED_FLAGS: ClassVar[dict[str, str]] = {"silu_mul": "fused"}

    def __init__(self, dim: int, dim_feedforward: int, activation: str):
        super().__init__()
        hidden = gating_hidden(dim, dim_feedforward)
        self.linear_in = nn.Linear(dim, 2 * hidden, bias=False)
        self.linear_out = nn.Linear(hidden, dim, bias=False)
        self.activation = _ACTIVATIONS[activation]
        self.is_silu = activation == "silu"
        self.fused = False  # silu(gate) * value as one kernel (silu gating only)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = linear(x, self.linear_in.weight)
        if self.fused and self.is_silu:
            x = fused_ops.silu_mul_op(x)
        else:
            x = x.view(*x.shape[:-1], 2, -1)
            x = self.activation(x[..., 0, :]) * x[..., 1, :]
        return linear(x, self.linear_out.weight)


@dataclass
class AttentionPlan:
    """Shared by every layer of one transformer call: where to write, what to attend."""

    positions: torch.Tensor  # long [B, T] absolute query positions
    write_index: torch.Tensor  # long [B, T] ring entry each position writes (the spare entry: none)
    mask: torch.Tensor  # bool [B, 1, T, context]
    lengths: torch.Tensor  # long [B]: filled entries after this call (the prefix read); 0 = idle slot
    rope: RopeTables | None  # None: no rotary embedding
    # CPU only: keys read by SDPA (the filled prefix, cut where torch's CPU kernel keeps its
    # blocks); None = the whole ring (GPU: static shapes).
    read: int | None = None


def _cpu_read_extent(filled: int, context: int) -> int:
    if context < CPU_SDPA_KEY_BLOCK:
        return context
    return min(context, -(-filled // CPU_SDPA_KEY_BLOCK) * CPU_SDPA_KEY_BLOCK)


class StreamingAttention(StreamingModule):
    FUSED_FLAGS: ClassVar[dict[str, str]] = {"rope_write": "fused_rope", "ring_attention": "ring_kernel"}

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
        # q and k rotated, k and v written to the cache by one kernel (a cache in the compute
        # dtype: an fp8 cache's clamp and cast take the reference path, whose conversion Triton's
        # CPU interpreter cannot check, so the tests could not either)
        self.fused_rope = False
        # The tick's one-query attention by the length-aware kernel (model/ring_attention.py),
        # which reads only the filled prefix of active slots' rings (bfloat16 or fp8 cache).
        self.ring_kernel = False

    def init_own_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> StreamState:
        # one spare entry past the context: where the rows that must not write, write
        shape = (batch, self.num_heads, self.capacity + 1, self.dim // self.num_heads)
        kv_dtype = self.kv_dtype or dtype
        return {
            "k": torch.zeros(shape, device=device, dtype=kv_dtype),
            "v": torch.zeros(shape, device=device, dtype=kv_dtype),
        }

    def _rotate_and_write(
        self, projected: torch.Tensor, plan: AttentionPlan, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """q and k rotated, k and v written to the cache at the plan's entries; returns q
        [B, H, T, D]. (The reference of `fused_ops.rope_write_op`.)"""
        B, T, _, H, D = projected.shape
        qk = projected[:, :, :2]
        if plan.rope is not None:
            qk = rotate(qk, plan.rope)
        q, k = qk[:, :, 0].transpose(1, 2), qk[:, :, 1].transpose(1, 2)  # [B, H, T, D]
        v = projected[:, :, 2].transpose(1, 2)
        index = plan.write_index[:, None, :, None].expand(B, H, T, D)
        if k_cache.dtype.itemsize == 1:  # an fp8 cache: clamp to its range, move raw bytes
            # gather/scatter have no float8 kernels: the same bytes as uint8
            k = k.clamp(-FP8_MAX, FP8_MAX).to(k_cache.dtype).view(torch.uint8)
            v = v.clamp(-FP8_MAX, FP8_MAX).to(v_cache.dtype).view(torch.uint8)
            k_cache.view(torch.uint8).scatter_(2, index, k)
            v_cache.view(torch.uint8).scatter_(2, index, v)
        else:
            k_cache.scatter_(2, index, k if k.dtype == k_cache.dtype else k.to(k_cache.dtype))
            v_cache.scatter_(2, index, v if v.dtype == v_cache.dtype else v.to(v_cache.dtype))
        return q

    def forward(self, x: torch.Tensor, plan: AttentionPlan, ctx: StepContext) -> torch.Tensor:
        B, T, C = x.shape
        H = self.num_heads
        D = C // H
        projected = linear(x, self.in_proj_weight).view(B, T, 3, H, D)
        k_cache, v_cache = self.st(ctx, "k"), self.st(ctx, "v")
        fp8 = k_cache.dtype.itemsize == 1
        if plan.rope is not None and self.fused_rope and not fp8:
            q = fused_ops.rope_write_op(
                projected, plan.rope.cos2, plan.rope.sin2, plan.write_index, k_cache, v_cache
            ).transpose(1, 2)
        else:
            q = self._rotate_and_write(projected, plan, k_cache, v_cache)
        n = self.capacity
        keys, values = k_cache[:, :, :n], v_cache[:, :, :n]  # the spare entry is never read
        if T == 1 and self.ring_kernel:
            out = fused_ops.ring_attention_op(q, keys, values, plan.mask, plan.lengths)
        else:
            mask = plan.mask
            if plan.read is not None and plan.read < n:
                keys, values, mask = (
                    keys[:, :, : plan.read],
                    values[:, :, : plan.read],
                    mask[..., : plan.read],
                )
            # A cache in another dtype is read back in the compute dtype (one layer at a time).
            out = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), mask)
        out = out.transpose(1, 2).reshape(B, T, C)
        return linear(out, self.out_proj.weight)


# A layer's MLP update not yet added to the residual stream, and the layer scale it takes.
Pending = tuple[torch.Tensor, nn.Module]


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

    @staticmethod
    def finish(x: torch.Tensor, pending: Pending) -> torch.Tensor:
        """The last layer's MLP update added to the stream."""
        update, scale = pending
        return x + (update if isinstance(scale, nn.Identity) else scale.forward(update))

    def forward(
        self, x: torch.Tensor, plan: AttentionPlan, ctx: StepContext, pending: Pending | None = None
    ) -> tuple[torch.Tensor, Pending]:
        """x: the residual stream; `pending`: the previous layer's MLP update and its layer scale,
        not yet added to it. Returns the stream and this layer's pending update (added by the
        next layer's first norm, or by `finish` after the last layer)."""
        # `.forward` calls skip nn.Module dispatch: this runs once per layer per 80 ms tick.
        x, h = add_then_norm(self.norm1, x, *(pending or (None, None)))
        update = self.self_attn.forward(h, plan, ctx)
        x, h = add_then_norm(self.norm2, x, update, self.layer_scale_1)
        if self.gating is not None:
            update = self.gating.forward(h)
        else:
            assert self.linear1 is not None and self.linear2 is not None
            update = linear(F.gelu(linear(h, self.linear1.weight)), self.linear2.weight)
        return x, (update, self.layer_scale_2)


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
        self.head_dim = d_model // num_heads
        self.rope_period = float(max_period) if positional_embedding == "rope" else None
        self.layers = nn.ModuleList(
            [
                StreamingTransformerLayer(
                    d_model,
                    num_heads,
                    dim_feedforward,
                    self.context,
                    self.rope_period,
                    norm,
                    layer_scale,
                    gating,
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
        # Rows that must keep what the cache holds (idle slots, padding) write the spare entry.
        drop = None if ctx.active is None else ~ctx.active[:, None]
        if is_real is not None:
            drop = ~is_real if drop is None else drop | ~is_real
        write_index = index if drop is None else torch.where(drop, self.context, index)
        filled = torch.clamp(pos + n, max=self.context)
        lengths = filled if ctx.active is None else torch.where(ctx.active, filled, 0)
        read = None
        if pos.device.type == "cpu":  # no static shapes to keep: SDPA reads the filled prefix
            read = _cpu_read_extent(int(filled.max()), self.context)
        commit(kpos, kpos_after, ctx.active)
        commit(pos, pos + n, ctx.active)
        mask = allowed.view(B, 1, T, self.context)
        tables = None if self.rope_period is None else rope_tables(positions, self.head_dim, self.rope_period)
        return AttentionPlan(positions, write_index, mask, lengths, tables, read)

    def forward(self, x: torch.Tensor, ctx: StepContext, real: int | None = None) -> torch.Tensor:
        """Advance each slot by T = x.shape[1] positions (by `real` of them when padded)."""
        if x.shape[1] > self.context:
            raise ValueError(f"cannot process {x.shape[1]} steps at once with a context of {self.context}")
        plan = self.plan(x.shape[1], ctx, real)
        pending = None
        with sdpa_context(self.sdpa_decode if x.shape[1] == 1 else self.sdpa_prefill):
            for layer in self.layers:
                x, pending = layer.forward(x, plan, ctx, pending)
        return x if pending is None else self.layers[-1].finish(x, pending)


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
