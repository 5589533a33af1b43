"""The per-slot delayed token cache of the published generator (LMGen), batched.

Streams: 0 text, 1..8 agent codebooks, 9..16 user codebooks; stream k written at step t lands
at position t + delays[k] of a small ring of `max_delay + 3` positions. At step t the model reads
the column t - 1 and predicts column t; a token *given* for column t (a user code, or anything
during the system prompt) is forced instead of the sampled one. The output row of step t is read
`max_delay` steps behind. Every operation is batched over slots with an `active` mask (rows of
inactive slots are left untouched) and uses no data-dependent Python control flow.

A slot's very first step (offset 0) only writes tokens (the model does not run); it is always a
system-prompt step, so it is done by `first_step` outside the batched tick.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch


def _put(t: torch.Tensor, pos: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> None:
    """t[b, k, pos[b, k]] = values[b, k] where mask[b, k] (t: [B, K, C])."""
    idx = pos[..., None]
    current = t.gather(2, idx)[..., 0]
    t.scatter_(2, idx, torch.where(mask, values.to(t.dtype), current)[..., None])


def _take(t: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """t[b, k, pos[b]] -> [B, K]."""
    B, K, _ = t.shape
    return t.gather(2, pos.view(B, 1, 1).expand(B, K, 1))[..., 0]


@dataclass
class RingSlot:
    """One slot's token state (for snapshots and prompt plans)."""

    cache: torch.Tensor  # long [K, C]
    provided: torch.Tensor  # bool [K, C]
    offset: int


class TokenRing:
    def __init__(
        self, num_slots: int, delays: list[int], initial: list[int], dep_q: int, device: torch.device
    ):
        self.num_slots = num_slots
        self.K = len(delays)
        self.max_delay = max(delays)
        self.C = self.max_delay + 3
        self.dep_q = dep_q
        self.device = device
        self.delays = torch.tensor(delays, dtype=torch.long, device=device)
        self.initial = torch.tensor(initial, dtype=torch.long, device=device)
        self.cache = torch.zeros(num_slots, self.K, self.C, dtype=torch.long, device=device)
        self.provided = torch.zeros(num_slots, self.K, self.C, dtype=torch.bool, device=device)
        self.offset = torch.zeros(num_slots, dtype=torch.long, device=device)

    def reset(self, slot: int) -> None:
        self.cache[slot] = 0
        self.provided[slot] = False
        self.offset[slot] = 0

    def read(self, slot: int) -> RingSlot:
        return RingSlot(self.cache[slot].clone(), self.provided[slot].clone(), int(self.offset[slot]))

    def load(self, slot: int, value: RingSlot) -> None:
        self.cache[slot] = value.cache.to(self.device)
        self.provided[slot] = value.provided.to(self.device)
        self.offset[slot] = value.offset

    def subset(self, index: torch.Tensor) -> TokenRing:
        """A ring holding copies of the slots `index` (for a compacted tick)."""
        sub = copy.copy(self)
        sub.num_slots = int(index.shape[0])
        sub.cache = self.cache.index_select(0, index)
        sub.provided = self.provided.index_select(0, index)
        sub.offset = self.offset.index_select(0, index)
        return sub

    def view(self, slot: int) -> TokenRing:
        """Slot `slot` alone, as views of this ring (writes land here): its batch-1 prompt steps."""
        sub = copy.copy(self)
        sub.num_slots = 1
        sub.cache = self.cache[slot : slot + 1]
        sub.provided = self.provided[slot : slot + 1]
        sub.offset = self.offset[slot : slot + 1]
        return sub

    def store(self, index: torch.Tensor, sub: TokenRing) -> None:
        """Write a subset's slots back."""
        self.cache.index_copy_(0, index, sub.cache)
        self.provided.index_copy_(0, index, sub.provided)
        self.offset.index_copy_(0, index, sub.offset)

    def write_given(self, values: torch.Tensor, given: torch.Tensor, active: torch.Tensor | None) -> None:
        """Force `values` [B, K] (where `given` [B, K]) at this step's write positions."""
        if active is not None:
            given = given & active[:, None]
        off = self.offset[:, None]
        _put(self.cache, (off + self.delays) % self.C, values, given)
        _put(self.provided, (off + self.delays) % self.C, torch.ones_like(given), given)
        # Delayed streams have no real value for their first steps: the initial token is forced.
        early = off <= self.delays
        if active is not None:
            early = early & active[:, None]
        init = self.initial.expand_as(values)
        _put(self.cache, off.expand_as(values) % self.C, init, early)
        _put(self.provided, off.expand_as(values) % self.C, torch.ones_like(early), early)

    def first_step(self, slot: int) -> None:
        """Finish a slot's offset-0 step (its offset must be 0): column 0 = initial tokens, no
        model run."""
        self.cache[slot, :, 0] = self.initial
        self.offset[slot] = 1

    def model_io(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input column [B, K], target column [B, K], target provided [B, K])."""
        inp = _take(self.cache, (self.offset - 1) % self.C)
        target_pos = self.offset % self.C
        return inp, _take(self.cache, target_pos), _take(self.provided, target_pos)

    def commit(
        self,
        text: torch.Tensor,
        audio: torch.Tensor,
        provided: torch.Tensor,
        active: torch.Tensor | None,
    ) -> torch.Tensor:
        """Store sampled tokens where not forced, advance; returns the output row [B, dep_q + 1]."""
        B = self.num_slots
        act = torch.ones(B, dtype=torch.bool, device=self.device) if active is None else active
        n = self.dep_q + 1
        input_pos = ((self.offset - 1) % self.C).view(B, 1).expand(B, self.K)
        _put(self.provided, input_pos, torch.zeros_like(provided), act[:, None].expand(B, self.K))
        target_pos = (self.offset % self.C).view(B, 1).expand(B, n)
        sampled = torch.cat([text[:, None], audio], dim=1)
        _put(self.cache, target_pos, sampled, ~provided[:, :n] & act[:, None])
        out_pos = (self.offset[:, None] - self.max_delay + self.delays[:n]) % self.C
        out = self.cache[:, :n].gather(2, out_pos[..., None])[..., 0]
        self.offset += act.to(torch.long)
        return out
