"""Small Triton kernels that fuse what the tick would otherwise run as several tensor operations.

Each replaces a chain of elementwise / row operations by one kernel launch (inside a CUDA graph a
launch costs ~2-3 us whatever its size, and the tick has a few thousand of them):
- `add_norm`: the residual sum (with a layer scale, if any) and the norm after it, RMSNorm or
  LayerNorm, float32 inside, one program per row;
- `silu_mul`: the gated FFN's `silu(gate) * value`;
- `rope_write`: q and k rotated (see `model/rope.py` for the arithmetic), the rotated k and the
  v written into the ring KV cache at this call's entries (a bfloat16 / float32 cache);
- `step_attention`: the depth transformer's attention of one step over this tick's earlier
  steps, with this step's key and value appended.
Numerics: float32 inside, each result rounded to the tensors' dtype where the reference rounds
it; a GPU may contract products into FMAs, so they agree with the reference within rounding,
not bit for bit. `model/fused_ops.py` wraps them as torch custom ops and checks each against its
reference before the engine uses it.

Triton is imported at first use, never at import: a CPU-only install never needs it.
`TRITON_INTERPRET=1` runs the same kernels on CPU tensors (the tests).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

_jitted: dict[tuple[str, bool], Any] = {}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available(device: torch.device) -> bool:
    """Triton is importable and runs on `device` (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        return False
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def jitted(name: str, build: Any) -> Any:
    """`build()`'s kernel, jitted once per interpreter mode (chosen when a function is jitted)."""
    key = (name, interpreting())
    if key not in _jitted:
        import triton

        _jitted[key] = triton.jit(build())
    return _jitted[key]


def _norm_source() -> Any:
    import triton.language as tl

    def norm_kernel(
        x_ptr,
        u_ptr,
        s_ptr,
        w_ptr,
        b_ptr,
        h_ptr,
        y_ptr,
        n_cols,
        eps,
        HAS_UPDATE: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        LAYER_NORM: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=ok, other=0.0)
        if HAS_UPDATE:
            u = tl.load(u_ptr + row * n_cols + cols, mask=ok, other=0.0)
            if HAS_SCALE:  # a layer scale: rounded to the dtype before the sum, as `scale * u` is
                scale = tl.load(s_ptr + cols, mask=ok, other=0.0).to(tl.float32)
                u = (scale * u.to(tl.float32)).to(h_ptr.dtype.element_ty)
            # the residual sum is rounded to the model dtype, as `x + update` is
            x = (x.to(tl.float32) + u.to(tl.float32)).to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + row * n_cols + cols, x, mask=ok)
        xf = x.to(tl.float32)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        if LAYER_NORM:
            mean = tl.sum(xf, axis=0) / n_cols
            centred = tl.where(ok, xf - mean, 0.0)
            var = tl.sum(centred * centred, axis=0) / n_cols
            bias = tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            y = centred * (1.0 / tl.sqrt(var + eps)) * w + bias
        else:
            var = eps + tl.sum(xf * xf, axis=0) / n_cols
            y = xf * (w * (1.0 / tl.sqrt(var)))
        tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=ok)

    return norm_kernel


def _norm_warps(cols: int) -> int:
    return 8 if cols >= 2048 else 4


