"""The fused kernels as torch custom operators, their references, and which ones a model uses.

Each fused operation (`FUSED_OPS`) has
- a reference: the published arithmetic in plain tensor operations (what runs on the CPU, and
  everywhere a kernel is not checked out);
- a Triton kernel (`model/triton_kernels.py`, `model/ring_attention.py`), registered as a torch
  custom operator (`torch.ops.personaplex.*`) with a shape-only ("fake") implementation, so it
  is one operation to the dispatcher (and to `engine/tick_ops.py`'s count), runs on the `meta`
  device, and is captured in a CUDA graph like any other kernel.

A module holds flags saying which of its operations use the kernel (`FUSED_FLAGS`: the norms'
and `ActivationGating`'s `fused`, `StreamingAttention.fused_rope` / `.ring_kernel`,
`Depformer.fused_attention`); they are all off until `set_fused_ops` turns them on, which
`engine/gpu_tuning.py` does on a GPU for the operations whose check (`model/fused_checks.py`)
passed (and `engine/tick_ops.py` does on `meta` to count the GPU's tick). `clear_fused_ops`
puts a model back to the references (every engine starts from there: models shared between
engines never carry one engine's choices into another).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from personaplex_voice.model import ring_attention, triton_kernels

# norm: the residual sum (and layer scale) with the RMSNorm / LayerNorm after it; silu_mul: the
# gated FFN's activation; rope_write: q and k rotated, k and v written to the ring KV cache;
# ring_attention: the tick's length-aware decode attention; step_attention: the depth
# transformer's attention of one step, its key and value appended.
FUSED_OPS = ("norm", "silu_mul", "rope_write", "ring_attention", "step_attention")


@torch.library.custom_op("personaplex::norm", mutates_args=())
def norm_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, layer_norm: bool
) -> torch.Tensor:
    return triton_kernels.add_norm(x, None, None, weight, bias, eps, layer_norm)[1]


@norm_op.register_fake
def _(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, layer_norm: bool
) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("personaplex::add_norm", mutates_args=())
def add_norm_op(
    x: torch.Tensor,
    update: torch.Tensor,
    scale: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    layer_norm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return triton_kernels.add_norm(x, update, scale, weight, bias, eps, layer_norm)


@add_norm_op.register_fake
def _(
    x: torch.Tensor,
    update: torch.Tensor,
    scale: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    layer_norm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    layout = torch.contiguous_format
    return torch.empty_like(x, memory_format=layout), torch.empty_like(x, memory_format=layout)


@torch.library.custom_op("personaplex::silu_mul", mutates_args=())
def silu_mul_op(g: torch.Tensor) -> torch.Tensor:
    return triton_kernels.silu_mul(g)


@silu_mul_op.register_fake
def _(g: torch.Tensor) -> torch.Tensor:
    return g.new_empty(*g.shape[:-1], g.shape[-1] // 2)


@torch.library.custom_op("personaplex::rope_write", mutates_args=("k_cache", "v_cache"))
def rope_write_op(
    projected: torch.Tensor,
    cos2: torch.Tensor,
    sin2: torch.Tensor,
    write_index: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    return triton_kernels.rope_write(projected, cos2, sin2, write_index, k_cache, v_cache)


@rope_write_op.register_fake
def _(
    projected: torch.Tensor,
    cos2: torch.Tensor,
    sin2: torch.Tensor,
    write_index: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    B, T, _, H, D = projected.shape
    return projected.new_empty(B, T, H, D)


@torch.library.custom_op("personaplex::ring_attention", mutates_args=())
def ring_attention_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    return ring_attention.decode_attention(q, k_cache, v_cache, mask, lengths)


@ring_attention_op.register_fake
def _(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1], 1, q.shape[3])


@torch.library.custom_op("personaplex::step_attention", mutates_args=("kv",))
def step_attention_op(qkv: torch.Tensor, kv: torch.Tensor, step: int, first: int) -> torch.Tensor:
    return triton_kernels.step_attention(qkv, kv, step, first)


@step_attention_op.register_fake
def _(qkv: torch.Tensor, kv: torch.Tensor, step: int, first: int) -> torch.Tensor:
    return qkv.new_empty(qkv.shape[0], qkv.shape[2], qkv.shape[3])


# ---------------------------------------------------------------------------------------------
# which modules use them


def _flag_names(module: nn.Module) -> dict[str, str]:
    """{fused op name: the module attribute that turns it on} for the modules that can fuse."""
    return getattr(module, "FUSED_FLAGS", {})


def set_fused_ops(model: nn.Module, ops: Iterable[str]) -> None:
    """Use the kernels of `ops` (names from FUSED_OPS) in every module of `model` that can."""
    wanted = set(ops)
    unknown = wanted - set(FUSED_OPS)
    if unknown:
        raise ValueError(f"unknown fused ops {sorted(unknown)} (known: {', '.join(FUSED_OPS)})")
    for module in model.modules():
        for op, attr in _flag_names(module).items():
            setattr(module, attr, op in wanted)


def clear_fused_ops(model: nn.Module) -> None:
    set_fused_ops(model, ())


def fused_ops_in_use(model: nn.Module) -> list[str]:
    """The fused ops some module of `model` uses now (what a report says ran)."""
    used = set()
    for module in model.modules():
        for op, attr in _flag_names(module).items():
            if getattr(module, attr, False):
                used.add(op)
    return [op for op in FUSED_OPS if op in used]
