"""The scheduler's policies, on fake time: each run is the same run whatever the machine is doing.

The real `Scheduler.run` loop drives a loopback engine whose steps and prefill chunks cost what
each test sets (tests/support_scheduler.py); callers push frames at scheduled fake times. What
used to be measured here with wall clocks (joiners never delaying a running call, late input
not adding latency) is asserted exactly; bench/session_jitter.py measures it for real.
"""

from __future__ import annotations

import numpy as np
import pytest
from support_scheduler import (
    FakeClock,
    TimedEngine,
    caller,
    drain,
    fake_manager,
    join,
    long_persona,
    numbered,
    run_until,
)

from personaplex_voice.engine.base import CapacityError, Persona
from personaplex_voice.engine.scheduler import FRAME_SECONDS, PREFILL_STARVE_TICKS, SessionState

pytestmark = pytest.mark.timeout(60)

T0 = 100.0


def frame_numbers(frames: list[np.ndarray]) -> list[int]:
    return [round(float(f[0]) * 1000) for f in frames]


def test_prefill_chunks_fill_the_gaps_between_ticks_and_never_delay_one():
    """4 joins of 10-chunk prompts while a call streams: 2 chunks fit in each gap (30 ms step,
    20 ms chunks, 80 ms frames), every tick starts on its due time, every joiner gets in."""
    clock = FakeClock(T0)
    engine = TimedEngine(clock, step_s=0.030, chunk_s=0.020, num_slots=5)
    manager = fake_manager(clock, engine)
    call = join(manager)
    caller(clock, call, start=T0 + 0.05, frames=75)
    joiners = []
    clock.at(T0 + 0.5, lambda: joiners.extend(join(manager, long_persona(i)) for i in range(4)))
    ready_at: dict[int, float] = {}

    def note_ready() -> None:
        for i, joiner in enumerate(joiners):
            if joiner.ready_now and i not in ready_at:
                ready_at[i] = clock.now()

    for k in range(80):
        clock.at(T0 + 0.5 + 0.05 * k, note_ready)
    run_until(clock, manager, T0 + 6.0)

    ticks = engine.log.step_times(call.slot)
    assert len(ticks) == 75
    np.testing.assert_allclose(np.diff(ticks), FRAME_SECONDS, atol=1e-9)  # never a late tick
    due = ticks[0] + FRAME_SECONDS * np.arange(200)
    chunk_starts = [t for t, slot in engine.log.chunks if slot != call.slot]
    assert len(chunk_starts) == 4 * 10  # 612 prompt steps each, in chunks of 64
    for start in chunk_starts:  # each chunk ended before the tick after it was due
        next_due = due[np.searchsorted(due, start, side="right")]
        assert start + engine.chunk_s <= next_due + 1e-9, (start, next_due)
    assert sorted(ready_at) == [0, 1, 2, 3]
    assert max(ready_at.values()) <= T0 + 0.5 + 21 * FRAME_SECONDS  # 40 chunks, 2 a gap
    gaps_used = np.searchsorted(due, chunk_starts, side="right")
    assert np.bincount(gaps_used).max() == 2
    assert manager.metrics.late_frames.value == 0 and manager.metrics.tick_overruns.value == 0
    assert frame_numbers(drain(call))[-5:] == [71, 72, 73, 74, 75]


def test_joins_are_prefilled_oldest_first():
    clock = FakeClock(T0)
    engine = TimedEngine(clock, step_s=0.030, chunk_s=0.020, num_slots=3)
    manager = fake_manager(clock, engine)
    first, second = join(manager, long_persona(1, 200)), join(manager, long_persona(2, 200))
    run_until(clock, manager, T0 + 1.0)
    order = [slot for _, slot in engine.log.chunks]
    assert order == [first.slot] * 4 + [second.slot] * 4
    assert first.ready_now and second.ready_now


