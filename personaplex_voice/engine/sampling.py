"""Per-slot token sampling with static shapes.

Every slot has its own temperature / top-k / greedy settings (as tensors) and its own random
stream. Sampling follows the published algorithm: softmax(logits / T), keep the top k, then draw
with the exponential race (argmax of p / Exp(1) noise); greedy = argmax of the logits.
Temperature 0 is greedy, as published.

The noise is counter-based: value i of stream s (0 = text, 1 + codebook = audio) at a slot's
sampled step n is a hash of (the slot's seed, n, s, i), turned into Exp(1). So every slot's noise
is computed for all slots at once, in a fixed handful of tensor operations per tick (inside the
CUDA graph, no host work), and a slot's draws still depend only on its seed and its own step
count, never on its neighbours or on how many candidates are computed. The hash is murmur3's
32-bit finaliser on integers kept below 2**32 in int64 tensors (32-bit products split in 16-bit
halves, so nothing overflows int64 on any device).
"""

from __future__ import annotations

import copy

import torch

from personaplex_voice.engine.base import Sampling

MASK32 = 0xFFFFFFFF
# Per-slot tensors: a subset or view of the sampler carries these.
_PER_SLOT = ("text_temperature", "text_topk", "audio_temperature", "audio_topk", "greedy", "key", "step")
_MIX1 = 0x85EBCA6B
_MIX2 = 0xC2B2AE35
_SEED_SALT = 0x9E3779B9


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for x in [0, 2**32) without an int64 overflow."""
    low = x & 0xFFFF
    high = x >> 16
    return (low * constant + ((high * constant) & 0xFFFF) * 65536) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MIX1)
    x = x ^ (x >> 13)
    x = _mul32(x, _MIX2)
    return x ^ (x >> 16)


def mix32_int(x: int) -> int:
    """The same finaliser on a Python int (host-side keys)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * _MIX1) & MASK32
    x ^= x >> 13
    x = (x * _MIX2) & MASK32
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """A slot's 32-bit key from a seed of up to 64 bits."""
    seed &= (1 << 64) - 1
    return mix32_int((seed & MASK32) ^ mix32_int((seed >> 32) ^ _SEED_SALT))


def exponential_noise(
    key: torch.Tensor, step: torch.Tensor, streams: torch.Tensor, n_streams: int, index_hash: torch.Tensor
) -> torch.Tensor:
    """Exp(1) noise [B, S, W]: slot b's values for each of `streams` [S] at its step `step[b]`.

    key, step: int64 [B]; n_streams: how many streams a step has; index_hash: int64 [W], `mix32`
    of the candidate ranks (fixed per width). One batched computation for every slot.
    """
    counter = (step[:, None] * n_streams + streams[None, :]) & MASK32  # [B, S]
    base = mix32(key[:, None] ^ mix32(counter))
    bits = mix32(base[:, :, None] ^ index_hash[None, None, :])
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / 2**24)  # (0, 1), 24 bits
    return -torch.log(uniform)


