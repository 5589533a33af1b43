"""Per-slot token sampling with static shapes.

Every slot has its own temperature / top-k / greedy settings (as tensors) and its own
`torch.Generator`. Sampling follows the published algorithm: softmax(logits / T), keep the top k,
then draw with the exponential race (argmax of p / Exp(1) noise); greedy = argmax of the logits.
Temperature 0 is greedy, as published.

The noise is drawn per slot before the step (`draw_noise`), outside the batched computation: a
slot draws exactly its own top-k values per stream from its own generator, so its draws depend
only on its seed and step count, never on its neighbours, and the batched math itself has no
data-dependent control flow (CUDA-graph friendly).
"""

from __future__ import annotations

import copy

import torch

from personaplex_voice.engine.base import Sampling


def _draw(
    logits: torch.Tensor,
    best: torch.Tensor,
    safe_t: torch.Tensor,
    keep: torch.Tensor,
    pick_best: torch.Tensor,
    noise: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """Top-`width` candidates, those outside a slot's top-k (`keep` [B, width]) zeroed, race."""
    probs = torch.softmax(logits / safe_t[:, None], dim=-1)
    values, index = probs.topk(width, dim=-1)
    values = torch.where(keep, values, torch.zeros_like(values))
    choice = (values / noise[:, :width]).argmax(dim=-1, keepdim=True)
    return torch.where(pick_best, best, index.gather(-1, choice)[:, 0])


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    topk: torch.Tensor,
    greedy: torch.Tensor,
    noise: torch.Tensor | None,
    width: int = 0,
) -> torch.Tensor:
    """logits [B, V] float32 -> tokens [B]. `noise` None means every slot is greedy.

    `noise[b, :topk[b]]` are slot b's Exp(1) draws; `width` (>= every slot's top-k, <= V) is the
    static number of candidates computed for all slots (0 = V).
    """
    best = logits.argmax(dim=-1)
    if noise is None:
        return best
    width = min(width or logits.shape[-1], logits.shape[-1])
    pick_best = greedy | (temperature <= 0)
    safe_t = torch.where(pick_best, torch.ones_like(temperature), temperature)
    keep = torch.arange(width, device=logits.device)[None, :] < topk[:, None]
    return _draw(logits, best, safe_t, keep, pick_best, noise, width)


