"""The demo model's voices, under the 18 names of the published voices.

Clients written for PersonaPlex (the official web client among them) offer only the published
names, `NATF0.pt` … `VARM4.pt`, and never ask the server for its list; so the demo answers to
exactly those. They are demo voices: synthetic vowel-like buzzes (`model/random_init.py`), female
names higher, male names lower, each its own pitch, listed with source "demo". Each is a `.pt`
in the published format, made with the demo model itself (`voice_maker.make_voice`) at the first
build of the demo engine and kept in the demo's cache (`model/demo.py`), so a voice costs a
call no encoding.
"""

from __future__ import annotations

import io
import logging
from typing import TYPE_CHECKING

from personaplex_voice.model.demo import write_atomic
from personaplex_voice.model.random_init import synthetic_voice

if TYPE_CHECKING:
    from personaplex_voice.engine.generator import PersonaPlexEngine

log = logging.getLogger(__name__)

VOICE_SECONDS = 1.5


def _pitches() -> dict[str, float]:
    """name -> fundamental frequency (Hz): natural voices in the middle, varied ones spread."""
    pitches = {}
    for i in range(4):
        pitches[f"NATF{i}"] = 195.0 + 12.0 * i
        pitches[f"NATM{i}"] = 105.0 + 8.0 * i
    for i in range(5):
        pitches[f"VARF{i}"] = 170.0 + 25.0 * i
        pitches[f"VARM{i}"] = 85.0 + 15.0 * i
    return pitches


DEMO_VOICE_PITCHES = _pitches()
DEMO_VOICES = tuple(f"{name}.pt" for name in DEMO_VOICE_PITCHES)


def ensure_demo_voices(engine: PersonaPlexEngine) -> None:
    """Make the demo voices missing from the demo's own voice directory (not a user's
    `--voice-prompt-dir`). Safe to run concurrently: each file appears whole or not at all."""
    import torch

    if engine.files.voice_source != "demo":
        return
    folder = engine.files.voice_dirs[0]
    made = 0
    for index, (name, f0) in enumerate(DEMO_VOICE_PITCHES.items()):
        path = folder / f"{name}.pt"
        if path.is_file():
            continue
        voice = engine.make_voice(synthetic_voice(f0, seconds=VOICE_SECONDS, seed=100 + index))
        buffer = io.BytesIO()
        torch.save(voice, buffer)
        write_atomic(path, buffer.getvalue())
        made += 1
    if made:
        log.info("made %d demo voices in %s", made, folder)
