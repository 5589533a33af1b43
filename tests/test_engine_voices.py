"""Voices: make_voice reproduces the published .pt; the voice library only opens plain names."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from personaplex_voice.engine.base import PersonaError
from personaplex_voice.engine.generator import PersonaPlexEngine, golden_like_files
from personaplex_voice.engine.prompts import wrap_system_prompt
from personaplex_voice.engine.voices import VoiceLibrary, load_voice_audio, load_voice_pt

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def engine(golden_dir):
    return PersonaPlexEngine(golden_like_files(golden_dir), num_slots=1)


def test_make_voice_matches_published_pt(engine, golden_dir):
    made = engine.make_voice(load_voice_audio(golden_dir / "voices" / "TINYF0.wav"), normalized=True)
    emb, cache = load_voice_pt(golden_dir / "voices" / "TINYF0.pt")
    assert made["embeddings"].dtype == torch.float32 and made["cache"].dtype == torch.int64
    assert made["embeddings"].shape == emb.shape
    torch.testing.assert_close(made["embeddings"], emb, atol=1e-4, rtol=0)
    assert torch.equal(made["cache"], cache)
    # Raw audio is normalised inside make_voice: the same result from the file's samples.
    import soundfile as sf

    raw, _ = sf.read(golden_dir / "voices" / "TINYF0.wav", dtype="float32")
    again = engine.make_voice(raw)
    torch.testing.assert_close(again["embeddings"], emb, atol=1e-4, rtol=0)


def test_made_voice_round_trips_through_torch_save(engine, golden_dir, tmp_path):
    made = engine.make_voice(load_voice_audio(golden_dir / "voices" / "TINYF0.wav"), normalized=True)
    torch.save(made, tmp_path / "MINE.pt")
    emb, cache = load_voice_pt(tmp_path / "MINE.pt")
    assert emb.shape[0] == made["embeddings"].shape[0] and torch.equal(cache, made["cache"])


def test_voice_library_resolves_plain_names_only(golden_dir, tmp_path):
    lib = VoiceLibrary([golden_dir / "voices"])
    assert {v.name: v.kind for v in lib.list()} == {"TINYF0.pt": "embeddings", "TINYF0.wav": "audio"}
    assert lib.resolve("TINYF0").name == "TINYF0.pt"
    assert lib.resolve("TINYF0.wav").name == "TINYF0.wav"
    for bad in ("../golden/voices/TINYF0.pt", "/etc/passwd", "..", "", "voices/TINYF0.pt", "NOPE"):
        with pytest.raises(PersonaError):
            lib.resolve(bad)


def test_bad_voice_files_are_persona_errors(tmp_path):
    (tmp_path / "junk.pt").write_bytes(b"not a pickle")
    with pytest.raises(PersonaError, match=r"junk.pt"):
        load_voice_pt(tmp_path / "junk.pt")
    torch.save({"embeddings": torch.zeros(3)}, tmp_path / "partial.pt")
    with pytest.raises(PersonaError, match=r"cache"):
        load_voice_pt(tmp_path / "partial.pt")
    (tmp_path / "bad.wav").write_bytes(b"RIFF....WAVEjunk")
    with pytest.raises(PersonaError, match=r"bad.wav"):
        load_voice_audio(tmp_path / "bad.wav")


def test_unknown_voice_and_empty_prompt(engine, golden_dir):
    from personaplex_voice.engine.base import Persona

    with pytest.raises(PersonaError, match=r"unknown voice"):
        engine.prepare(Persona(voice="NOBODY"))
    # An empty text prompt skips the text phase: voice + 2 x 0.5 s of silence.
    prepared = engine.prepare(Persona(text_prompt="", voice="TINYF0.pt"))
    assert prepared.prompt_steps == 37 + 12
    engine.start(0, prepared)
    out = engine.step(np.zeros((1, 1920), np.float32), np.array([True]))
    assert out.pcm.shape == (1, 1920) and np.isfinite(out.pcm).all()


def test_wrap_system_prompt():
    assert wrap_system_prompt("") == ""
    assert wrap_system_prompt(" Be nice. ") == "<system> Be nice. <system>"
    assert wrap_system_prompt("<system> Be nice. <system>") == "<system> Be nice. <system>"
