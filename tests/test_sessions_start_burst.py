"""Audio before a session runs is kept, and a start burst is absorbed, not trimmed (issue 16).

The policy (`StartBurst`) and the session's side of it are driven one tick at a time, as the
scheduler drives them; the manager-level tests check the same on the real inference thread with
the loopback engine, asserting what was kept and in which order, never how fast.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from support_sessions import collect, wait_until

from personaplex_voice.engine.base import FRAME_SIZE, Persona, StepOutput
from personaplex_voice.engine.loopback import LoopbackEngine
from personaplex_voice.engine.start_burst import StartBurst, worth_delivering
from personaplex_voice.sessions import Session, SessionManager

pytestmark = pytest.mark.timeout(60)


def frame_of(k: int) -> np.ndarray:
    """Frame number k, recognisable in the echo (and loud enough to be worth delivering from a
    catch-up step): every sample is 0.1 + k / 1000."""
    return np.full(FRAME_SIZE, 0.1 + k / 1000.0, np.float32)


def numbers(pcm: np.ndarray) -> list[int]:
    return [round(float(pcm[i]) * 1000) - 100 for i in range(0, len(pcm), FRAME_SIZE)]


# -- the policy alone ----------------------------------------------------------------------------


def test_a_burst_in_the_window_is_exempt_up_to_its_limit_and_taken_one_by_one():
    burst = StartBurst(limit_frames=5, window_ticks=3)
    assert burst.after_tick(0) == 0  # nothing queued yet (the client flushes a moment later)
    assert burst.after_tick(7) == 5  # the burst arrived: 5 exempt, 2 are the jitter buffer's
    assert [burst.take() for _ in range(6)] == [True] * 5 + [False]
    assert burst.after_tick(2) == 0  # the allowance is used up


def test_after_the_window_the_allowance_only_shrinks_to_what_is_queued():
    burst = StartBurst(limit_frames=12, window_ticks=2)
    assert [burst.after_tick(0) for _ in range(2)] == [0, 0]
    assert burst.after_tick(0) == 0  # window over, nothing queued: nothing is owed any more
    assert burst.after_tick(4) == 0  # later late-and-arrived input is the jitter buffer's
    kept = StartBurst(limit_frames=12, window_ticks=1)
    assert kept.after_tick(6) == 6 and kept.after_tick(6) == 6  # not caught up (no budget): kept
    assert kept.after_tick(3) == 3 and kept.after_tick(5) == 3  # shrinks with the queue, never grows


# -- one session, tick by tick -------------------------------------------------------------------


def bare_session(**opts) -> tuple[SessionManager, Session]:
    engine = LoopbackEngine(num_slots=1)
    manager = SessionManager(engine, realtime=True, **opts)
    return manager, Session(manager, engine.prepare(Persona()))


def run_ticks(manager: SessionManager, session: Session, pushes: list[list[int]], catch_up: bool = True):
    """Each tick as the scheduler runs it: the pushes that came before it, the tick's frame, the
    jitter buffer, then catch-up steps while owed. Returns (frame numbers consumed in order,
    frames dropped, frames caught up)."""
    consumed: list[int] = []
    dropped = caught = 0
    for before in pushes:
        for k in before:
            session.push(frame_of(k))
        stream = session.record.stream
        frame = stream.take_frame()
        if frame is not None:
            consumed.append(numbers(frame)[0])
        dropped += stream.trim_spare(manager.config.input_slack_frames, manager.config.input_settle_ticks)
        while catch_up and stream.catchup_due():
            extra = stream.take_catchup_frame()
            assert extra is not None
            consumed.append(numbers(extra)[0])
            caught += 1
    return consumed, dropped, caught


def test_a_queued_burst_then_real_time_input_loses_nothing():
    manager, session = bare_session()  # 1 s of start burst allowed, the default
    burst = list(range(9))  # 0.72 s queued while the client connected
    pushes = [burst] + [[k] for k in range(9, 60)]  # then one frame per tick, in real time
    consumed, dropped, caught = run_ticks(manager, session, pushes)
    assert consumed == list(range(60))  # every frame, in order
    assert dropped == 0 and session.stats["jitter_dropped_frames"] == 0
    assert caught == 8 and session.stats["catchup_frames"] == 8
    assert session.stats["input_backlog_samples"] == 0  # the latency is back to nothing queued


def test_without_room_for_catch_up_the_burst_is_kept_not_trimmed():
    manager, session = bare_session()
    pushes = [list(range(9))] + [[k] for k in range(9, 40)]
    consumed, dropped, caught = run_ticks(manager, session, pushes, catch_up=False)
    assert dropped == 0 and caught == 0
    assert consumed == list(range(32))  # one a tick: the burst stays as latency, every word kept
    assert session.stats["input_backlog_samples"] // FRAME_SIZE == 8


def test_sustained_faster_than_real_time_input_is_trimmed_once_the_allowance_is_spent():
    manager, session = bare_session(start_burst_s=0.48)  # 6 frames of allowance
    assert manager.config.start_burst_frames == 6
    pushes = [[2 * t, 2 * t + 1] for t in range(30)]  # twice real time for 30 ticks
    consumed, dropped, caught = run_ticks(manager, session, pushes)
    assert caught == 6
    assert dropped == 60 - len(consumed) - session.stats["input_backlog_samples"] // FRAME_SIZE > 0
    assert session.stats["jitter_dropped_frames"] == dropped
    assert session.stats["input_backlog_samples"] // FRAME_SIZE <= manager.config.input_slack_frames


def test_non_realtime_managers_have_no_start_burst():
    assert SessionManager(LoopbackEngine(num_slots=1), realtime=False).config.start_burst_frames == 0


# -- the real inference thread -------------------------------------------------------------------


async def test_audio_pushed_before_ready_is_kept_in_order(manager_factory):
    manager = manager_factory(LoopbackEngine(num_slots=1, prefill_s=0.05), realtime=True)
    session = await manager.open(Persona())
    for k in range(1, 10):  # 0.72 s while the prompt is prefilled
        session.push(frame_of(k))
    assert session.stats["input_backlog_samples"] == 9 * FRAME_SIZE
    await session.ready()
    await wait_until(lambda: session.stats["frames_out"] >= 1)  # it runs: the burst is owed
    for k in range(10, 13):  # 12 frames in all: within the 1 s a session keeps
        session.push(frame_of(k))
    session.end_input()
    out = await collect(session)
    echoed = numbers(np.concatenate([f.pcm for f in out]))
    assert echoed[1:12] == list(range(1, 12))  # the loopback answers one frame late
    stats = session.stats
    assert stats["dropped_pre_ready_samples"] == stats["dropped_input_samples"] == 0
    assert stats["jitter_dropped_frames"] == 0 and stats["late_frames"] == 0
    assert stats["catchup_frames"] > 0  # the echo engine's steps leave room: the burst is caught up
    assert manager.metrics.catchup_frames.value == stats["catchup_frames"]


async def test_audio_before_ready_beyond_the_input_bound_drops_the_oldest_counted(manager_factory):
    manager = manager_factory(LoopbackEngine(num_slots=1, prefill_s=0.05), realtime=True, max_input_s=0.48)
    session = await manager.open(Persona())
    for k in range(1, 11):
        session.push(frame_of(k))
    await session.ready()
    session.end_input()
    out = await collect(session)
    # the newest 6 were kept: 5..10 went in (the echo of 10 would need one more step)
    assert session.stats["frames_in"] == 6
    assert numbers(np.concatenate([f.pcm for f in out]))[1:6] == list(range(5, 10))
    assert session.stats["dropped_pre_ready_samples"] == 4 * FRAME_SIZE
    assert manager.metrics.dropped_input_samples.value == 4 * FRAME_SIZE


class SlowEcho(LoopbackEngine):
    """A loopback whose step takes most of the frame period: no catch-up step can ever fit."""

    def step(self, pcm: np.ndarray, active: np.ndarray) -> StepOutput:
        time.sleep(0.06)
        return super().step(pcm, active)


async def test_an_engine_without_room_keeps_the_burst_and_plays_it_out(manager_factory):
    manager = manager_factory(SlowEcho(num_slots=1, prefill_s=0.05), realtime=True)
    session = await manager.open(Persona())
    for k in range(1, 10):
        session.push(frame_of(k))
    await session.ready()
    session.end_input()
    out = await collect(session)
    assert numbers(np.concatenate([f.pcm for f in out]))[1:9] == list(range(1, 9))
    assert session.stats["catchup_frames"] == 0 and session.stats["jitter_dropped_frames"] == 0


def test_only_catch_up_output_worth_hearing_is_delivered():
    quiet = np.full(FRAME_SIZE, 0.003, np.float32)  # -50 dBFS: the model's silence
    assert not worth_delivering(quiet, None) and worth_delivering(quiet, " hi")
    assert worth_delivering(np.full(FRAME_SIZE, 0.01, np.float32), None)  # -40 dBFS: sound


async def test_the_silence_a_catch_up_step_makes_is_not_delivered(manager_factory):
    """A caller whose line was silent while the prompt was prefilled (a phone line sends its
    silence too): catching that up would only give a just-in-time transport lasting delay."""
    manager = manager_factory(LoopbackEngine(num_slots=1, prefill_s=0.05), realtime=True)
    session = await manager.open(Persona())
    for _ in range(6):
        session.push(np.zeros(FRAME_SIZE, np.float32))
    for k in range(1, 4):
        session.push(frame_of(k))
    await session.ready()
    await wait_until(lambda: session.stats["catchup_frames"] >= 8)
    session.end_input()
    out = await collect(session)
    echoed = numbers(np.concatenate([f.pcm for f in out]))
    assert [k for k in echoed if k > 0][:2] == [1, 2]  # what the caller said, in order
    skipped = manager.metrics.catchup_silent_frames.value
    assert skipped >= 5  # the echoes of the line's silence, caught up, were not delivered
    stats = session.stats
    steps = stats["frames_in"] + stats["late_frames"] + stats["lead_in_frames"]
    assert stats["frames_in"] == 9 and len(out) + skipped == steps  # every other step delivered


def test_a_clients_own_piece_cushion_is_neither_caught_up_nor_trimmed():
    """Input in 100 ms pieces (a carrier's messages) leaves a whole frame queued after some ticks,
    which the next tick takes before the next piece comes: `expect_input_pieces` keeps that one
    frame out of the start burst (and the jitter buffer); frames beyond it are a burst as ever."""
    manager, session = bare_session()
    session.expect_input_pieces(0.1)  # 2400 samples: one frame of its own cushion
    consumed, dropped, caught = run_ticks(manager, session, [[0, 1, 2]] + [[k] for k in range(3, 30)])
    assert consumed == list(range(29)) and dropped == 0
    assert caught == 1  # of the two spare frames after the first tick, one was the burst
    assert session.stats["input_backlog_samples"] // FRAME_SIZE == 1  # the cushion stays
    # Without being told, both spare frames are caught up: the cushion is gone.
    manager, plain = bare_session()
    _, _, caught = run_ticks(manager, plain, [[0, 1, 2]] + [[k] for k in range(3, 30)])
    assert caught == 2 and plain.stats["input_backlog_samples"] == 0
    # Frame-sized pieces (or nothing said) keep the default: no cushion of the client's own.
    manager, framed = bare_session()
    framed.expect_input_pieces(0.08)
    _, _, caught = run_ticks(manager, framed, [[0, 1, 2]] + [[k] for k in range(3, 30)])
    assert caught == 2