class SlotSampler:
    def __init__(self, num_slots: int, text_card: int, card: int, dep_q: int, device: torch.device):
        self.num_slots = num_slots
        self.device = device
        self.text_temperature = torch.full((num_slots,), 0.7, device=device)
        self.text_topk = torch.full((num_slots,), 25, dtype=torch.long, device=device)
        self.audio_temperature = torch.full((num_slots,), 0.8, device=device)
        self.audio_topk = torch.full((num_slots,), 250, dtype=torch.long, device=device)
        self.greedy = torch.ones(num_slots, dtype=torch.bool, device=device)
        self.text_noise = torch.ones(num_slots, text_card, device=device)
        self.audio_noise = torch.ones(num_slots, dep_q, card, device=device)
        self.generators = [torch.Generator(device=device) for _ in range(num_slots)]
        self.sampling_slots: set[int] = set()  # host-side: slots that draw random numbers
        self._k_text = [1] * num_slots  # host-side copies of the top-k settings
        self._k_audio = [1] * num_slots
        self.text_width = text_card
        self.audio_width = card
        self.always_full = False  # CUDA graphs: always take the sampling path (static graph)
        self._version = 0  # bumped by every settings change
        self._derived_key: tuple[int, int, int] | None = None
        self._derived: tuple[torch.Tensor, ...] = ()

    def subset(self, index: torch.Tensor) -> SlotSampler:
        """Settings and drawn noise of the slots `index` (for a compacted tick; no generators)."""
        sub = copy.copy(self)
        sub.num_slots = int(index.shape[0])
        for name in ("text_temperature", "text_topk", "audio_temperature", "audio_topk", "greedy"):
            setattr(sub, name, getattr(self, name).index_select(0, index))
        sub.text_noise = self.text_noise.index_select(0, index)
        sub.audio_noise = self.audio_noise.index_select(0, index)
        sub.generators = []
        sub._derived_key = None
        sub._derived = ()
        return sub

    def configure(self, slot: int, sampling: Sampling, seed: int) -> None:
        self.text_temperature[slot] = sampling.text_temperature
        self.text_topk[slot] = sampling.text_topk
        self.audio_temperature[slot] = sampling.audio_temperature
        self.audio_topk[slot] = sampling.audio_topk
        self.greedy[slot] = sampling.greedy
        self.generators[slot].manual_seed(seed)
        self._k_text[slot] = min(sampling.text_topk, self.text_noise.shape[-1])
        self._k_audio[slot] = min(sampling.audio_topk, self.audio_noise.shape[-1])
        if sampling.greedy:
            self.sampling_slots.discard(slot)
        else:
            self.sampling_slots.add(slot)
        self._version += 1

    def release(self, slot: int) -> None:
        self.sampling_slots.discard(slot)
        self.greedy[slot] = True
        self._version += 1

    def draw_noise(self, active: list[bool]) -> bool:
        """Fill the noise of active sampling slots; True when any slot samples this step."""
        drawing = [s for s in sorted(self.sampling_slots) if active[s]]
        for slot in drawing:
            gen = self.generators[slot]
            self.text_noise[slot, : self._k_text[slot]].exponential_(1.0, generator=gen)
            self.audio_noise[slot, :, : self._k_audio[slot]].exponential_(1.0, generator=gen)
        if self.always_full:
            self.text_width, self.audio_width = self.text_noise.shape[-1], self.audio_noise.shape[-1]
        elif drawing:
            self.text_width = max(self._k_text[s] for s in drawing)
            self.audio_width = max(self._k_audio[s] for s in drawing)
        sampling = bool(drawing) or self.always_full
        if sampling:
            self._constants()  # refresh outside any graph replay
        return sampling

    def _constants(self) -> tuple[torch.Tensor, ...]:
        """Guards and top-k masks, rebuilt only when settings or widths change (not per call)."""
        key = (self._version, self.text_width, self.audio_width)
        if self._derived_key != key:
            one = torch.ones_like(self.text_temperature)
            text_best = self.greedy | (self.text_temperature <= 0)
            audio_best = self.greedy | (self.audio_temperature <= 0)
            rank_t = torch.arange(self.text_width, device=self.device)[None, :]
            rank_a = torch.arange(self.audio_width, device=self.device)[None, :]
            fresh = (
                text_best,
                torch.where(text_best, one, self.text_temperature),
                rank_t < self.text_topk[:, None],
                audio_best,
                torch.where(audio_best, one, self.audio_temperature),
                rank_a < self.audio_topk[:, None],
            )
            if self._derived and all(a.shape == b.shape for a, b in zip(self._derived, fresh, strict=True)):
                for buffer, value in zip(self._derived, fresh, strict=True):
                    buffer.copy_(value)  # in place: a captured CUDA graph reads these buffers
            else:
                self._derived = fresh
            self._derived_key = key
        return self._derived

    def text(self, logits: torch.Tensor, sampling: bool) -> torch.Tensor:
        best = logits.argmax(dim=-1)
        if not sampling:
            return best
        pick, safe_t, keep, _, _, _ = self._constants()
        return _draw(logits, best, safe_t, keep, pick, self.text_noise, self.text_width)

    def audio(self, logits: torch.Tensor, codebook: int, sampling: bool) -> torch.Tensor:
        best = logits.argmax(dim=-1)
        if not sampling:
            return best
        _, _, _, pick, safe_t, keep = self._constants()
        return _draw(logits, best, safe_t, keep, pick, self.audio_noise[:, codebook], self.audio_width)
