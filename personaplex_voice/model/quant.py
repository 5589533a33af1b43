"""Weight-only int8 for the LM's linear layers, and the one `linear` every layer calls.

`Int8Weight` replaces a weight matrix [out, in] by int8 rows and one scale per row (symmetric,
absmax / 127): W ≈ scale[:, None] * q. It takes 1 byte per weight plus 2-4 bytes per row, about
half of bfloat16. Embeddings, norms and Mimi stay as they are.

The matmul, chosen by measurement (docs/engine.md, "int8 weights"):
- CPU: `torch._weight_int8pack_mm` (torch's own int8 weight-only kernel; with bfloat16
  activations twice as fast as the bfloat16 matmul at batch 1), for inner widths that are
  multiples of 32; torchao's int8 weight-only layout runs no faster than dequantising here, so
  it is not a dependency.
- CUDA: `torch._int_mm` (cuBLAS int8 x int8 -> int32), fed int8 activations quantized per row
  (absmax / 127, dynamic) and scaled back by both scales: the weights are read as int8, once,
  with no bfloat16 copy (dequantising first reads 1 byte, writes 2 and reads 2 per weight, about
  five times the traffic). It is checked once per device against the dequantising product and
  used where the shapes allow it (inner and outer widths multiples of 8; fewer than 17 rows are
  padded to 17); elsewhere the rows are cast to the activation dtype and multiplied by cuBLAS,
  the scale applied to the output (y = (x @ q^T) * scale, exact algebra). The per-row activation
  rounding is a second rounding the dequantising path does not have; `bench/gpu_check.py`
  measures both (`int8_kernels`) and the token agreement with bfloat16.

A module keeps an `Int8Weight` where it had its `weight` (or `in_proj_weight`) parameter, so
checkpoint names and module paths do not change; every call site goes through `linear(x, w)`,
which is `F.linear` for a plain tensor (the float path is untouched, bit for bit).
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.nn import functional as F

log = logging.getLogger(__name__)

QUANTIZE_MODES = ("none", "int8")
_QMAX = 127.0
# torch's CPU int8 kernel reads the inner dimension in blocks of 32 (other widths crash it:
# measured with torch 2.13); such layers (tiny models only, the 7B's are multiples) dequantise.
INT8PACK_K_MULTIPLE = 32
SCALE_DTYPE = torch.bfloat16
# `torch._int_mm` on CUDA: both widths multiples of 8, more than 16 rows.
INT_MM_MULTIPLE = 8
INT_MM_MIN_ROWS = 17
# Relative error against the dequantising product above which `_int_mm` is not used.
INT_MM_TOLERANCE = 0.05
# Per device: whether `_int_mm` runs and agrees there (checked at first use).
_int_mm_ok: dict[str, bool] = {}
_int_mm_why: dict[str, str] = {}
# "auto": `_int_mm` on CUDA where it checks out; "dequant": never (`set_int8_matmul`).
INT8_MATMUL_MODES = ("auto", "dequant")


class Int8Weight(nn.Module):
    """A [out, in] weight as int8 rows `q` and a bfloat16 `scale` per row."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)
        self.fused = True  # may use `torch._int_mm` on CUDA (False: always dequantise)

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Weight:
        """Round `weight` [out, in] (any float dtype, any device) to int8 rows. The scales are
        kept in bfloat16 (2 bytes a row, whatever the activations' dtype; the rows are rounded
        against the stored scale, so it is exact for them)."""
        w = weight.detach().float()
        absmax = w.abs().amax(dim=1)
        scale = torch.where(absmax > 0, absmax / _QMAX, torch.ones_like(absmax)).to(SCALE_DTYPE)
        q = torch.round(w / scale.float()[:, None]).clamp_(-_QMAX, _QMAX).to(torch.int8)
        return cls(q, scale)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()

    def rows(self, index: int, rows_per_block: int) -> Int8Weight:
        """Block `index` of `rows_per_block` rows (the depth transformer's per-step weights): views."""
        start = index * rows_per_block
        block = Int8Weight(self.q[start : start + rows_per_block], self.scale[start : start + rows_per_block])
        block.fused = self.fused
        return block

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if x.device.type == "cpu" and x.shape[-1] % INT8PACK_K_MULTIPLE == 0:
            scale = self.scale if self.scale.dtype == x.dtype else self.scale.to(x.dtype)
            y = torch._weight_int8pack_mm(x2.contiguous(), self.q, scale)
        elif x.device.type == "cuda" and self._int_mm_fits() and int_mm_usable(x.device):
            y = int_mm_linear(x2, self.q, self.scale)
        else:
            y = dequant_linear(x2, self.q, self.scale)
        return y.view(*lead, self.q.shape[0])

    def _int_mm_fits(self) -> bool:
        out, inner = self.q.shape
        return self.fused and out % INT_MM_MULTIPLE == 0 and inner % INT_MM_MULTIPLE == 0


