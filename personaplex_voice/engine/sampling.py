"""Per-slot token sampling with static shapes.

Every slot has its own temperature / top-k / greedy settings (as tensors) and its own
`torch.Generator`. Sampling follows the published algorithm: softmax(logits / T), keep the top k,
then draw with the exponential race (argmax of p / Exp(1) noise), greedy = argmax of the logits.
Temperature 0 is greedy, as published.
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
    width: int = 0,
) -> torch.Tensor:
    """logits [B, V] float32 -> tokens [B]. `noise` None means every slot is greedy.

    As published: probabilities at temperature T, the `topk` best kept, one drawn by the
    exponential race (argmax of p / Exp(1)) using `noise[b, :topk[b]]`. `width` (>= every
    slot's top-k, <= V) is the static number of candidates computed for all slots.
    """
    best = logits.argmax(dim=-1)
    if noise is None:
        return best
    width = min(width or logits.shape[-1], logits.shape[-1])
    safe_t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    probs = torch.softmax(logits / safe_t[:, None], dim=-1)
    values, index = probs.topk(width, dim=-1)
    rank = torch.arange(width, device=logits.device)
    values = torch.where(rank[None, :] < topk[:, None], values, torch.zeros_like(values))
    choice = (values / noise[:, :width]).argmax(dim=-1, keepdim=True)
    drawn = index.gather(-1, choice)[:, 0]
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
        self._k_text = [1] * num_slots  # host-side copies of the top-k settings
        self._k_audio = [1] * num_slots
        self.text_width = text_card
        self.audio_width = card
        self.always_full = False  # CUDA graphs: always take the sampling path (static graph)

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

    def release(self, slot: int) -> None:
        self.sampling_slots.discard(slot)
        self.greedy[slot] = True

    def draw_noise(self, active: list[bool]) -> bool:
        """Fill the noise of active sampling slots; True when any slot samples this step.

        A slot draws exactly top-k values per stream from its own generator, so its random
        stream never depends on what the other slots do.
        """
        drawing = [s for s in sorted(self.sampling_slots) if active[s]]
        for slot in drawing:
            gen = self.generators[slot]
            k_text = int(self._k_text[slot])
            k_audio = int(self._k_audio[slot])
            self.text_noise[slot, :k_text].exponential_(1.0, generator=gen)
            self.audio_noise[slot, :, :k_audio].exponential_(1.0, generator=gen)
        if self.always_full:
            self.text_width, self.audio_width = self.text_noise.shape[-1], self.audio_noise.shape[-1]
        elif drawing:
            self.text_width = max(int(self._k_text[s]) for s in drawing)
            self.audio_width = max(int(self._k_audio[s]) for s in drawing)
        return bool(drawing) or self.always_full

    def text(self, logits: torch.Tensor, sampling: bool) -> torch.Tensor:
        noise = self.text_noise if sampling else None
        return sample_tokens(
            logits, self.text_temperature, self.text_topk, self.greedy, noise, self.text_width
        )

    def audio(self, logits: torch.Tensor, codebook: int, sampling: bool) -> torch.Tensor:
        noise = self.audio_noise[:, codebook] if sampling else None
        return sample_tokens(
            logits, self.audio_temperature, self.audio_topk, self.greedy, noise, self.audio_width
        )
