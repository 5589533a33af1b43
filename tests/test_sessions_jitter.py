"""The realtime input jitter buffer: late input must not add latency for the rest of a call.

Tick by tick here; over a whole call on fake time in test_scheduler_policies.py; for real in
bench/session_jitter.py."""

from __future__ import annotations

import numpy as np
import pytest

from personaplex_voice.engine.base import FRAME_SIZE, Persona
from personaplex_voice.engine.loopback import LoopbackEngine
from personaplex_voice.sessions import Session, SessionManager

pytestmark = pytest.mark.timeout(60)


def frame_of(k: int) -> np.ndarray:
    """Frame number k, recognisable in the echo: every sample is k / 1000."""
    return np.full(FRAME_SIZE, k / 1000.0, np.float32)


def frame_number(pcm: np.ndarray) -> int:
    return round(float(pcm[0]) * 1000)


def bare_session(**opts) -> tuple[SessionManager, Session]:
    """A session outside any tick loop, to drive the jitter buffer one tick at a time through
    its stream (what the inference thread sees of it). It is mid-call: no start burst is left to
    exempt (test_sessions_start_burst.py tests that)."""
    opts.setdefault("start_burst_s", 0.0)
    engine = LoopbackEngine(num_slots=1)
    manager = SessionManager(engine, realtime=True, **opts)
    return manager, Session(manager, engine.prepare(Persona()))


def queue(session: Session, *numbers: int) -> None:
    for k in numbers:
        session.record.stream.push(frame_of(k))


def tick(manager: SessionManager, session: Session) -> tuple[int | None, int]:
    """What one tick does to the session's input: (frame number taken or None, frames dropped)."""
    stream = session.record.stream
    frame = stream.take_frame()
    dropped = stream.trim_spare(manager.config.input_slack_frames, manager.config.input_settle_ticks)
    return (None if frame is None else frame_number(frame)), dropped


def test_spare_beyond_the_slack_goes_at_once_oldest_first_in_whole_frames():
    manager, session = bare_session(input_slack_s=0.16, input_settle_s=None)
    assert manager.config.input_slack_frames == 2
    queue(session, 1, 2, 3, 4, 5, 6)  # a burst after a stall: 5 spare frames after this tick
    session.record.stream.push(np.full(700, 0.007, np.float32))  # a partial frame: the client's phase
    assert tick(manager, session) == (1, 3)  # 2, 3, 4 dropped, 5 and 6 kept as cushion
    assert [tick(manager, session)[0] for _ in range(2)] == [5, 6]
    assert session.stats["input_backlog_samples"] == 700  # the partial frame is untouched
    stats = session.stats
    assert stats["jitter_dropped_frames"] == 3 and stats["dropped_input_samples"] == 3 * FRAME_SIZE


def test_unused_spare_goes_after_the_settle_time_and_used_spare_stays():
    manager, session = bare_session(input_slack_s=0.16, input_settle_s=0.4)
    assert manager.config.input_settle_ticks == 5
    queue(session, 0, 1)  # one late frame came after all: one spare frame from here on
    for k in range(2, 5):  # the spare frame stays queued through 3 ticks ...
        assert tick(manager, session) == (k - 2, 0)
        queue(session, k)
    assert tick(manager, session) == (3, 0)  # 4th tick; then the client is late once ...
    assert tick(manager, session) == (4, 0)  # ... and the cushion is used: the streak starts over
    queue(session, 5, 6)  # the late frame and the next one
    for k in range(7, 11):  # spare again, unused for 4 ticks: kept
        assert tick(manager, session) == (k - 2, 0)
        queue(session, k)
    assert tick(manager, session) == (9, 1)  # 5th tick in a row with spare unused: frame 10 goes
    queue(session, 11)
    assert tick(manager, session) == (11, 0)  # on time again: the next frame is the one just sent
    assert tick(manager, session) == (None, 0)
    assert session.stats["jitter_dropped_frames"] == 1


def test_late_wait_shrinks_to_what_the_engine_leaves_of_the_frame():
    manager = SessionManager(LoopbackEngine(num_slots=1), realtime=True)
    assert manager.scheduler.late_wait() == manager.config.late_wait_s == 0.020
    manager.scheduler.recent_steps.extend([0.010, 0.050])  # 72 ms usable, the slowest step 50 ms
    assert manager.scheduler.late_wait() == 0.020
    manager.scheduler.recent_steps.append(0.060)
    assert manager.scheduler.late_wait() == pytest.approx(0.012)
    manager.scheduler.recent_steps.append(0.090)  # the engine itself overruns: never wait for anyone
    assert manager.scheduler.late_wait() == 0.0


async def test_non_realtime_mode_never_trims(tmp_path):
    manager = SessionManager(LoopbackEngine(num_slots=1, delay_frames=0), realtime=False)
    try:
        session = await manager.open(Persona())
        await session.ready()
        x = np.concatenate([frame_of(k) for k in range(40)])  # 3.2 s queued at once
        session.push(x)
        session.end_input()
        out = [f async for f in session.frames()]
        np.testing.assert_array_equal(np.concatenate([f.pcm for f in out]), x)
        assert session.stats["jitter_dropped_frames"] == 0
    finally:
        await manager.shutdown()
