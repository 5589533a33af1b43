"""Per-slot independence: a golden run in slot 1 of a batch of 3 is unchanged by its neighbours."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support_engine import persona, reference_pieces, user_frames

from personaplex_voice.engine.base import FRAME_SIZE, Persona, Sampling
from personaplex_voice.engine.generator import PersonaPlexEngine, golden_like_files

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def expected(golden_dir):
    return np.load(golden_dir / "expected.npz")


def test_slot_unchanged_by_neighbours_resets_and_skips(golden_dir, expected):
    engine = PersonaPlexEngine(golden_like_files(golden_dir), num_slots=3)
    frames = user_frames(golden_dir)
    rng = np.random.default_rng(1)
    sampled = Persona(text_prompt="Talk about the weather.", voice="TINYF0.wav", sampling=Sampling(), seed=7)
    engine.start(0, engine.prepare(persona("service")))
    engine.start(1, engine.prepare(persona("pt_voice")))
    engine.start(2, engine.prepare(sampled))
    tokens, pcm, pieces = [], [], []
    for i, frame in enumerate(frames):
        if i == 35:  # slot 0 leaves and a new call takes its place mid-stream
            engine.release(0)
            engine.start(0, engine.prepare(Persona(text_prompt="", voice="TINYF0.pt", seed=3)))
        batch = np.stack(
            [rng.standard_normal(FRAME_SIZE).astype(np.float32) * 0.3, frame, frame[::-1].copy()]
        )
        active = np.array([True, True, i % 4 != 2])  # slot 2 skips some ticks
        out = engine.step(batch, active)
        tokens.append(engine.last_tokens[1].copy())
        pcm.append(out.pcm[1])
        pieces.append(out.text[1])
    np.testing.assert_array_equal(np.stack(tokens), expected["pt_voice__tokens"])
    np.testing.assert_allclose(np.concatenate(pcm), expected["pt_voice__pcm"], atol=1e-4, rtol=0)
    assert pieces == reference_pieces(expected["pt_voice__pieces"])


def test_sampling_is_seeded_per_slot(golden_dir):
    """Same persona and seed in two slots -> same sampled tokens, whatever the other slots do."""
    engine = PersonaPlexEngine(golden_like_files(golden_dir), num_slots=2)
    p = Persona(
        text_prompt="Hello.", voice="TINYF0.pt", sampling=Sampling(text_topk=5, audio_topk=20), seed=11
    )
    frames = user_frames(golden_dir)[:12]
    runs = []
    for slot in (0, 1):
        engine.start(slot, engine.prepare(p))
        active = np.zeros(2, bool)
        active[slot] = True
        rows = []
        for frame in frames:
            engine.step(np.stack([frame, frame]), active)
            rows.append(engine.last_tokens[slot].copy())
        runs.append(np.stack(rows))
    np.testing.assert_array_equal(runs[0], runs[1])
    engine.start(0, engine.prepare(Persona(text_prompt="Hello.", voice="TINYF0.pt", seed=12)))
    rows = []
    for frame in frames:
        engine.step(np.stack([frame, frame]), np.array([True, False]))
        rows.append(engine.last_tokens[0].copy())
    assert not np.array_equal(np.stack(rows), runs[0])  # another seed samples differently