def dequant_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (q [N, K] as x's dtype)^T, times the row scales: a bfloat16 copy of the weight."""
    return F.linear(x, q.to(x.dtype)) * scale.to(x.dtype)


def int_mm_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ q^T with int8 activations (one scale per row) through `torch._int_mm`; the
    int32 result is scaled back by both scales. Fewer than 17 rows are padded with zeros."""
    rows = x.shape[0]
    if rows < INT_MM_MIN_ROWS:
        x = torch.cat([x, x.new_zeros(INT_MM_MIN_ROWS - rows, x.shape[1])])
    xf = x.float()
    x_scale = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / _QMAX
    xq = torch.round(xf / x_scale).clamp_(-_QMAX, _QMAX).to(torch.int8)
    y = torch._int_mm(xq, q.t())  # [M, N] int32; q.t() is the column-major operand cuBLAS wants
    out = y.float() * x_scale * scale.float()[None, :]
    return out[:rows].to(x.dtype)


def int_mm_usable(device: torch.device) -> bool:
    """`torch._int_mm` runs on `device` and agrees with the dequantising product (checked once;
    why not: `int_mm_failure`)."""
    key = str(device)
    if key not in _int_mm_ok:
        try:
            gen = torch.Generator(device="cpu").manual_seed(0)
            w = torch.randn(64, 128, generator=gen)
            weight = Int8Weight.quantize(w.to(device))
            x = torch.randn(32, 128, generator=gen).to(device, torch.bfloat16)
            got = int_mm_linear(x, weight.q, weight.scale).float()
            want = dequant_linear(x, weight.q, weight.scale).float()
            error = float((got - want).abs().max() / want.abs().max())
            _int_mm_ok[key] = error < INT_MM_TOLERANCE
            if not _int_mm_ok[key]:
                _int_mm_why[key] = f"torch._int_mm is off by {error:.3g} of the dequantising product"
        except Exception as exc:
            _int_mm_ok[key] = False
            _int_mm_why[key] = " ".join(f"torch._int_mm failed: {type(exc).__name__}: {exc}".split())[:300]
        if not _int_mm_ok[key]:
            log.warning("int8 weights on %s: %s; dequantising instead", key, _int_mm_why[key])
    return _int_mm_ok[key]


def int_mm_failure(device: torch.device) -> str | None:
    """Why `torch._int_mm` is not used on `device` (None: it is, or it was not checked yet)."""
    return _int_mm_why.get(str(device))


Weight = torch.Tensor | Int8Weight


def linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """`F.linear(x, weight)` (no bias) for a float weight or an `Int8Weight`."""
    if isinstance(weight, Int8Weight):
        return weight.matmul(x)
    return F.linear(x, weight)


def weight_rows(weight: Weight, index: int, rows_per_block: int) -> Weight:
    """Rows [index * rows_per_block, (index + 1) * rows_per_block) of a weight, as a view."""
    if isinstance(weight, Int8Weight):
        return weight.rows(index, rows_per_block)
    return weight.view(-1, rows_per_block, weight.shape[-1])[index]


def pack_rows(modules: nn.ModuleList, attr: str) -> Weight:
    """The `attr` weights of `modules` ([rows, in] each, same shape) stacked by rows into one
    weight, and each module's weight rebound as a row view of it: one matmul can then do the work
    of all of them, and no second copy is kept. A single module's weight is returned as it is."""
    weights = [getattr(m, attr) for m in modules]
    if len(weights) == 1:
        return weights[0]
    rows = weights[0].shape[0]
    if all(isinstance(w, Int8Weight) for w in weights):
        packed = Int8Weight(torch.cat([w.q for w in weights]), torch.cat([w.scale for w in weights]))
        packed.fused = weights[0].fused
        for i, module in enumerate(modules):
            setattr(module, attr, packed.rows(i, rows))
        return packed
    if any(isinstance(w, Int8Weight) for w in weights):
        raise ValueError("cannot pack int8 and float weights together")
    stacked = torch.cat([w.detach() for w in weights])
    for i, module in enumerate(modules):
        module._parameters[attr] = nn.Parameter(stacked[i * rows : (i + 1) * rows], requires_grad=False)
    return stacked


def storage_key(weight: Weight) -> tuple[int, torch.dtype, torch.device]:
    """Identifies a weight's storage (to rebuild views when weights are replaced or moved)."""
    t = weight.q if isinstance(weight, Int8Weight) else weight
    return t.data_ptr(), t.dtype, t.device


def quantizable_weights(model: nn.Module) -> list[str]:
    """State-dict names of the weights `--quantize int8` turns into int8: every linear layer's
    `weight` and the attention input projections (`in_proj_weight`), not embeddings or norms."""
    names = []
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        if isinstance(module, nn.Linear):
            names.append(f"{dot}weight")
        elif isinstance(getattr(module, "in_proj_weight", None), (nn.Parameter, Int8Weight)):
            names.append(f"{dot}in_proj_weight")
    return names


def set_weight(model: nn.Module, name: str, value: torch.Tensor | Int8Weight) -> None:
    """Put `value` where the parameter or buffer `name` (a state-dict name) is."""
    path, _, attr = name.rpartition(".")
    module = model.get_submodule(path) if path else model
    if isinstance(value, Int8Weight):
        module._parameters.pop(attr, None)  # the module now holds the int8 form under that name
        setattr(module, attr, value)
    elif attr in module._parameters:
        module._parameters[attr] = nn.Parameter(value, requires_grad=False)
    elif attr in module._buffers:
        module._buffers[attr] = value
    else:
        raise KeyError(name)


def quantize_model_(model: nn.Module) -> None:
    """Replace every quantizable weight of `model` (already loaded) by its `Int8Weight`."""
    for name in quantizable_weights(model):
        weight = model.get_parameter(name)
        set_weight(model, name, Int8Weight.quantize(weight))
        del weight


def set_int8_matmul(model: nn.Module, mode: str) -> None:
    """ "auto" (fused `_int_mm` on CUDA where it checks out) or "dequant" for every int8 weight."""
    if mode not in INT8_MATMUL_MODES:
        raise ValueError(f"int8 matmul must be one of {', '.join(INT8_MATMUL_MODES)}, got {mode!r}")
    for module in model.modules():
        if isinstance(module, Int8Weight):
            module.fused = mode == "auto"
        if hasattr(module, "_weights_key"):  # per-step row views (the depth transformer): rebuild
            module._weights_key = None
        if hasattr(module, "_input_key"):  # packed input projections (the depth transformer's)
            module._input_key = None


def linear_weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes the quantizable weights take now, bytes they would take in bfloat16)."""
    now = bf16 = 0
    for name in quantizable_weights(model):
        path, _, attr = name.rpartition(".")
        value = getattr(model.get_submodule(path) if path else model, attr)
        if isinstance(value, Int8Weight):
            now += value.nbytes
            bf16 += value.q.numel() * 2
        else:
            now += value.numel() * value.element_size()
            bf16 += value.numel() * 2
    return now, bf16
