"""Per-slot token sampling with static shapes.

Every slot has its own temperature / top-k / greedy settings (as tensors) and its own
`torch.Generator`. Sampling follows the published algorithm: softmax(logits / T), keep the top k,
then draw with the exponential race (argmax of p / Exp(1) noise), greedy = argmax of the logits.
The noise is drawn per slot before the step (`draw_noise`), outside the batched computation, so
a slot's draws depend only on its own seed and step count, never on its neighbours, and the
batched math itself has no data-dependent control flow (CUDA-graph friendly).
"""

from __future__ import annotations

import torch

from personaplex_voice.engine.base import Sampling


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    topk: torch.Tensor,
    greedy: torch.Tensor,
    noise: torch.Tensor | None,
) -> torch.Tensor:
    """logits [B, V] float32 -> tokens [B]. `noise` None means every slot is greedy."""
    best = logits.argmax(dim=-1)
    if noise is None:
        return best
    safe_t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    probs = torch.softmax(logits / safe_t[:, None], dim=-1)
    k = topk.clamp(1, logits.shape[-1]) - 1
    kth = probs.sort(dim=-1, descending=True).values.gather(-1, k[:, None])
    probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    drawn = (probs / noise).argmax(dim=-1)
    return torch.where(greedy | (temperature <= 0), best, drawn)


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
        self.always_full = False  # CUDA graphs: always take the sampling path (static graph)

    def configure(self, slot: int, sampling: Sampling, seed: int) -> None:
        self.text_temperature[slot] = sampling.text_temperature
        self.text_topk[slot] = sampling.text_topk
        self.audio_temperature[slot] = sampling.audio_temperature
        self.audio_topk[slot] = sampling.audio_topk
        self.greedy[slot] = sampling.greedy
        self.generators[slot].manual_seed(seed)
        if sampling.greedy:
            self.sampling_slots.discard(slot)
        else:
            self.sampling_slots.add(slot)

    def release(self, slot: int) -> None:
        self.sampling_slots.discard(slot)
        self.greedy[slot] = True

    def draw_noise(self, active: list[bool]) -> bool:
        """Fill the noise of active sampling slots; True when any slot samples this step."""
        drawing = [s for s in sorted(self.sampling_slots) if active[s]]
        for slot in drawing:
            gen = self.generators[slot]
            self.text_noise[slot].exponential_(1.0, generator=gen)
            self.audio_noise[slot].exponential_(1.0, generator=gen)
        return bool(drawing) or self.always_full

    def text(self, logits: torch.Tensor, sampling: bool) -> torch.Tensor:
        noise = self.text_noise if sampling else None
        return sample_tokens(logits, self.text_temperature, self.text_topk, self.greedy, noise)

    def audio(self, logits: torch.Tensor, codebook: int, sampling: bool) -> torch.Tensor:
        noise = self.audio_noise[:, codebook] if sampling else None
        return sample_tokens(logits, self.audio_temperature, self.audio_topk, self.greedy, noise)
