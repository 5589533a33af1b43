"""Per-slot streaming state, kept outside the modules.

Every streaming module owns a few state tensors whose first dimension is the batch slot (conv
buffers, KV caches, positions). They live in one flat `dict[str, Tensor]` (a `StreamState`)
keyed `"<module path>:<name>"`, created by `init_state(root, batch)`. Keeping state out of the
modules means one set of weights serves any number of independent states (the batched engine
state, a scratch batch-1 state to encode a voice prompt...), and a slot can be reset, copied or
restored with plain tensor copies of row `slot`: static shapes, CUDA-graph friendly.

A forward call gets a `StepContext`: the state and an optional `active` bool mask [B]. Rows of
inactive slots are computed (static shapes) but their state is never modified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

StreamState = dict[str, torch.Tensor]


@dataclass
class StepContext:
    state: StreamState
    active: torch.Tensor | None = None  # bool [B]; None = every slot active


class StreamingModule(nn.Module):
    """A module with per-slot streaming state. `skey` is set by `name_streaming_modules`."""

    skey: str = ""

    def init_own_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> StreamState:
        return {}

    def st(self, ctx: StepContext, name: str) -> torch.Tensor:
        return ctx.state[f"{self.skey}:{name}"]


def name_streaming_modules(root: nn.Module) -> None:
    """Give every streaming module under `root` its state key prefix (its module path)."""
    for name, module in root.named_modules():
        if isinstance(module, StreamingModule):
            module.skey = name or "root"


def init_state(root: nn.Module, batch: int, device: torch.device | str, dtype: torch.dtype) -> StreamState:
    """Fresh streaming state for `batch` slots of every streaming module under `root`."""
    state: StreamState = {}
    device = torch.device(device)
    for _, module in root.named_modules():
        if isinstance(module, StreamingModule):
            for key, value in module.init_own_state(batch, device, dtype).items():
                state[f"{module.skey}:{key}"] = value
    return state


def commit(buffer: torch.Tensor, new: torch.Tensor, active: torch.Tensor | None) -> None:
    """buffer <- new for active slots only (in place, static shapes; one operation)."""
    if active is None:
        buffer.copy_(new)
    else:
        mask = active.view(-1, *([1] * (buffer.dim() - 1)))
        torch.where(mask, new, buffer, out=buffer)


def reset_slot(state: StreamState, fresh: StreamState, slot: int) -> None:
    """Put slot `slot` of `state` back to its initial values (`fresh` is a batch-1 initial state)."""
    for key, value in state.items():
        value[slot].copy_(fresh[key][0])


def copy_slot(state: StreamState, slot: int) -> StreamState:
    """A detached copy of one slot's state (each tensor without its batch dimension)."""
    return {key: value[slot].clone() for key, value in state.items()}


def load_slot(state: StreamState, slot: int, saved: StreamState) -> None:
    for key, value in state.items():
        value[slot].copy_(saved[key])


def state_nbytes(state: StreamState) -> int:
    return sum(v.numel() * v.element_size() for v in state.values())
