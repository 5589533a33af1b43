"""Helpers for the engine-model tests: golden files, user audio frames, running a persona."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

from personaplex_voice.engine.base import FRAME_SIZE, Persona, Sampling

PROMPT = "You enjoy having a good conversation."
SERVICE_PROMPT = (
    "You work for CitySan Services which is a waste management and your name is Ayelen Lucero. "
    "Information: Verify customer name Omar Torres. Current schedule: every other week."
)
RUNS = {
    "wav_voice": ("TINYF0.wav", PROMPT),
    "pt_voice": ("TINYF0.pt", PROMPT),
    "service": ("TINYF0.pt", SERVICE_PROMPT),
}


def user_frames(golden_dir: Path) -> np.ndarray:
    pcm, sr = sf.read(golden_dir / "user.wav", dtype="float32")
    assert sr == 24000
    n = -(-len(pcm) // FRAME_SIZE)
    return np.pad(pcm, (0, n * FRAME_SIZE - len(pcm))).reshape(n, FRAME_SIZE)


def persona(run: str, **sampling) -> Persona:
    voice, prompt = RUNS[run]
    return Persona(text_prompt=prompt, voice=voice, sampling=Sampling(greedy=True, **sampling))


@dataclass
class RunResult:
    tokens: np.ndarray  # [T, dep_q + 1]
    text_logits: np.ndarray | None
    audio_logits: np.ndarray | None
    pcm: np.ndarray
    pieces: list


def run_slot(engine, slot: int, frames: np.ndarray, capture: bool = True) -> RunResult:
    """Feed `frames` to one slot (others inactive) and collect its outputs."""
    tokens, tl, al, pcm, pieces = [], [], [], [], []
    active = np.zeros(engine.num_slots, bool)
    active[slot] = True
    for frame in frames:
        batch = np.zeros((engine.num_slots, FRAME_SIZE), np.float32)
        batch[slot] = frame
        out = engine.step(batch, active)
        tokens.append(engine.last_tokens[slot].copy())
        if capture:
            tl.append(engine.last_text_logits[slot].copy())
            al.append(engine.last_audio_logits[slot].copy())
        pcm.append(out.pcm[slot].copy())
        pieces.append(out.text[slot])
    return RunResult(
        np.stack(tokens),
        np.stack(tl) if capture else None,
        np.stack(al) if capture else None,
        np.concatenate(pcm),
        pieces,
    )


def reference_pieces(expected: np.ndarray) -> list:
    """Golden pieces with the published "PAD"/"EPAD" shown as None, as StepOutput.text does."""
    return [None if p in ("PAD", "EPAD") else str(p) for p in expected]
