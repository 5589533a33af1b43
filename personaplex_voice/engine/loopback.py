"""`LoopbackEngine`: an echo that implements the engine contract with numpy only.

Each slot plays back its own input `delay_frames` frames later, so transports, the
SessionManager and load tests run without a model (and without torch). It can emit text pieces
and simulate a slow system-prompt prefill, which is what the wiring tests need to exercise
closes during prefill, the persona cache and text forwarding.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from personaplex_voice.engine.base import (
    FRAME_SIZE,
    SAMPLE_RATE,
    EngineError,
    Persona,
    PersonaError,
    PreparedPersona,
    SlotError,
    StepOutput,
    VoiceInfo,
)

# The names NVIDIA's PersonaPlex web client offers (it never asks /api/voices; NATF0 is its
# default), so it can be tried against the echo: every voice here is the same echo.
PUBLISHED_VOICES = tuple(
    [f"NAT{g}{i}" for g in "FM" for i in range(4)] + [f"VAR{g}{i}" for g in "FM" for i in range(5)]
)
LOOPBACK_VOICES = ("LOOPF0", "LOOPM0", *PUBLISHED_VOICES)
MAX_PROMPT_CHARS = 4000  # the real engine rejects prompts past its context; mimic a limit


@dataclass
class LoopbackSnapshot:
    """A slot right after `start`: its (silent) delay line."""

    delay_line: np.ndarray  # float32 [delay_frames, FRAME_SIZE]

    @property
    def nbytes(self) -> int:
        return int(self.delay_line.nbytes)


class LoopbackEngine:
    """Echo engine. Text pieces, when given, are emitted in turn (cycling) from each slot's first step.

    `prefill_s` makes `start` sleep that long, like a real system prompt, spread over chunks of
    `prefill_chunk` prompt steps (`begin_start`); `restore` is instant.
    `starts`, `restores`, `steps` count calls, for tests. A `text_pieces` entry may be None
    (no text that frame).
    """

    sample_rate = SAMPLE_RATE
    frame_size = FRAME_SIZE

    def __init__(
        self,
        num_slots: int = 4,
        delay_frames: int = 1,
        text_pieces: Sequence[str | None] | None = None,
        prefill_s: float = 0.0,
        name: str = "loopback",
        prefill_chunk: int = 64,
    ):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if delay_frames < 0:
            raise ValueError(f"delay_frames must be >= 0, got {delay_frames}")
        self.name = name
        self.num_slots = num_slots
        self.delay_frames = delay_frames
        self.text_pieces = list(text_pieces) if text_pieces else []
        self.prefill_s = prefill_s
        self.prefill_chunk = max(1, prefill_chunk)
        # Per slot: a ring of the last `delay_frames` input frames and where it is read next.
        self._rings = np.zeros((num_slots, delay_frames, FRAME_SIZE), np.float32)
        self._read = np.zeros(num_slots, np.int64)
        self._steps_in_slot = np.zeros(num_slots, np.int64)
        self._persona: list[Persona | None] = [None] * num_slots
        self._counts_lock = threading.Lock()
        self.starts = 0
        self.restores = 0
        self.steps = 0
        self.releases = 0

    def warmup(self) -> None:
        """Nothing to warm: numpy only."""

    def voices(self) -> list[VoiceInfo]:
        return [VoiceInfo(name=name, kind="embeddings", source="loopback") for name in LOOPBACK_VOICES]

    def prepare(self, persona: Persona) -> PreparedPersona:
        voice = persona.voice
        if voice is not None:
            voice = voice.removesuffix(".pt")
            if voice not in LOOPBACK_VOICES:
                known = ", ".join(LOOPBACK_VOICES)
                raise PersonaError(f"unknown voice {persona.voice!r} (this engine has: {known})")
        if len(persona.text_prompt) > MAX_PROMPT_CHARS:
            raise PersonaError(
                f"text prompt too long ({len(persona.text_prompt)} > {MAX_PROMPT_CHARS} chars)"
            )
        voice = voice or LOOPBACK_VOICES[0]
        return PreparedPersona(
            persona=persona,
            cache_key=(self.name, voice, persona.text_prompt),
            prompt_steps=12 + len(persona.text_prompt.split()),
        )

    def start(self, slot: int, prepared: PreparedPersona) -> None:
        prefill = self.begin_start(slot, prepared)
        while not prefill.run_chunk():
            pass

    def begin_start(self, slot: int, prepared: PreparedPersona) -> _LoopbackPrefill:
        self._check_slot(slot)
        self._persona[slot] = None
        chunks = max(1, -(-prepared.prompt_steps // self.prefill_chunk))
        return _LoopbackPrefill(self, slot, prepared, chunks)

    def _finish_start(self, slot: int, persona: Persona) -> None:
        self._reset(slot, persona)
        with self._counts_lock:
            self.starts += 1

    def snapshot(self, slot: int) -> LoopbackSnapshot:
        self._check_slot(slot)
        if self._persona[slot] is None:
            raise EngineError(f"slot {slot} is not started")
        return LoopbackSnapshot(delay_line=self._rings[slot].copy())

    def restore(self, slot: int, snapshot: LoopbackSnapshot, prepared: PreparedPersona) -> None:
        self._check_slot(slot)
        self._reset(slot, prepared.persona)
        self._rings[slot] = snapshot.delay_line
        with self._counts_lock:
            self.restores += 1

    def checked_batch(self, pcm: np.ndarray, active: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A step's inputs as arrays of this engine's batch shape, every active slot started
        (else the engine's errors, before any slot changes)."""
        pcm = np.asarray(pcm, np.float32)
        active = np.asarray(active, bool)
        if pcm.shape != (self.num_slots, FRAME_SIZE) or active.shape != (self.num_slots,):
            raise EngineError(
                f"step wants pcm [{self.num_slots}, {FRAME_SIZE}] and active [{self.num_slots}], "
                f"got {pcm.shape} and {active.shape}"
            )
        unstarted = [int(slot) for slot in np.flatnonzero(active) if self._persona[slot] is None]
        if unstarted:
            raise SlotError(f"slot(s) {unstarted} active but never started", unstarted)
        return pcm, active

    def step(self, pcm: np.ndarray, active: np.ndarray) -> StepOutput:
        pcm, active = self.checked_batch(pcm, active)
        out = np.zeros((self.num_slots, FRAME_SIZE), np.float32)
        text: list[str | None] = [None] * self.num_slots
        for slot in np.flatnonzero(active):
            if self.delay_frames == 0:
                out[slot] = pcm[slot]
            else:
                pos = self._read[slot]
                out[slot] = self._rings[slot, pos]
                self._rings[slot, pos] = pcm[slot]
                self._read[slot] = (pos + 1) % self.delay_frames
            if self.text_pieces:
                text[slot] = self.text_pieces[self._steps_in_slot[slot] % len(self.text_pieces)]
            self._steps_in_slot[slot] += 1
        self.steps += 1
        return StepOutput(pcm=out, text=text)

    def release(self, slot: int) -> None:
        self._check_slot(slot)
        self._persona[slot] = None
        self._rings[slot] = 0.0
        with self._counts_lock:
            self.releases += 1

    def slot_in_use(self, slot: int) -> bool:
        """Whether `slot` holds a started conversation (for tests of slot hygiene)."""
        return self._persona[slot] is not None

    def _reset(self, slot: int, persona: Persona) -> None:
        self._rings[slot] = 0.0
        self._read[slot] = 0
        self._steps_in_slot[slot] = 0
        self._persona[slot] = persona

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise EngineError(f"slot {slot} out of range 0..{self.num_slots - 1}")


class _LoopbackPrefill:
    """`begin_start`'s prefill: `prefill_s` of sleep in equal chunks."""

    def __init__(self, engine: LoopbackEngine, slot: int, prepared: PreparedPersona, chunks: int):
        self._engine, self._slot, self._prepared = engine, slot, prepared
        self._left = chunks
        self._chunk_s = engine.prefill_s / chunks

    @property
    def remaining(self) -> int:
        return self._left

    def run_chunk(self) -> bool:
        if self._left <= 0:
            return True
        if self._chunk_s > 0:
            time.sleep(self._chunk_s)
        self._left -= 1
        if self._left:
            return False
        self._engine._finish_start(self._slot, self._prepared.persona)
        return True
