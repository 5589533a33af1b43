"""Utterance cutting and playout pacing of the Pipecat service (pure logic, no pipeline)."""

from __future__ import annotations

import numpy as np
import pytest
from personaplex_pipecat.utterance_playout import (
    Edge,
    PlayoutGate,
    UtteranceTracker,
    level_db,
)

LOUD = np.full(1920, 0.1, np.float32)  # -20 dBFS
QUIET = np.full(1920, 0.001, np.float32)  # -60 dBFS


def test_level_db() -> None:
    assert level_db(LOUD) == pytest.approx(-20.0, abs=0.01)
    assert level_db(np.zeros(1920, np.float32)) == -120.0
    assert level_db(np.zeros(0, np.float32)) == -120.0


def test_utterance_starts_on_speech_and_ends_after_hangover() -> None:
    tracker = UtteranceTracker(threshold_db=-45.0, hangover_frames=3)
    edges = [tracker.update(QUIET), tracker.update(LOUD), tracker.update(QUIET), tracker.update(LOUD)]
    assert edges == [Edge.NONE, Edge.STARTED, Edge.CONTINUED, Edge.CONTINUED]
    # a pause shorter than the hangover stays inside; three quiet frames end it
    edges = [tracker.update(QUIET) for _ in range(3)]
    assert edges == [Edge.CONTINUED, Edge.CONTINUED, Edge.ENDED]
    assert not tracker.speaking
    assert tracker.update(QUIET) is Edge.NONE


def test_text_pieces_keep_an_utterance_open() -> None:
    tracker = UtteranceTracker(threshold_db=-45.0, hangover_frames=2)
    assert tracker.update(QUIET, " hello") is Edge.STARTED  # quiet audio with a word: speech
    assert tracker.update(QUIET) is Edge.CONTINUED
    assert tracker.update(None, " there") is Edge.CONTINUED  # text on its own (remote) resets the run
    assert tracker.update(QUIET) is Edge.CONTINUED
    assert tracker.update(QUIET) is Edge.ENDED
    assert tracker.update(None, None) is Edge.NONE


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_playout_gate_keeps_one_frame_ahead() -> None:
    clock = FakeClock()
    gate = PlayoutGate(0.08, clock=clock)
    # steady real-time delivery: everything passes
    for _ in range(10):
        assert gate.admit(0.08)
        clock.now += 0.08
    # a burst of four frames at once: one plays, one waits, the rest are dropped
    assert [gate.admit(0.08) for _ in range(4)] == [True, True, False, False]
    assert gate.dropped == 2
    assert gate.backlog_s() == pytest.approx(0.16)
    clock.now += 0.16  # played out: delivery resumes
    assert gate.admit(0.08)
    gate.reset()
    assert gate.backlog_s() == 0.0


def test_playout_gate_off() -> None:
    gate = PlayoutGate(None, clock=FakeClock())
    assert all(gate.admit(0.08) for _ in range(50))
