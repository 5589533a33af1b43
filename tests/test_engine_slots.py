"""Slot state: snapshot/restore (persona cache) and long calls past the LM context."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support_engine import files_for, other_config, persona, user_frames, write_model_dir

from personaplex_voice.engine.base import FRAME_SIZE, Persona, Sampling, SlotSnapshot
from personaplex_voice.engine.generator import PersonaPlexEngine, golden_like_files

torch.set_num_threads(1)


def test_restore_into_another_slot_gives_identical_outputs(golden_dir):
    expected = np.load(golden_dir / "expected.npz")
    engine = PersonaPlexEngine(golden_like_files(golden_dir), num_slots=3)
    prepared = engine.prepare(persona("pt_voice"))
    engine.start(0, prepared)
    snap = engine.snapshot(0)
    assert isinstance(snap, SlotSnapshot)
    full = sum(v[0].numel() * v.element_size() for v in engine.lm_state.values())
    assert 0 < snap.nbytes < full  # only the prompt's KV entries are kept
    engine.start(1, engine.prepare(persona("service")))  # something else first in slot 2's place
    engine.restore(2, snap, prepared)
    frames = user_frames(golden_dir)[:30]
    rows0, rows2 = [], []
    for frame in frames:
        out = engine.step(np.stack([frame, frame[::-1].copy(), frame]), np.array([True, True, True]))
        rows0.append(engine.last_tokens[0].copy())
        rows2.append(engine.last_tokens[2].copy())
        np.testing.assert_array_equal(out.pcm[0], out.pcm[2])
    np.testing.assert_array_equal(np.stack(rows0), np.stack(rows2))
    np.testing.assert_array_equal(np.stack(rows2), expected["pt_voice__tokens"][:30])


@pytest.fixture(scope="module")
def small_context_dir(golden_dir, tmp_path_factory):
    cfg = other_config(golden_dir, lm_context=100)
    return write_model_dir(golden_dir, tmp_path_factory.mktemp("small_ctx"), cfg, seed=1)


def test_long_call_ring_modes(small_context_dir):
    """Both modes run past the context; identical until the ring is full; the kept-prompt mode
    still attends to the prompt's entries afterwards, the default mode has let them go."""
    files = files_for(small_context_dir)
    rolling = PersonaPlexEngine(files, num_slots=1, capture_logits=True)
    kept = PersonaPlexEngine(files, num_slots=1, capture_logits=True, keep_prompt=True)
    p = Persona(text_prompt="Be kind.", voice="V0", sampling=Sampling(greedy=True))
    prepared = rolling.prepare(p)
    prompt_runs = prepared.payload.model_runs
    rolling.start(0, prepared)
    kept.start(0, kept.prepare(p))
    context = files.config.lm.context
    full_at = context - prompt_runs - 1  # user step whose write fills the ring
    rng = np.random.default_rng(0)
    diverged = False
    for j in range(full_at + 20):
        frame = (rng.standard_normal((1, FRAME_SIZE)) * 0.2).astype(np.float32)
        a = rolling.step(frame, np.array([True]))
        b = kept.step(frame, np.array([True]))
        assert np.isfinite(a.pcm).all() and np.isfinite(b.pcm).all()
        same = np.array_equal(rolling.last_text_logits, kept.last_text_logits)
        if j < full_at:
            assert same, f"modes differ at step {j}, before the ring is full"
        elif not same:
            diverged = True
    assert diverged
    end = int(rolling.lm_state["transformer:pos"][0])
    assert end == prompt_runs + full_at + 20 > context
    prompt_positions = set(range(prompt_runs))
    assert prompt_positions <= set(kept.lm_state["transformer:kpos"][0].tolist())
    gone = set(range(end - context))  # the oldest prompt positions have left the rolling ring
    assert gone and gone < prompt_positions
    assert not gone & set(rolling.lm_state["transformer:kpos"][0].tolist())


def test_prompt_longer_than_the_context_is_refused(small_context_dir):
    from personaplex_voice.engine.base import PersonaError

    engine = PersonaPlexEngine(files_for(small_context_dir), num_slots=1)
    with pytest.raises(PersonaError, match="too long"):
        engine.prepare(Persona(text_prompt="word " * 200, voice="V0"))


def test_kept_prompt_survives_snapshot_and_restore(small_context_dir):
    engine = PersonaPlexEngine(files_for(small_context_dir), num_slots=2, keep_prompt=True)
    prepared = engine.prepare(Persona(text_prompt="Be kind.", voice="V0", sampling=Sampling(greedy=True)))
    engine.start(0, prepared)
    engine.restore(1, engine.snapshot(0), prepared)
    assert engine.lm_state["transformer:pin"].tolist() == [prepared.payload.model_runs] * 2
    rng = np.random.default_rng(2)
    for _ in range(60):  # past the context of 100
        frame = (rng.standard_normal(FRAME_SIZE) * 0.2).astype(np.float32)
        engine.step(np.stack([frame, frame]), np.array([True, True]))
        np.testing.assert_array_equal(engine.last_tokens[0], engine.last_tokens[1])
