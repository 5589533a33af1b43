"""LoopbackEngine: the numpy-only echo that implements the engine contract."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from personaplex_voice.engine.base import FRAME_SIZE, EngineError, Persona, PersonaError
from personaplex_voice.engine.loopback import LoopbackEngine


def frames(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (n, FRAME_SIZE)).astype(np.float32)


def test_loopback_and_sessions_import_without_torch():
    code = (
        "import sys; import personaplex_voice.engine.loopback, personaplex_voice.sessions; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_voices_and_prepare():
    engine = LoopbackEngine(num_slots=2)
    for method in ("voices", "prepare", "start", "snapshot", "restore", "step", "release"):
        assert callable(getattr(engine, method))
    names = [v.name for v in engine.voices()]
    assert len(names) >= 2
    prepared = engine.prepare(Persona(text_prompt="be nice", voice=names[1] + ".pt"))
    assert prepared.cache_key == engine.prepare(Persona(text_prompt="be nice", voice=names[1])).cache_key
    assert prepared.cache_key != engine.prepare(Persona(text_prompt="be nice", voice=names[0])).cache_key
    assert prepared.prompt_steps > 0
    with pytest.raises(PersonaError, match="unknown voice"):
        engine.prepare(Persona(voice="NOPE"))
    with pytest.raises(PersonaError, match="too long"):
        engine.prepare(Persona(text_prompt="x" * 10_000))


def test_echo_per_slot_with_delay_and_mask():
    engine = LoopbackEngine(num_slots=3, delay_frames=2)
    for slot in range(3):
        engine.start(slot, engine.prepare(Persona()))
    inputs = frames(6, seed=1)
    active = np.array([True, False, True])
    outs = []
    for k in range(6):
        pcm = np.stack([inputs[k], np.zeros(FRAME_SIZE, np.float32), -inputs[k]])
        out = engine.step(pcm, active if k != 3 else np.array([True, True, False]))
        outs.append(out.pcm.copy())
    # slot 0: active every step, so output k = input k-2
    np.testing.assert_array_equal(outs[0][0], 0)
    np.testing.assert_array_equal(outs[1][0], 0)
    for k in range(2, 6):
        np.testing.assert_array_equal(outs[k][0], inputs[k - 2])
    # slot 2 skipped step 3: its delay line did not move, so step 4 returns input 1 (not 2)
    np.testing.assert_array_equal(outs[2][2], -inputs[0])
    np.testing.assert_array_equal(outs[4][2], -inputs[1])
    np.testing.assert_array_equal(outs[5][2], -inputs[2])
    with pytest.raises(EngineError):
        engine.step(np.zeros((2, FRAME_SIZE), np.float32), np.ones(2, bool))


def test_text_pieces_cycle_from_each_slots_start():
    engine = LoopbackEngine(num_slots=2, delay_frames=0, text_pieces=["Hel", "lo", None])
    engine.start(0, engine.prepare(Persona()))
    pcm = np.zeros((2, FRAME_SIZE), np.float32)
    texts = [engine.step(pcm, np.array([True, False])).text[0] for _ in range(2)]
    engine.start(1, engine.prepare(Persona()))
    both = [engine.step(pcm, np.array([True, True])).text for _ in range(4)]
    assert texts == ["Hel", "lo"]
    assert [t[0] for t in both] == [None, "Hel", "lo", None]
    assert [t[1] for t in both] == ["Hel", "lo", None, "Hel"]


def test_snapshot_restore_behaves_like_start_and_prefill_delay():
    engine = LoopbackEngine(num_slots=2, delay_frames=1, prefill_s=0.05)
    prepared = engine.prepare(Persona(text_prompt="p"))
    t0 = time.perf_counter()
    engine.start(0, prepared)
    assert time.perf_counter() - t0 >= 0.05
    snap = engine.snapshot(0)
    assert snap.nbytes == FRAME_SIZE * 4
    engine.step(frames(2, seed=2), np.array([True, False]))  # dirty slot 0 after the snapshot
    t0 = time.perf_counter()
    engine.restore(1, snap, prepared)
    engine.restore(0, snap, prepared)
    assert (engine.starts, engine.restores) == (1, 2)
    inputs = frames(2, seed=3)
    out = engine.step(inputs, np.array([True, True])).pcm
    np.testing.assert_array_equal(out, 0)  # both fresh: the delay line is silent
    out = engine.step(inputs, np.array([True, True])).pcm
    np.testing.assert_array_equal(out, inputs)
    engine.release(0)
    assert not engine.slot_in_use(0) and engine.slot_in_use(1)
    with pytest.raises(EngineError):
        engine.snapshot(0)
