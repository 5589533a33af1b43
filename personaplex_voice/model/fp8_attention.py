"""Decode attention straight from a float8 (e4m3) KV cache: a Triton kernel.

One query per slot and head (the 80 ms tick) against the whole ring of keys and values. The
generic path converts each layer's whole fp8 cache to bfloat16 before `scaled_dot_product_attention`:
read 1 byte, write 2, read 2 again, per element, more traffic than a bfloat16 cache (2 bytes).
This kernel reads each fp8 element once and converts it in registers, so an fp8 cache costs half
of bfloat16's traffic, as its bytes promise.

One program per (slot, head) walks the ring in blocks of `BLOCK_N` entries with an online softmax
(running maximum and sum in float32); masked entries (the ring mask) are skipped; a row with
every entry masked gives zeros. Numerics: float32 accumulation of the fp8 values, the result
rounded to the query's dtype; it agrees with the converting path within bfloat16 rounding.

Guarded: `available(device)` says whether Triton can run here (a CUDA device and the package);
the engine also runs `self_check` once before it uses the kernel, and keeps the converting path
if the kernel fails or disagrees. `TRITON_INTERPRET=1` runs the same kernel on the CPU (tests).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

BLOCK_N = 64
NUM_WARPS = 4
# |kernel - converting path| / max |converting path| above this refuses the kernel.
SELF_CHECK_TOLERANCE = 2e-2

_kernels: dict[bool, Any] = {}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available(device: torch.device) -> bool:
    """Triton is importable and can run on `device` (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    if device.type != "cuda" and not interpreting():
        return False
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def _kernel() -> Any:
    """The jitted kernel (built at first use: importing this module never imports Triton)."""
    mode = interpreting()  # the interpreter is chosen when the function is jitted
    if mode not in _kernels:
        import triton
        import triton.language as tl

        def decode(
            q_ptr,
            k_ptr,
            v_ptr,
            mask_ptr,
            out_ptr,
            stride_qb,
            stride_qh,
            stride_kb,
            stride_kh,
            stride_kn,
            stride_vb,
            stride_vh,
            stride_vn,
            stride_mb,
            stride_mn,
            stride_ob,
            stride_oh,
            heads,
            scale,
            ENTRIES: tl.constexpr,
            HEAD_DIM: tl.constexpr,
            BLOCK_D: tl.constexpr,
            BLOCK: tl.constexpr,
        ):
            pid = tl.program_id(0)
            b = pid // heads
            h = pid % heads
            d = tl.arange(0, BLOCK_D)
            d_ok = d < HEAD_DIM
            q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
            q = q * scale
            run_max = float("-inf")
            run_sum = 0.0
            acc = tl.zeros([BLOCK_D], dtype=tl.float32)
            for start in range(0, ENTRIES, BLOCK):
                n = start + tl.arange(0, BLOCK)
                n_ok = n < ENTRIES
                allowed = tl.load(mask_ptr + b * stride_mb + n * stride_mn, mask=n_ok, other=0) != 0
                both = n_ok[:, None] & d_ok[None, :]
                k_rows = k_ptr + b * stride_kb + h * stride_kh + n[:, None] * stride_kn + d[None, :]
                k = tl.load(k_rows, mask=both, other=0.0).to(tl.float32)
                scores = tl.sum(k * q[None, :], axis=1)
                scores = tl.where(allowed, scores, float("-inf"))
                new_max = tl.maximum(run_max, tl.max(scores, axis=0))
                # every entry masked so far: keep the exponent finite (all terms are 0 anyway)
                shift = tl.where(new_max == float("-inf"), 0.0, new_max)
                decay = tl.exp(run_max - shift)
                p = tl.exp(scores - shift)
                run_sum = run_sum * decay + tl.sum(p, axis=0)
                v_rows = v_ptr + b * stride_vb + h * stride_vh + n[:, None] * stride_vn + d[None, :]
                v = tl.load(v_rows, mask=both, other=0.0).to(tl.float32)
                acc = acc * decay + tl.sum(p[:, None] * v, axis=0)
                run_max = new_max
            out = acc / tl.where(run_sum > 0, run_sum, 1.0)
            tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)

        _kernels[mode] = triton.jit(decode)
    return _kernels[mode]


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """softmax(q k^T / sqrt(D), masked) v for one query per slot and head.

    q [B, H, 1, D] (bfloat16 / float16 / float32); k_cache, v_cache [B, H, N, D] float8_e4m3fn,
    last dimension contiguous; mask bool [B, 1, 1, N] (True = attend). Returns [B, H, 1, D] in
    q's dtype.
    """
    B, H, T, D = q.shape
    if T != 1:
        raise ValueError("decode attention takes one query per slot")
    N = k_cache.shape[2]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head dimension must be contiguous")
    flags = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    out = torch.empty((B, H, 1, D), dtype=q.dtype, device=q.device)
    _kernel()[(B * H,)](
        q, k_cache, v_cache, flags, out,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        flags.stride(0), flags.stride(3),
        out.stride(0), out.stride(1),
        H, 1.0 / math.sqrt(D),
        ENTRIES=N, HEAD_DIM=D, BLOCK_D=triton_next_power_of_2(D), BLOCK=BLOCK_N,
        num_warps=NUM_WARPS,
    )  # fmt: skip
    return out


def triton_next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def converting_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """What the generic path computes: the cache read back in q's dtype, then SDPA."""
    from torch.nn import functional as F

    return F.scaled_dot_product_attention(q, k_cache.to(q.dtype), v_cache.to(q.dtype), mask)


def self_check(
    batch: int, heads: int, entries: int, head_dim: int, device: torch.device, dtype: torch.dtype
) -> float:
    """Run the kernel on random data of the engine's shape; returns its relative error against
    the converting path (raises whatever the kernel raises)."""
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device)

    q = rand(batch, heads, 1, head_dim).to(dtype)
    k = (rand(batch, heads, entries, head_dim) * 2).to(torch.float8_e4m3fn)
    v = (rand(batch, heads, entries, head_dim) * 2).to(torch.float8_e4m3fn)
    mask = torch.rand(batch, 1, 1, entries, generator=gen).to(device) < 0.9
    mask[..., 0] = True  # no row entirely masked: SDPA would give NaN there
    got = decode_attention(q, k, v, mask).float()
    want = converting_reference(q, k, v, mask).float()
    scale = float(want.abs().max()) or 1.0
    return float((got - want).abs().max()) / scale