def test_a_prefill_is_slowed_by_a_full_frame_but_never_starved():
    """Steps that leave 2 ms of the frame: no chunk fits, so after PREFILL_STARVE_TICKS ticks a
    chunk runs anyway (the running call's next tick is late by one chunk, and the clock keeps
    its due times)."""
    clock = FakeClock(T0)
    engine = TimedEngine(clock, step_s=0.078, chunk_s=0.020, num_slots=2)
    manager = fake_manager(clock, engine)
    call = join(manager)
    caller(clock, call, start=T0 + 0.05, frames=40)
    joiner: list = []
    clock.at(T0 + 0.5, lambda: joiner.append(join(manager, long_persona(0, 100))))  # 2 chunks
    run_until(clock, manager, T0 + 3.5)

    assert joiner[0].ready_now
    chunk_starts = [t for t, slot in engine.log.chunks if slot == joiner[0].slot]
    ticks = engine.log.step_times(call.slot)
    ticks_between = ((ticks > chunk_starts[0]) & (ticks < chunk_starts[1])).sum()
    assert ticks_between == PREFILL_STARVE_TICKS
    gaps = np.diff(ticks)
    assert gaps.max() <= FRAME_SECONDS + engine.chunk_s + 1e-9
    assert abs(ticks[-1] - (ticks[0] + FRAME_SECONDS * (len(ticks) - 1))) < 0.03  # on its clock


def test_a_slot_is_released_before_its_next_holder_starts():
    """In one gap between ticks: B and then A leave, C arrives and takes A's slot. The engine
    sees release(1), release(0), start(0): C's prompt is never wiped by A's release."""
    clock = FakeClock(T0)
    engine = TimedEngine(clock, step_s=0.010, chunk_s=0.005, num_slots=2)
    manager = fake_manager(clock, engine)
    a, b = join(manager), join(manager)
    caller(clock, a, start=T0 + 0.05, frames=5)
    caller(clock, b, start=T0 + 0.05, frames=5)
    newcomer: list = []

    def swap() -> None:
        b.close_nowait()
        a.close_nowait()
        newcomer.append(join(manager))

    clock.at(T0 + 0.45, swap)
    clock.at(T0 + 0.5, lambda: caller(clock, newcomer[0], start=clock.now() + 0.01, frames=5))
    run_until(clock, manager, T0 + 1.5)

    assert newcomer[0].slot == 0
    slot0 = [call for call in engine.log.calls if call[1] == 0]
    assert slot0[:3] == [("start", 0), ("release", 0), ("start", 0)], engine.log.calls
    assert engine.log.calls.index(("release", 1)) < engine.log.calls.index(("release", 0))
    assert frame_numbers(drain(newcomer[0]))[:5] == [1, 2, 3, 4, 5]
    assert manager.metrics.engine_errors.value == 0


def test_queue_positions_follow_every_arrival_and_departure():
    clock = FakeClock(T0)
    engine = TimedEngine(clock, num_slots=1)
    manager = fake_manager(clock, engine, max_queue=3)
    running = join(manager)
    waiting = [join(manager) for _ in range(3)]
    assert running.slot == 0 and [s.queue_position for s in waiting] == [1, 2, 3]
    with pytest.raises(CapacityError, match="queue of 3 is full"):
        join(manager)
    waiting[1].close_nowait()
    assert [s.queue_position for s in waiting] == [1, None, 2]
    with pytest.raises(CapacityError):  # reservations never jump the queue
        manager.reserve(5.0)
    running.close_nowait()
    assert waiting[0].state is SessionState.JOINING and waiting[0].slot == 0
    assert waiting[0].queue_position is None and waiting[2].queue_position == 1
    assert manager.queued_count == 1 and manager.available == 0
    assert manager.metrics.sessions_rejected.values() == {"queue_full": 1.0, "reserve_full": 1.0}


def test_an_unredeemed_ticket_gives_its_slot_to_the_queue_when_it_expires():
    clock = FakeClock(T0)
    engine = TimedEngine(clock, num_slots=1)
    manager = fake_manager(clock, engine, max_queue=1)
    ticket = manager.reserve(2.0, Persona(text_prompt="reserved"))
    waiter = join(manager)
    seen: dict[str, object] = {}
    clock.at(T0 + 1.9, lambda: seen.update(before=(waiter.state, manager.reserved_count)))
    run_until(clock, manager, T0 + 3.0)
    assert seen["before"] == (SessionState.QUEUED, 1)
    assert waiter.ready_now and manager.reserved_count == 0
    assert manager.metrics.tickets.values() == {"issued": 1.0, "expired": 1.0}
    assert not manager.cancel(ticket.id)


