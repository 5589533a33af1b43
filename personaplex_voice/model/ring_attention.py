"""Decode attention over a ring KV cache that reads only the filled entries of active slots.

The tick's attention is one query per slot and head against that slot's ring of `N` entries
(3000 for the 7B). A slot's filled entries are always a prefix of its ring (entries fill from 0;
see `transformer.StreamingTransformer.plan`), so a slot `length` positions in reads entries
[0, length) and nothing else; an idle slot (length 0) reads nothing. With static shapes (a CUDA
graph), that is done by the kernel, not by slicing:

flash-decoding's split-K over the ring: the grid is (slot x head, split), each split a fixed run
of `SPLIT` entries. A program whose split starts at or past its slot's length stores an empty
partial and reads no KV; the others walk their entries in blocks of `BLOCK` with an online
softmax (running maximum and sum in float32) and store (max, sum, weighted values). A second,
small kernel combines the splits of each (slot, head). The grid, the splits and the workspace
have fixed sizes: the whole thing replays inside a CUDA graph; only the per-slot `lengths`
tensor (computed inside the tick) decides what is read.

The ring mask (the published ring's masked oldest entry, pinned prompt entries) is still honoured
inside the filled prefix (`mask`, one byte per entry). Keys and values may be in the compute
dtype (bfloat16, float16, float32) or float8_e4m3fn, converted in registers: an fp8 cache costs
half of bfloat16's bytes, not a converted copy.

Numerics: float32 accumulation, the result rounded to the query's dtype. In float32 it agrees
with `scaled_dot_product_attention` over the whole ring to ~1e-6 of the output's scale (a
different summation order); `self_check` measures it on the engine's shape before use.
`TRITON_INTERPRET=1` runs the same kernels on CPU tensors (tests).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.nn import functional as F

from personaplex_voice.model.triton_kernels import jitted, next_power_of_2

BLOCK = 64  # entries per inner step
SPLIT = 256  # entries per split (a multiple of BLOCK)
NUM_WARPS = 4
# |kernel - reference| / max |reference| above this refuses the kernel (bfloat16 inputs: a few
# 1e-3; float32: ~1e-6).
SELF_CHECK_TOLERANCE = 2e-2


def _split_source() -> Any:
    import triton.language as tl

    def ring_split_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        mask_ptr,
        len_ptr,
        part_ptr,
        stride_qb,
        stride_qh,
        stride_kb,
        stride_kh,
        stride_kn,
        stride_vb,
        stride_vh,
        stride_vn,
        stride_mb,
        heads,
        splits,
        scale,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLIT_N: tl.constexpr,
    ):
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = bh // heads
        h = bh % heads
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        length = tl.load(len_ptr + b).to(tl.int32)
        start = split * SPLIT_N
        end = tl.minimum(start + SPLIT_N, length)
        q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
        q = q * scale
        run_max = float("-inf")
        run_sum = 0.0
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        # past the slot's length (idle slots: length 0) the loop is empty: nothing is read
        for first in range(start, end, BLOCK_N):
            n = first + tl.arange(0, BLOCK_N)
            n_ok = n < end
            allowed = tl.load(mask_ptr + b * stride_mb + n, mask=n_ok, other=0) != 0
            both = n_ok[:, None] & d_ok[None, :]
            k_rows = k_ptr + b * stride_kb + h * stride_kh + n[:, None] * stride_kn + d[None, :]
            k = tl.load(k_rows, mask=both, other=0.0).to(tl.float32)
            scores = tl.sum(k * q[None, :], axis=1)
            scores = tl.where(allowed & n_ok, scores, float("-inf"))
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
        # partials [B * H, splits, BLOCK_D + 2]: the weighted values, then (max, sum)
        base = part_ptr + (bh * splits + split) * (BLOCK_D + 2)
        tl.store(base + d, acc)
        tl.store(base + BLOCK_D, run_max)
        tl.store(base + BLOCK_D + 1, run_sum)

    return ring_split_kernel


def _combine_source() -> Any:
    import triton.language as tl

    def ring_combine_kernel(
        part_ptr,
        out_ptr,
        stride_ob,
        stride_oh,
        heads,
        splits,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        bh = tl.program_id(0)
        b = bh // heads
        h = bh % heads
        d = tl.arange(0, BLOCK_D)
        s = tl.arange(0, BLOCK_S)
        s_ok = s < splits
        rows = part_ptr + (bh * splits + s) * (BLOCK_D + 2)
        maxes = tl.load(rows + BLOCK_D, mask=s_ok, other=float("-inf"))
        sums = tl.load(rows + BLOCK_D + 1, mask=s_ok, other=0.0)
        top = tl.max(maxes, axis=0)
        shift = tl.where(top == float("-inf"), 0.0, top)
        weight = tl.where(s_ok, tl.exp(maxes - shift), 0.0)
        total = tl.sum(sums * weight, axis=0)
        acc = tl.load(rows[:, None] + d[None, :], mask=s_ok[:, None], other=0.0)
        out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(
            out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM
        )

    return ring_combine_kernel


def splits_for(entries: int) -> int:
    return -(-entries // SPLIT)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    mask: torch.Tensor,
    lengths: torch.Tensor,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(D), masked) v for one query per slot and head, reading only the
    first `lengths[b]` ring entries of slot b.

    q [B, H, 1, D]; k_cache, v_cache [B, H, N, D] (head dim contiguous; compute dtype or
    float8_e4m3fn); mask bool [B, 1, 1, N] (True = attend); lengths [B] integer (0 = read
    nothing: the output row is zeros). Returns [B, H, 1, D] in q's dtype.
    """
    B, H, T, D = q.shape
    if T != 1:
        raise ValueError("decode attention takes one query per slot")
    N = k_cache.shape[2]
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head dimension must be contiguous")
    if q.stride(-1) != 1:
        q = q.contiguous()
    flags = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    if flags.stride(-1) != 1:
        flags = flags.contiguous()
    lengths = lengths.to(torch.int32)
    splits = splits_for(N)
    block_d = next_power_of_2(D)
    partials = torch.empty((B * H, splits, block_d + 2), dtype=torch.float32, device=q.device)
    out = torch.empty((B, H, 1, D), dtype=q.dtype, device=q.device)
    jitted("ring_split", _split_source)[(B * H, splits)](
        q, k_cache, v_cache, flags, lengths, partials,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        flags.stride(0), H, splits, 1.0 / math.sqrt(D),
        HEAD_DIM=D, BLOCK_D=block_d, BLOCK_N=BLOCK, SPLIT_N=SPLIT, num_warps=NUM_WARPS,
    )  # fmt: skip
    jitted("ring_combine", _combine_source)[(B * H,)](
        partials, out, out.stride(0), out.stride(1), H, splits,
        HEAD_DIM=D, BLOCK_D=block_d, BLOCK_S=next_power_of_2(splits), num_warps=1,
    )  # fmt: skip
    return out


