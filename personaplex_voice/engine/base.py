"""The engine contract: what the SessionManager needs from a speech-to-speech engine.

Two implementations exist: `personaplex_voice.engine.generator.PersonaPlexEngine` (torch, the
real model) and `personaplex_voice.engine.loopback.LoopbackEngine` (numpy only, an echo for
wiring and load tests). The SessionManager owns exactly one engine and calls every method below
from its single inference thread, except `prepare`, which only validates and loads a persona's
inputs and may run in a worker thread.

The engine has a fixed number of batch *slots* (static shapes, so CUDA graphs can capture the
step). A slot is either free, or holds one conversation. Every piece of streaming state lives
per slot, so a slot can be started, stepped, skipped or released without touching the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

SAMPLE_RATE = 24_000
FRAME_RATE = 12.5
FRAME_SIZE = 1920  # samples per 80 ms frame at 24 kHz


class EngineError(Exception):
    """Base class of every error the engine reports to a caller."""


class PersonaError(EngineError):
    """The persona cannot be used: unknown voice, unreadable voice file, prompt too long..."""


class SlotError(EngineError):
    """`step` refused to run because of these slots (e.g. one never started). Raised before any
    slot's state changed, so the scheduler ends those sessions and steps the others again."""

    def __init__(self, message: str, slots: Sequence[int]):
        super().__init__(message)
        self.slots = tuple(int(s) for s in slots)


class CapacityError(EngineError):
    """No slot is free. `retry_after_s` is a hint; `queue_position` is set when queueing."""

    def __init__(self, message: str, retry_after_s: float | None = None, queue_position: int | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.queue_position = queue_position


class SaturatedError(CapacityError):
    """Slots may be free, but the process cannot take another call in real time: its headroom
    is spent (engine/headroom.py). The calls it carries keep their clean line; the caller is
    told to try again later or elsewhere (a phone carrier's busy answer, HTTP 503)."""


@dataclass(frozen=True)
class Sampling:
    """Per-session sampling. `greedy=True` means argmax for text and audio (temperatures ignored)."""

    text_temperature: float = 0.7
    text_topk: int = 25
    audio_temperature: float = 0.8
    audio_topk: int = 250
    greedy: bool = False

    def __post_init__(self) -> None:
        for name in ("text_temperature", "audio_temperature"):
            value = getattr(self, name)
            if not (0.0 <= value <= 10.0) or value != value:
                raise PersonaError(f"{name} must be between 0 and 10, got {value}")
        for name in ("text_topk", "audio_topk"):
            value = getattr(self, name)
            if not (1 <= value <= 100_000):
                raise PersonaError(f"{name} must be between 1 and 100000, got {value}")


@dataclass(frozen=True)
class Persona:
    """Who the agent is for one conversation.

    `voice` is a voice name known to the engine (see `Engine.voices()`, e.g. "NATF2" or
    "NATF2.pt") or None for the engine's default voice. Arbitrary filesystem paths are never
    accepted from remote callers; the engine resolves names inside its voice directory only.
    `seed` None means a random seed chosen at start.
    """

    text_prompt: str = ""
    voice: str | None = None
    sampling: Sampling = field(default_factory=Sampling)
    seed: int | None = None


@dataclass(frozen=True)
class VoiceInfo:
    name: str  # what a client passes as `voice`
    kind: str  # "embeddings" (.pt, published format) or "audio" (.wav etc., encoded at prefill)
    source: str  # where it came from: "model", "voice-dir", ...


@dataclass
class PreparedPersona:
    """A persona validated and loaded by `Engine.prepare`, ready to prefill into a slot.

    `cache_key` identifies the slot state after the system prompt: two personas with equal keys
    prefill to bit-identical slot state (sampling and seed are *not* part of it). `payload` is
    engine-private (token ids, voice tensors...).
    """

    persona: Persona
    cache_key: tuple[Any, ...]
    prompt_steps: int  # number of generator steps the system prompt takes
    payload: Any = None


@runtime_checkable
class SlotSnapshot(Protocol):
    """Engine-private copy of one slot's state after the system prompt (for the persona cache)."""

    @property
    def nbytes(self) -> int: ...


class SlotPrefill(Protocol):
    """A system prompt being run into one slot, a chunk at a time (`Engine.begin_start`).

    Chunk boundaries are the engine's (a fixed number of prompt positions), never the caller's
    timing, so a slot prefilled in many small pieces between ticks ends in the same state
    however the pieces were spread.
    """

    @property
    def remaining(self) -> int:
        """Chunks still to run (0 once the slot is started)."""

    def run_chunk(self) -> bool:
        """Run the next chunk; True once the whole prompt is in and the slot is started."""


@dataclass
class StepOutput:
    """Result of one batched step: one row per slot; rows of inactive slots are undefined."""

    pcm: np.ndarray  # float32 [num_slots, FRAME_SIZE]
    text: list[str | None]  # text piece per slot; None for padding / inactive slots
    # int64 [num_slots, 1 + n_codebooks] when the engine has them: per slot the text token, then
    # the agent's audio tokens (the codes `pcm` was decoded from).
    tokens: np.ndarray | None = None


class Engine(Protocol):
    """What the SessionManager drives. All methods but `prepare` run on the inference thread."""

    name: str  # model identity, part of persona cache keys
    num_slots: int
    sample_rate: int  # always SAMPLE_RATE
    frame_size: int  # always FRAME_SIZE

    def voices(self) -> Sequence[VoiceInfo]:
        """Voices a client may name in `Persona.voice`."""

    def prepare(self, persona: Persona) -> PreparedPersona:
        """Validate and load the persona's inputs (voice file, tokenized prompt).

        Raises PersonaError with a message fit to show the remote caller.
        """

    def start(self, slot: int, prepared: PreparedPersona) -> None:
        """Reset `slot` and run the system prompt into it (teacher-forced prefill).

        Afterwards the slot's Mimi state is fresh and its RNG is seeded from the persona's seed,
        so a slot started here and one restored from a snapshot behave identically.
        """

    def begin_start(self, slot: int, prepared: PreparedPersona) -> SlotPrefill:
        """`start` in pieces: reset `slot` and return the prefill, to run chunk by chunk. Until it
        reports done the slot must not be stepped; releasing the slot abandons it."""

    def snapshot(self, slot: int) -> SlotSnapshot:
        """Copy of the slot's state right after `start` (before any `step`)."""

    def restore(self, slot: int, snapshot: SlotSnapshot, prepared: PreparedPersona) -> None:
        """Put a snapshot taken from an equal cache key into `slot`; seeds the RNG as `start` does."""

    def step(self, pcm: np.ndarray, active: np.ndarray) -> StepOutput:
        """One 80 ms tick for every slot at once.

        `pcm`: float32 [num_slots, FRAME_SIZE] user audio at 24 kHz (zeros for inactive slots).
        `active`: bool [num_slots]; inactive slots keep their state untouched.
        """

    def release(self, slot: int) -> None:
        """Free the slot (drop references to per-call data); the slot may be started again."""

    def warmup(self) -> None:
        """Run once, before the first caller, whatever the first prefill and the first ticks
        would pay for (kernel selection, allocator growth, CUDA-graph capture); every slot is
        left as fresh as before. May do nothing (an engine with nothing to warm)."""