def test_a_call_that_stops_sending_ends_idle_after_the_timeout():
    clock = FakeClock(T0)
    engine = TimedEngine(clock, num_slots=1)
    manager = fake_manager(clock, engine, idle_timeout_s=1.0)
    call = join(manager)
    caller(clock, call, start=T0 + 0.05, frames=5)  # the last push at T0 + 0.33
    states: dict[float, SessionState] = {}
    for t in (1.25, 1.45):
        clock.at(T0 + t, lambda t=t: states.update({t: call.state}))
    run_until(clock, manager, T0 + 2.0)
    assert states == {1.25: SessionState.RUNNING, 1.45: SessionState.CLOSED}
    assert call.close_reason == "idle"


def test_late_input_costs_silence_then_the_jitter_buffer_brings_the_latency_back():
    """Frames 10-12 arrive 250 ms late, at once: those ticks feed silence (late), the burst's
    spare frames are dropped, and the echo ends on the caller's latest frame (no lasting lag)."""
    clock = FakeClock(T0)
    engine = TimedEngine(clock, num_slots=1)
    manager = fake_manager(clock, engine)
    call = join(manager)
    stall = {10: 0.24, 11: 0.16, 12: 0.08}  # held back, then sent with frame 13
    caller(clock, call, start=T0 + 0.05, frames=40, late=stall)
    run_until(clock, manager, T0 + 0.05 + 39 * FRAME_SECONDS + 0.04)  # the 40th tick is the last
    stats = call.stats
    assert stats["late_frames"] == 3 and stats["jitter_dropped_frames"] == 3
    echoed = frame_numbers(drain(call))
    assert echoed[-1] == 40 and echoed.count(0) == 3  # three frames of silence, no lag at the end


def test_a_tick_waits_briefly_for_a_slightly_late_frame():
    """10 ms late is within the late wait (20 ms): taken, the tick a little later; 30 ms late is
    not: that tick feeds silence and the frame is used at the next one."""
    clock = FakeClock(T0)
    engine = TimedEngine(clock, num_slots=1, step_s=0.010)
    manager = fake_manager(clock, engine)
    call = join(manager)
    caller(clock, call, start=T0 + 0.05, frames=20, late={5: 0.020, 12: 0.040}, lead=0.01)
    run_until(clock, manager, T0 + 20 * FRAME_SECONDS + 0.1)
    ticks = engine.log.step_times(call.slot)
    lateness = ticks - (ticks[0] + FRAME_SECONDS * np.arange(len(ticks)))
    assert lateness[5] == pytest.approx(0.010) and lateness[12] == pytest.approx(0.020)
    assert np.abs(np.delete(lateness, [5, 12])).max() < 1e-9
    assert call.stats["late_frames"] == 1


def test_a_start_burst_is_caught_up_between_ticks_without_a_lost_frame():
    """0.72 s of caller audio pushed while the prompt is prefilled, then real time: the ticks
    take one frame each and catch-up steps (20 ms each, in the gaps) take the burst, so every
    frame is heard in order, none is trimmed, and the echo ends on the caller's latest frame."""
    clock = FakeClock(T0)
    engine = TimedEngine(clock, num_slots=1, step_s=0.020, chunk_s=0.100)  # a 0.1 s prefill
    manager = fake_manager(clock, engine)
    call = join(manager)
    loud = 0.1  # above the silence a catch-up step does not deliver (start_burst.worth_delivering)
    for k in range(9):  # the burst, during the prefill
        clock.at(T0 + 0.001 * (k + 1), lambda k=k: call.push(numbered(k + 1) + loud))
    caller_start = T0 + 0.2
    for k in range(9, 40):
        at = caller_start + (k - 9) * FRAME_SECONDS - 0.01
        clock.at(at, lambda k=k: call.push(numbered(k + 1) + loud))
    run_until(clock, manager, caller_start + 31 * FRAME_SECONDS + 0.05)
    stats = call.stats
    assert stats["jitter_dropped_frames"] == 0 and stats["dropped_input_samples"] == 0
    caught = stats["catchup_frames"]
    assert caught > 0 and manager.metrics.catchup_frames.value == caught
    assert stats["frames_in"] == 40 and len(engine.log.step_times(call.slot)) == 40  # ticks + catch-ups
    heard = [round((float(f[0]) - loud) * 1000) for f in drain(call)]
    assert heard == list(range(1, 41))  # every frame, in order, once
    assert stats["input_backlog_samples"] == 0  # the latency is back to nothing queued
    ticks = engine.log.step_times(call.slot)
    assert np.diff(ticks).min() >= 0.020 - 1e-9  # catch-up steps sat in gaps, one at a time