def full_ring_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    mask: torch.Tensor,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """What the static path computed before: SDPA over the whole ring (an fp8 cache read back
    in q's dtype), whatever its fill. Rows of slots with length 0 are zeroed, as the kernel
    gives them."""
    out = F.scaled_dot_product_attention(q, k_cache.to(q.dtype), v_cache.to(q.dtype), mask)
    if lengths is not None:
        out = torch.where((lengths > 0).view(-1, 1, 1, 1), out, torch.zeros_like(out))
    return out


def self_check(
    batch: int, heads: int, entries: int, head_dim: int, device: torch.device, dtype: torch.dtype,
    kv_dtype: torch.dtype,
) -> float:  # fmt: skip
    """Run the kernel on random data of the engine's shape, slots at different fills (one idle),
    against the full-ring reference; returns the relative error (raises what the kernel raises)."""
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device)

    q = rand(batch, heads, 1, head_dim).to(dtype)
    k = (rand(batch, heads, entries, head_dim) * 2).to(kv_dtype)
    v = (rand(batch, heads, entries, head_dim) * 2).to(kv_dtype)
    lengths = torch.tensor([(entries * (i + 1)) // batch for i in range(batch)], device=device)
    lengths[0] = 0  # an idle slot
    filled = torch.arange(entries, device=device)[None, :] < lengths[:, None]
    mask = (torch.rand(batch, entries, generator=gen).to(device) < 0.9) & filled
    mask[:, 0] = filled[:, 0]  # no active row entirely masked: SDPA would give NaN there
    mask = mask.view(batch, 1, 1, entries)
    got = decode_attention(q, k, v, mask, lengths).float()
    # idle rows: SDPA over an all-masked row is NaN; the reference zeroes them
    safe = mask | (lengths == 0).view(-1, 1, 1, 1)
    want = full_ring_reference(q, k, v, safe, lengths).float()
    scale = float(want.abs().max()) or 1.0
    return float((got - want).abs().max()) / scale
