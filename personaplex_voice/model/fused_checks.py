"""Each fused kernel against its reference, on random data of the engine's shapes.

`engine/gpu_tuning.py` runs `self_check` once per kernel before the engine uses it on a GPU
(a kernel that fails or disagrees is not used: a `fallbacks` entry says why); the tests run the
same checks with Triton's CPU interpreter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from personaplex_voice.model import ring_attention
from personaplex_voice.model.fused_ops import (
    add_norm_op,
    norm_op,
    rope_write_op,
    silu_mul_op,
    step_attention_op,
)
from personaplex_voice.model.rope import rope_tables, rotate
from personaplex_voice.model.transformer import rms_norm_reference

# A fused op whose output is further than this from its reference (relative to the output's
# scale) on random data is not used (bfloat16 rounding alone gives a few 1e-3).
SELF_CHECK_TOLERANCE = 2e-2


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    scale = float(want.abs().max()) or 1.0
    error = (got - want).abs().max()
    return float("inf") if not torch.isfinite(error) else float(error) / scale


def self_check(op: str, device: torch.device, dtype: torch.dtype, shape: dict[str, Any]) -> float:
    """Relative error of `op`'s kernel against its reference on random data (raises whatever
    the kernel raises). `shape`: "dim" (norm), "hidden" (silu_mul), "heads" and "head_dim"
    (rope_write, ring_attention), "entries" and "kv_dtype" (ring_attention), "steps",
    "step_heads" and "step_head_dim" (step_attention)."""
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to(device, dtype)

    if op == "norm":
        C = shape["dim"]
        x, u, scale, w, b = rand(5, 2, C), rand(5, 2, C), rand(C) * 0.1, rand(C), rand(C)
        errors = [_relative_error(norm_op(x, w, None, 1e-5, False), rms_norm_reference(x, w, 1e-5, True))]
        h, y = add_norm_op(x, u, None, w, None, 1e-5, False)
        errors += [_relative_error(h, x + u), _relative_error(y, rms_norm_reference(x + u, w, 1e-5, True))]
        h, y = add_norm_op(x, u, scale, w, b, 1e-5, True)
        want = x + scale * u
        errors += [_relative_error(h, want), _relative_error(y, F.layer_norm(want, (C,), w, b, 1e-5))]
        return max(errors)
    if op == "silu_mul":
        g = rand(7, 2 * shape["hidden"])
        half = shape["hidden"]
        return _relative_error(silu_mul_op(g), F.silu(g[:, :half]) * g[:, half:])
    if op == "rope_write":
        B, T, H, D, N = 3, 2, shape["heads"], shape["head_dim"], 9
        projected = rand(B, T, 3, H, D)
        positions = torch.arange(B * T, device=device).view(B, T) * 37
        tables = rope_tables(positions, D, 10000.0)
        index = torch.tensor([[1, 2], [5, 6], [8, 0]], device=device)
        caches = [torch.zeros(B, H, N, D, device=device, dtype=dtype) for _ in range(4)]
        q = rope_write_op(projected, tables.cos2, tables.sin2, index, caches[0], caches[1])
        qk = rotate(projected[:, :, :2], tables)
        expand = index[:, None, :, None].expand(B, H, T, D)
        caches[2].scatter_(2, expand, qk[:, :, 1].transpose(1, 2))
        caches[3].scatter_(2, expand, projected[:, :, 2].transpose(1, 2))
        return max(
            _relative_error(q, qk[:, :, 0]),
            _relative_error(caches[0], caches[2]),
            _relative_error(caches[1], caches[3]),
        )
    if op == "ring_attention":
        return ring_attention.self_check(
            4, shape["heads"], shape["entries"], shape["head_dim"], device, dtype, shape["kv_dtype"]
        )
    if op == "step_attention":
        B, S, H, D = 3, shape["steps"], shape["step_heads"], shape["step_head_dim"]
        kv, reference = rand(B, 2, H, S, D), None
        errors = []
        for step in range(S):
            qkv = rand(B, 3, H, D)
            first = max(0, step + 2 - S)
            out = step_attention_op(qkv, kv, step, first)
            reference = kv.clone() if reference is None else reference
            reference[:, :, :, step] = qkv[:, 1:]
            mask = torch.zeros(1, S, dtype=torch.bool, device=device)
            mask[:, first : step + 1] = True
            want = F.scaled_dot_product_attention(qkv[:, 0, :, None], reference[:, 0], reference[:, 1], mask)
            errors += [_relative_error(out, want[:, :, 0]), _relative_error(kv, reference)]
        return max(errors)
    raise ValueError(f"unknown fused op {op!r}")
