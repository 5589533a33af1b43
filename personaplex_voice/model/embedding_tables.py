"""Several embedding tables in one storage, each after a zero row: a lookup is two operations.

The published embedding maps id -1 (`zero_idx`) to a zero vector: clamp, look up, compare,
zero = four tensor operations per table, seventeen tables per step in the temporal transformer
and sixteen lookups in the depth transformer. Here the tables of one transformer share one
storage `[zero row, table 0, zero row, table 1, ...]`: table i's rows start at `offsets[i]`, the
row before it is zeros, so `F.embedding(ids + offsets[i], packed)` is the published lookup for
every id >= -1, and one lookup serves all the tables of a step at once (`lookup_all`). Ids
below -1 never reach the model (the published generator never feeds its "ungenerated" marker
to it; voices are checked on load).

The modules keep their `weight` parameters (checkpoint names unchanged), rebound as views of
the packed storage, so no second copy is kept; `stale` says when the weights were replaced (a
load into new tensors) and the tables must be packed again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F


def _keys(modules: Sequence[nn.Embedding]) -> tuple:
    return tuple((m.weight.data_ptr(), m.weight.dtype, m.weight.device) for m in modules)


class PackedEmbeddings:
    def __init__(self, modules: Sequence[nn.Embedding]):
        weights = [m.weight.detach() for m in modules]
        dim = weights[0].shape[1]
        total = sum(w.shape[0] + 1 for w in weights)
        packed = torch.zeros(total, dim, dtype=weights[0].dtype, device=weights[0].device)
        offsets = []
        start = 1
        for module, weight in zip(modules, weights, strict=True):
            rows = weight.shape[0]
            packed[start : start + rows] = weight
            module.weight = nn.Parameter(packed[start : start + rows], requires_grad=False)
            offsets.append(start)
            start += rows + 1
        self.modules = list(modules)
        self.packed = packed
        self.offsets = offsets
        # [1, tables, 1]: added to ids [B, tables, T] to look every table up at once
        self.offset_tensor = torch.tensor(offsets, device=packed.device).view(1, -1, 1)
        self._key = _keys(self.modules)

    def stale(self, modules: Sequence[nn.Embedding]) -> bool:
        return list(modules) != self.modules or _keys(modules) != self._key

    def lookup(self, ids: torch.Tensor, table: int) -> torch.Tensor:
        """ids [...] (>= -1) of table `table` -> [..., dim]."""
        return F.embedding(ids + self.offsets[table], self.packed)

    def lookup_all(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, tables, T] (>= -1), table i for row i -> [B, tables, T, dim]."""
        return F.embedding(ids + self.offset_tensor, self.packed)
