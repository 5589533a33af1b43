"""The realtime input jitter buffer: late input must not add latency for the rest of a call."""

from __future__ import annotations

import asyncio

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
    """A session outside any tick loop, to drive the jitter buffer one tick at a time. It is
    mid-call: no start burst is left to exempt (test_sessions_start_burst.py tests that)."""
    opts.setdefault("start_burst_s", 0.0)
    engine = LoopbackEngine(num_slots=1)
    manager = SessionManager(engine, realtime=True, **opts)
    return manager, Session(manager, engine.prepare(Persona()))


def queue(session: Session, *numbers: int) -> None:
    for k in numbers:
        session._input.push(frame_of(k))


def tick(manager: SessionManager, session: Session) -> tuple[int | None, int]:
    """What one tick does to the session's input: (frame number taken or None, frames dropped)."""
    frame = session._take_frame()
    dropped = session._trim_spare(manager.input_slack_frames, manager.input_settle_ticks)
    return (None if frame is None else frame_number(frame)), dropped


def test_spare_beyond_the_slack_goes_at_once_oldest_first_in_whole_frames():
    manager, session = bare_session(input_slack_s=0.16, input_settle_s=None)
    assert manager.input_slack_frames == 2
    queue(session, 1, 2, 3, 4, 5, 6)  # a burst after a stall: 5 spare frames after this tick
    session._input.push(np.full(700, 0.007, np.float32))  # a partial frame: the client's phase
    assert tick(manager, session) == (1, 3)  # 2, 3, 4 dropped, 5 and 6 kept as cushion
    assert [tick(manager, session)[0] for _ in range(2)] == [5, 6]
    assert len(session._input) == 700  # the partial frame is untouched
    stats = session.stats
    assert stats["jitter_dropped_frames"] == 3 and stats["dropped_input_samples"] == 3 * FRAME_SIZE


def test_unused_spare_goes_after_the_settle_time_and_used_spare_stays():
    manager, session = bare_session(input_slack_s=0.16, input_settle_s=0.4)
    assert manager.input_settle_ticks == 5
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
    assert manager._scheduler.late_wait() == manager.late_wait_s == 0.020
    manager._scheduler.recent_steps.extend([0.010, 0.050])  # 72 ms usable, the slowest step 50 ms
    assert manager._scheduler.late_wait() == 0.020
    manager._scheduler.recent_steps.append(0.060)
    assert manager._scheduler.late_wait() == pytest.approx(0.012)
    manager._scheduler.recent_steps.append(0.090)  # the engine itself overruns: never wait for anyone
    assert manager._scheduler.late_wait() == 0.0


async def test_a_stalled_client_does_not_keep_its_delay_for_the_rest_of_the_call():
    """A client answering each echoed frame with its next one stalls for 4 frames, then sends
    them in a burst. Without a jitter buffer the burst stays queued: every later echo is 4
    frames late. With it the spare frames are dropped (slack at once, the rest after the settle
    time) and the echo comes back to the frame just sent."""
    engine = LoopbackEngine(num_slots=1, delay_frames=0)
    manager = SessionManager(
        engine, realtime=True, frame_period_s=0.04, late_wait_s=0.005, input_settle_s=0.4, idle_timeout_s=None
    )
    try:
        session = await manager.open(Persona())
        await asyncio.wait_for(session.ready(), 10)
        frames = session.frames()

        async def next_echo() -> int | None:
            """Frame number of the next output frame echoing input (None for silence)."""
            out = await asyncio.wait_for(frames.__anext__(), 5)
            return frame_number(out.pcm) if np.any(out.pcm) else None

        sent = 1  # frame 0 would be silence
        session.push(frame_of(sent))
        while await next_echo() is None:  # lead-in before the first frame
            pass
        for _ in range(5):  # lock step: each echo answered with the next frame
            sent += 1
            session.push(frame_of(sent))
            await next_echo()
        for _ in range(4):  # the stall: the ticks feed silence
            await next_echo()
        for _ in range(4):  # the stalled frames arrive at once, then lock step again
            sent += 1
            session.push(frame_of(sent))
        lags = []
        for _ in range(30):
            sent += 1
            session.push(frame_of(sent))
            echoed = await next_echo()
            if echoed is not None:
                lags.append(sent - echoed)
        assert session.stats["late_frames"] >= 4
        assert lags[0] >= 2, lags  # right after the burst the spare frames are still queued
        assert lags[-5:] == [0] * 5, lags  # and later the echo is on time again
        dropped = session.stats["jitter_dropped_frames"]
        assert dropped >= 4, session.stats
        assert manager.metrics.jitter_dropped_frames.value == dropped
        assert manager.metrics.snapshot()["jitter_dropped_frames_total"] == dropped
        assert manager.metrics.dropped_input_samples.value == dropped * FRAME_SIZE
        await session.close()
    finally:
        await manager.shutdown()


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