def add_norm(
    x: torch.Tensor,
    update: torch.Tensor | None,
    scale: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    layer_norm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h = x + scale * update, norm(h)) in one pass over rows of x [..., C] (no update: h is x).
    RMSNorm: h * (weight * rsqrt(eps + mean(h^2))); LayerNorm: (h - mean) / sqrt(var + eps) *
    weight + bias. float32 inside."""
    cols = x.shape[-1]
    x = x.contiguous()
    h = torch.empty_like(x) if update is not None else x
    y = torch.empty_like(x)
    update = update.contiguous() if update is not None else x
    rows = x.numel() // cols
    jitted("norm", _norm_source)[(rows,)](
        x, update, scale if scale is not None else weight, weight, bias if bias is not None else weight,
        h, y, cols, eps,
        HAS_UPDATE=update is not x, HAS_SCALE=scale is not None, LAYER_NORM=layer_norm,
        BLOCK=next_power_of_2(cols), num_warps=_norm_warps(cols),
    )  # fmt: skip
    return h, y


def _silu_mul_source() -> Any:
    import triton.language as tl

    def silu_mul_kernel(g_ptr, out_ptr, hidden, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < hidden
        gate = tl.load(g_ptr + row * 2 * hidden + cols, mask=ok, other=0.0)
        value = tl.load(g_ptr + row * 2 * hidden + hidden + cols, mask=ok, other=0.0)
        gf = gate.to(tl.float32)
        # silu rounded to the dtype first, as F.silu(gate) * value does
        act = (gf / (1.0 + tl.exp(-gf))).to(out_ptr.dtype.element_ty)
        out = act.to(tl.float32) * value.to(tl.float32)
        tl.store(out_ptr + row * hidden + cols, out.to(out_ptr.dtype.element_ty), mask=ok)

    return silu_mul_kernel


SILU_BLOCK = 1024


def silu_mul(g: torch.Tensor) -> torch.Tensor:
    """g [..., 2 * hidden] -> silu(g[..., :hidden]) * g[..., hidden:]."""
    hidden = g.shape[-1] // 2
    g = g.contiguous()
    out = g.new_empty(*g.shape[:-1], hidden)
    rows = g.numel() // (2 * hidden)
    grid = (rows, -(-hidden // SILU_BLOCK))
    jitted("silu_mul", _silu_mul_source)[grid](g, out, hidden, BLOCK=SILU_BLOCK, num_warps=4)
    return out


def _rope_write_source() -> Any:
    import triton.language as tl

    def rope_write_kernel(
        x_ptr,
        cos_ptr,
        sin_ptr,
        index_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        stride_row,
        stride_part,
        stride_head,
        stride_kb,
        stride_kh,
        stride_kn,
        stride_vb,
        stride_vh,
        stride_vn,
        positions,
        heads,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)  # slot x position
        part_head = tl.program_id(1)  # q, k or v, times heads
        part = part_head // heads
        head = part_head % heads
        b = row // positions
        d = tl.arange(0, BLOCK_D)
        ok = d < HEAD_DIM
        base = x_ptr + row * stride_row + part * stride_part + head * stride_head
        x = tl.load(base + d, mask=ok, other=0.0).to(tl.float32)
        if part < 2:  # q and k are rotated
            partner = tl.load(base + (d ^ 1), mask=ok, other=0.0).to(tl.float32)
            cos2 = tl.load(cos_ptr + row * HEAD_DIM + d, mask=ok, other=0.0)
            sin2 = tl.load(sin_ptr + row * HEAD_DIM + d, mask=ok, other=0.0)
            x = x * cos2 + partner * sin2
        entry = tl.load(index_ptr + row)
        if part == 0:
            tl.store(q_ptr + (row * heads + head) * HEAD_DIM + d, x.to(q_ptr.dtype.element_ty), mask=ok)
        elif part == 1:
            dest = k_ptr + b * stride_kb + head * stride_kh + entry * stride_kn + d
            tl.store(dest, x.to(k_ptr.dtype.element_ty), mask=ok)
        else:
            dest = v_ptr + b * stride_vb + head * stride_vh + entry * stride_vn + d
            tl.store(dest, x.to(v_ptr.dtype.element_ty), mask=ok)

    return rope_write_kernel


def rope_write(
    projected: torch.Tensor,
    cos2: torch.Tensor,
    sin2: torch.Tensor,
    write_index: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """projected [B, T, 3, H, D] (q, k, v; head dim contiguous, B and T mergeable): q and k
    rotated by the tables [B, T, 1, 1, D]; the rotated k and v written to the caches [B, H, N, D]
    at ring entry `write_index` [B, T]; returns the rotated q [B, T, H, D]."""
    B, T, three, H, D = projected.shape
    if projected.stride(-1) != 1 or (B > 1 and projected.stride(0) != projected.stride(1) * T):
        projected = projected.contiguous()
    q = torch.empty((B, T, H, D), dtype=projected.dtype, device=projected.device)
    cos2, sin2 = cos2.reshape(B * T, D).contiguous(), sin2.reshape(B * T, D).contiguous()
    index = write_index.reshape(B * T).contiguous()
    jitted("rope_write", _rope_write_source)[(B * T, three * H)](
        projected, cos2, sin2, index, q, k_cache, v_cache,
        projected.stride(1), projected.stride(2), projected.stride(3),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        T, H, HEAD_DIM=D, BLOCK_D=next_power_of_2(D), num_warps=1,
    )  # fmt: skip
    return q


def _step_attention_source() -> Any:
    import triton.language as tl

    def step_attention_kernel(
        qkv_ptr,
        kv_ptr,
        out_ptr,
        stride_qb,
        stride_qp,
        stride_qh,
        stride_b,
        stride_p,
        stride_h,
        stride_s,
        heads,
        step,
        first,
        scale,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        bh = tl.program_id(0)
        b = bh // heads
        h = bh % heads
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        src = qkv_ptr + b * stride_qb + h * stride_qh + d
        q = tl.load(src, mask=d_ok, other=0.0).to(tl.float32) * scale
        k_new = tl.load(src + stride_qp, mask=d_ok, other=0.0)
        v_new = tl.load(src + 2 * stride_qp, mask=d_ok, other=0.0)
        cache = kv_ptr + b * stride_b + h * stride_h
        tl.store(cache + step * stride_s + d, k_new, mask=d_ok)
        tl.store(cache + stride_p + step * stride_s + d, v_new, mask=d_ok)
        # the earlier steps' entries from the cache, this step's from registers (no read of
        # what this program just stored)
        n = tl.arange(0, BLOCK_S)
        earlier = (n >= first) & (n < step)
        both = earlier[:, None] & d_ok[None, :]
        k = tl.load(cache + n[:, None] * stride_s + d[None, :], mask=both, other=0.0).to(tl.float32)
        v = tl.load(cache + stride_p + n[:, None] * stride_s + d[None, :], mask=both, other=0.0).to(
            tl.float32
        )
        is_new = (n == step)[:, None]
        k = tl.where(is_new, k_new.to(tl.float32)[None, :], k)
        v = tl.where(is_new, v_new.to(tl.float32)[None, :], v)
        scores = tl.sum(k * q[None, :], axis=1)
        scores = tl.where(earlier | (n == step), scores, float("-inf"))
        p = tl.exp(scores - tl.max(scores, axis=0))
        out = tl.sum(p[:, None] * v, axis=0) / tl.sum(p, axis=0)
        tl.store(out_ptr + (b * heads + h) * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)

    return step_attention_kernel


def step_attention(qkv: torch.Tensor, kv: torch.Tensor, step: int, first: int) -> torch.Tensor:
    """The depth transformer's attention at `step`: qkv [B, 3, H, D] (this step's query, key,
    value); kv [B, 2, H, S, D] this tick's keys and values, this step's written at entry `step`;
    the query attends entries first..step. Returns [B, H, D]."""
    B, _, H, D = qkv.shape
    S = kv.shape[3]
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    out = torch.empty((B, H, D), dtype=qkv.dtype, device=qkv.device)
    jitted("step_attention", _step_attention_source)[(B * H,)](
        qkv, kv, out,
        qkv.stride(0), qkv.stride(1), qkv.stride(2),
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        H, step, first, 1.0 / math.sqrt(D),
        HEAD_DIM=D, BLOCK_D=next_power_of_2(D), BLOCK_S=next_power_of_2(S), num_warps=1,
    )  # fmt: skip
    return out