def _draw(
    logits: torch.Tensor,
    best: torch.Tensor,
    safe_t: torch.Tensor,
    pick_best: torch.Tensor,
    kept_noise: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """The race among the top-`width` candidates. `kept_noise` [B, width]: a slot's Exp(1) draws
    by rank, infinite past its top-k (p / inf = 0: those candidates never win), as a zeroed
    probability would."""
    probs = torch.softmax(logits / safe_t[:, None], dim=-1)
    values, index = probs.topk(width, dim=-1)
    choice = (values / kept_noise).argmax(dim=-1, keepdim=True)
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
    kept = torch.where(keep, noise[:, :width], torch.inf)
    return _draw(logits, best, safe_t, pick_best, kept, width)


# The candidate widths a static tick (a CUDA graph) computes, whatever the slots ask, unless one
# asks for more: then the full vocabularies (a second graph). Default top-k: 25 text, 250 audio.
STATIC_TEXT_WIDTH = 128
STATIC_AUDIO_WIDTH = 256


class SlotSampler:
    def __init__(self, num_slots: int, text_card: int, card: int, dep_q: int, device: torch.device):
        self.num_slots = num_slots
        self.device = device
        self.text_card = text_card
        self.card = card
        self.streams = 1 + dep_q  # the text stream, then one per depformer codebook
        self.text_temperature = torch.full((num_slots,), 0.7, device=device)
        self.text_topk = torch.full((num_slots,), 25, dtype=torch.long, device=device)
        self.audio_temperature = torch.full((num_slots,), 0.8, device=device)
        self.audio_topk = torch.full((num_slots,), 250, dtype=torch.long, device=device)
        self.greedy = torch.ones(num_slots, dtype=torch.bool, device=device)
        # The random stream of each slot: its seed's key and the steps it has been stepped since
        # `configure` (advanced inside the tick for active slots).
        self.key = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.step = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.sampling_slots: set[int] = set()  # host-side: slots that draw random numbers
        self._k_text = [1] * num_slots  # host-side copies of the top-k settings
        self._k_audio = [1] * num_slots
        self.text_width = text_card
        self.audio_width = card
        # CUDA graphs: the sampling path always on, with one of two static width pairs
        # (`static_widths`); `wide` says which one this tick needs.
        self.static = False
        self.wide = False
        self._version = 0  # bumped by every settings change
        # per (text width, audio width): the guards and top-k masks, refreshed in place
        self._derived: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self._derived_version: dict[tuple[int, int], int] = {}
        self._index_hash: dict[int, torch.Tensor] = {}
        self._stream_ids = torch.arange(self.streams, dtype=torch.long, device=device)
        self._text_noise: torch.Tensor | None = None  # this tick's draws (`draw`), past top-k = inf
        self._audio_noise: torch.Tensor | None = None

    def static_widths(self, wide: bool) -> tuple[int, int]:
        """The (text, audio) candidate widths of a static tick: the caps, or the vocabularies."""
        if wide:
            return self.text_card, self.card
        return min(STATIC_TEXT_WIDTH, self.text_card), min(STATIC_AUDIO_WIDTH, self.card)

    def use_static_widths(self, wide: bool) -> None:
        """A static tick's widths (inside the function a graph captures: its warm-up runs make
        the buffers these widths read, so the capture itself creates none)."""
        self.text_width, self.audio_width = self.static_widths(wide)
        self._constants()
        self._hash_of(max(self.text_width, self.audio_width))

    def subset(self, index: torch.Tensor) -> SlotSampler:
        """Settings and random streams of the slots `index` (a compacted tick; `store` writes the
        steps back)."""
        sub = copy.copy(self)
        sub.num_slots = int(index.shape[0])
        for name in _PER_SLOT:
            setattr(sub, name, getattr(self, name).index_select(0, index))
        sub._derived, sub._derived_version = {}, {}
        return sub

    def view(self, slot: int) -> SlotSampler:
        """Slot `slot` alone, as views of this sampler's tensors (its batch-1 prompt steps)."""
        sub = copy.copy(self)
        sub.num_slots = 1
        for name in _PER_SLOT:
            setattr(sub, name, getattr(self, name)[slot : slot + 1])
        sub._derived, sub._derived_version = {}, {}
        return sub

    def store(self, index: torch.Tensor, sub: SlotSampler) -> None:
        """Write a subset's random-stream steps back."""
        self.step.index_copy_(0, index, sub.step)

    def configure(self, slot: int, sampling: Sampling, seed: int) -> None:
        self.text_temperature[slot] = sampling.text_temperature
        self.text_topk[slot] = sampling.text_topk
        self.audio_temperature[slot] = sampling.audio_temperature
        self.audio_topk[slot] = sampling.audio_topk
        self.greedy[slot] = sampling.greedy
        self.key[slot] = seed_key(seed)
        self.step[slot] = 0
        self._k_text[slot] = min(sampling.text_topk, self.text_card)
        self._k_audio[slot] = min(sampling.audio_topk, self.card)
        if sampling.greedy:
            self.sampling_slots.discard(slot)
        else:
            self.sampling_slots.add(slot)
        self._version += 1

    def release(self, slot: int) -> None:
        self.sampling_slots.discard(slot)
        self.greedy[slot] = True
        self._version += 1

    def prepare_tick(self, active: list[bool]) -> bool:
        """Before a tick: the candidate widths (and, static, whether the wide pair is needed), and
        True when any active slot samples (host-side only: the noise is computed in the tick)."""
        drawing = [s for s in sorted(self.sampling_slots) if active[s]]
        k_text = max((self._k_text[s] for s in drawing), default=1)
        k_audio = max((self._k_audio[s] for s in drawing), default=1)
        if self.static:
            narrow_text, narrow_audio = self.static_widths(False)
            self.wide = k_text > narrow_text or k_audio > narrow_audio
            self.text_width, self.audio_width = self.static_widths(self.wide)
        elif drawing:
            self.text_width, self.audio_width = k_text, k_audio
        sampling = bool(drawing) or self.static
        if sampling:
            self._constants()  # refresh outside any graph replay
            self._hash_of(max(self.text_width, self.audio_width))
        return sampling

    def advance(self, active: torch.Tensor | None) -> None:
        """One step taken by the active slots (inside the tick, in place); this tick's noise is
        spent."""
        self._text_noise = self._audio_noise = None
        if active is None:
            self.step += 1
        else:
            self.step += active.to(torch.long)

    def _hash_of(self, width: int) -> torch.Tensor:
        table = self._index_hash.get(width)
        if table is None:
            table = mix32(torch.arange(width, dtype=torch.long, device=self.device))
            self._index_hash[width] = table
        return table

    def draw(self) -> None:
        """This tick's noise for every slot and stream in one computation (inside the tick): the
        text stream [B, text_width] and the audio streams [B, dep_q, audio_width], by rank (a
        value depends on its rank, not on the width computed), infinite past each slot's top-k."""
        widths = (self.text_width, self.audio_width)
        width = max(widths)
        noise = exponential_noise(self.key, self.step, self._stream_ids, self.streams, self._hash_of(width))
        _, _, text_keep, _, _, audio_keep = self._constants()
        self._text_noise = torch.where(text_keep, noise[:, 0, : widths[0]], torch.inf)
        self._audio_noise = torch.where(audio_keep[:, None, :], noise[:, 1:, : widths[1]], torch.inf)

    def _constants(self) -> tuple[torch.Tensor, ...]:
        """Guards and top-k masks for the current widths, rebuilt only when settings changed
        since they were last made, in place: a captured CUDA graph reads these buffers."""
        key = (self.text_width, self.audio_width)
        if self._derived_version.get(key) != self._version:
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
            current = self._derived.get(key)
            if current is not None and all(a.shape == b.shape for a, b in zip(current, fresh, strict=True)):
                for buffer, value in zip(current, fresh, strict=True):
                    buffer.copy_(value)
            else:
                self._derived[key] = fresh
            self._derived_version[key] = self._version
        return self._derived[key]

    def text(self, logits: torch.Tensor, sampling: bool) -> torch.Tensor:
        best = logits.argmax(dim=-1)
        if not sampling:
            return best
        pick, safe_t, _, _, _, _ = self._constants()
        if self._text_noise is None:
            self.draw()
        assert self._text_noise is not None
        return _draw(logits, best, safe_t, pick, self._text_noise, self.text_width)

    def audio(self, logits: torch.Tensor, codebook: int, sampling: bool) -> torch.Tensor:
        best = logits.argmax(dim=-1)
        if not sampling:
            return best
        _, _, _, pick, safe_t, _ = self._constants()
        assert self._audio_noise is not None, "draw() before audio()"
        return _draw(logits, best, safe_t, pick, self._audio_noise[:, codebook], self.audio_width)
