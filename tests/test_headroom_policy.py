"""The saturation policy, deterministically: fake time, made-up load signals (engine/headroom.py).

Saturation starts when a signal stays over its enter level for its hold time, and ends only once
every signal stayed under its exit level for `exit_hold_s` (hysteresis in level and in time);
while saturated, and while the calls admitted lately would take the loop over its enter level,
new calls are refused; below the thresholds nothing is ever refused. Then the same policy as the
embedded host applies it: `open` and `reserve` raise SaturatedError, `/readyz`'s body says
`saturated`, the sessions waiting in the queue are shed (close reason `saturated`), and a
ticket's call (admitted before) still gets its slot.
"""

from __future__ import annotations

import numpy as np
import pytest
from support_scheduler import FakeClock, TimedEngine, caller, fake_manager, join, run_until

from personaplex_voice.engine.base import CapacityError, Persona, SaturatedError
from personaplex_voice.engine.headroom import (
    EngineLoad,
    Headroom,
    HeadroomConfig,
    SaturationPolicy,
    Signals,
)
from personaplex_voice.metrics import values_of

T0 = 1000.0
CONFIG = HeadroomConfig()


def run(policy: SaturationPolicy, start: float, end: float, signals: Signals, step: float = 0.25) -> list:
    """Evaluate `signals` every `step` s over [start, end): the verdicts."""
    verdicts = []
    t = start
    while t < end - 1e-9:
        verdicts.append((t, policy.update(t, signals)))
        t = round(t + step, 6)
    return verdicts


def test_nothing_is_refused_below_the_enter_levels():
    """Every signal just under its enter level (the loop with room for one more call: 0.60 +
    0.015 for the next < 0.70), for a minute: nobody is refused."""
    policy = SaturationPolicy(CONFIG)
    near = Signals(loop_lag_s=0.019, loop_load=0.60, step_load=0.84, overruns=1, late_share=0.49, active=40)
    for _, verdict in run(policy, T0, T0 + 60, near):
        assert not verdict.saturated and not verdict.refusing
    assert policy.update(T0 + 60, Signals()).refusing is False  # nothing measured: nothing refused


def test_saturation_needs_its_hold_then_refuses_until_every_signal_is_calm_for_the_exit_hold():
    policy = SaturationPolicy(CONFIG)
    hot = Signals(loop_load=0.80, active=50)
    assert not policy.update(T0, hot).saturated
    assert not policy.update(T0 + 0.25, hot).saturated  # over, but not for loop_load_hold_s yet
    verdict = policy.update(T0 + CONFIG.loop_load_hold_s, hot)
    assert verdict.saturated and verdict.refusing and verdict.reasons == ("loop_load",)

    # Between the exit and the enter level: still saturated, however long (hysteresis in level).
    warm = Signals(loop_load=0.60, active=50)
    assert all(v.refusing for _, v in run(policy, T0 + 1, T0 + 30, warm))

    # Under the exit level: saturated until it has been so for exit_hold_s (hysteresis in time),
    # and a moment back over the exit level starts that count again.
    calm = Signals(loop_load=0.50, active=50)
    assert all(v.saturated for _, v in run(policy, T0 + 30, T0 + 32, calm))
    assert policy.update(T0 + 32, warm).saturated
    verdicts = run(policy, T0 + 32.25, T0 + 32.25 + CONFIG.exit_hold_s + 0.5, calm)
    saturated_until = max(t for t, v in verdicts if v.saturated)
    assert saturated_until == pytest.approx(T0 + 32.25 + CONFIG.exit_hold_s - 0.25)
    assert not verdicts[-1][1].refusing and verdicts[-1][1].reasons == ()


def test_each_signal_saturates_on_its_own_level_and_hold():
    cases = [
        ("loop_lag", Signals(loop_lag_s=0.045), CONFIG.loop_lag_hold_s),
        ("step_load", Signals(step_load=0.95), CONFIG.step_load_hold_s),
        ("overruns", Signals(overruns=CONFIG.overruns_enter), 0.0),
        ("stalls", Signals(stalls=CONFIG.stalls_enter), 0.0),
    ]
    for name, signals, hold in cases:
        policy = SaturationPolicy(CONFIG)
        if hold:
            assert not policy.update(T0, signals).saturated, name
            assert not policy.update(T0 + hold - 0.01, signals).saturated, name
        verdict = policy.update(T0 + hold, signals)
        assert verdict.saturated and verdict.reasons == (name,), name


def test_how_late_callers_send_never_saturates():
    """Every streaming session fed late silence (its caller's audio came late, or in bursts)
    for a minute: the callers' loss, counted per call; nobody else is refused for it."""
    policy = SaturationPolicy(CONFIG)
    late = Signals(loop_lag_s=0.001, loop_load=0.05, step_load=0.1, late_share=1.0, active=50)
    assert not any(v.refusing for _, v in run(policy, T0, T0 + 60, late))


def test_a_short_spike_does_not_saturate():
    """A lag spike shorter than its hold (a collection, a neighbour's burst) refuses nobody."""
    policy = SaturationPolicy(CONFIG)
    spike = Signals(loop_lag_s=0.200, loop_load=0.3, active=10)
    quiet = Signals(loop_lag_s=0.004, loop_load=0.3, active=10)
    verdicts = run(policy, T0, T0 + 0.75, spike) + run(policy, T0 + 0.75, T0 + 5, quiet)
    assert not any(v.refusing for _, v in verdicts)


def test_admission_counts_the_calls_taken_on_lately_at_what_a_call_costs():
    """40 calls cost 0.40 of the loop above an idle 0.05: 0.01 each. Calls taken on within
    settle_s (the call count's growth) are not in the measured load yet, so each counts at
    0.01; a call is admitted while it fits under the enter level (0.70) with them: 24 (0.45 +
    25 x 0.01 would reach it). Then the state is refusing, not saturated; once they settled
    (their load measured: here it did not grow) the projection is the measurement again."""
    policy = SaturationPolicy(CONFIG)
    policy.update(T0, Signals(loop_load=0.05, active=0))  # the idle loop
    t = T0 + 3
    policy.update(t, Signals(loop_load=0.45, active=40))
    admitted = 0
    while not policy.update(t, Signals(loop_load=0.45, active=40 + admitted)).refusing and admitted < 100:
        admitted += 1
        t += 0.01
    assert admitted == 24
    verdict = policy.verdict
    assert verdict.refusing and not verdict.saturated and verdict.why == "loop_load (projected)"
    assert verdict.projected_load == pytest.approx(0.45 + 24 * 0.01)
    later = policy.update(t + CONFIG.settle_s + 0.1, Signals(loop_load=0.45, active=64))
    assert not later.refusing and later.projected_load == pytest.approx(0.45)


def test_a_churn_of_short_calls_is_not_taken_for_growth():
    """Sessions that come and go (three at a time, each a moment long) load the loop, and that
    load is measured: it is not counted again as calls on their way, nor taken as what one
    more call costs beyond max_call_load."""
    policy = SaturationPolicy(CONFIG)
    policy.update(T0, Signals(loop_load=0.02, active=0))
    t = T0 + 1
    for k in range(200):
        verdict = policy.update(t, Signals(loop_load=0.50, active=2 + k % 2))
        t += 0.05
    assert not verdict.refusing
    assert verdict.projected_load <= 0.50 + CONFIG.max_call_load + 1e-9


def test_calls_whose_media_path_is_heavy_count_at_what_it_costs():
    """Two calls whose media path alone takes 0.25 of the wall clock each: one more would
    take the loop to 0.75; the per-call cap is for load the calls do not account for."""
    policy = SaturationPolicy(CONFIG)
    policy.update(T0, Signals(loop_load=0.01, active=0))
    assert not policy.update(T0 + 5, Signals(loop_load=0.26, active=1, media_load=0.25)).refusing
    assert policy.update(T0 + 10, Signals(loop_load=0.51, active=2, media_load=0.50)).refusing


def test_a_fresh_process_bounds_a_connection_storm():
    """No call measured yet: each admission counts at least FIRST_CALL_LOAD, so a storm of opens
    on an idle process is cut at the enter level rather than all admitted before any load shows."""
    policy = SaturationPolicy(CONFIG)
    admitted = 0
    while not policy.update(T0, Signals(loop_load=0.02, active=admitted)).refusing and admitted < 1000:
        admitted += 1
    assert admitted == 67  # 0.02 + 68 x 0.01 would reach 0.70


def test_a_disabled_policy_never_refuses():
    policy = SaturationPolicy(HeadroomConfig(enabled=False))
    for _, verdict in run(
        policy, T0, T0 + 10, Signals(loop_lag_s=1.0, loop_load=1.0, step_load=5.0, overruns=9)
    ):
        assert not verdict.refusing


def test_levels_must_have_room_for_hysteresis():
    with pytest.raises(ValueError, match="loop_load"):
        HeadroomConfig(loop_load_enter=0.5, loop_load_exit=0.6)


# -- the owner: samples in, SaturatedError out ----------------------------------------------------


class FakeTime:
    def __init__(self, t: float = T0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_the_headroom_turns_loop_samples_and_media_time_into_refusals():
    """Loop samples every 50 ms (lag, the thread's CPU share) and media-path time: the load is
    the larger of the CPU share and the media path's wall time (a handler blocked in a syscall
    holds the loop without using the CPU); check() raises SaturatedError while refusing, and
    the listeners hear each change of state once."""
    now = FakeTime()
    changes: list[bool] = []
    headroom = Headroom(HeadroomConfig(exit_hold_s=1.0), now=now, active=lambda: 8)
    headroom.on_change(lambda saturated, verdict: changes.append(saturated))
    meter = headroom.meter()

    def loop_for(seconds: float, lag: float, cpu: float, media_per_sample: float) -> None:
        for _ in range(round(seconds / 0.05)):
            now.t += 0.05
            meter.add(media_per_sample)
            headroom.note_loop(lag, cpu)
            headroom.evaluate()

    loop_for(2.0, lag=0.002, cpu=0.10, media_per_sample=0.005)  # media 10 % of the wall clock
    assert not headroom.refusing
    headroom.check()
    loop_for(2.0, lag=0.004, cpu=0.10, media_per_sample=0.045)  # blocked 90 % of the time
    assert headroom.verdict.saturated and headroom.verdict.reasons == ("loop_load",)
    with pytest.raises(SaturatedError, match="loop_load") as refused:
        headroom.check()
    assert isinstance(refused.value, CapacityError) and refused.value.retry_after_s
    body = headroom.describe()
    assert body["saturated"] and body["loop_load"] == pytest.approx(0.9, abs=0.01)
    loop_for(3.0, lag=0.002, cpu=0.10, media_per_sample=0.005)
    assert not headroom.refusing
    assert changes == [True, False]
    snapshot = values_of(headroom.metrics.snapshot())
    assert snapshot["saturated"] == 0.0 and snapshot["saturations_total"] == 1.0
    assert meter.count == 140 and meter.summary(7.0)["media_max_ms"] == pytest.approx(45.0)


def test_the_engine_clock_feeds_step_load_and_overruns_and_reports_the_callers_late_share():
    now = FakeTime()
    load = {"value": EngineLoad(step_load=0.3, overruns=0, late_frames=0, streaming_frames=120, ticks=12)}
    headroom = Headroom(CONFIG, now=now, engine=lambda: load["value"], active=lambda: 10)
    headroom.evaluate()
    now.t += 1
    load["value"] = EngineLoad(step_load=0.3, overruns=0, late_frames=80, streaming_frames=120, ticks=12)
    for _ in range(20):  # two thirds of the sessions' input late, for 5 s: shown, refuses nobody
        now.t += 0.25
        assert not headroom.evaluate().refusing
    assert headroom.describe()["late_share"] == pytest.approx(80 / 120, abs=1e-3)
    load["value"] = EngineLoad(step_load=0.95, overruns=0, late_frames=0, streaming_frames=120, ticks=12)
    headroom.evaluate()
    now.t += CONFIG.step_load_hold_s
    verdict = headroom.evaluate()
    assert verdict.saturated and verdict.reasons == ("step_load",)
    # Three streaming sessions: too few to say anything of, not even reported.
    few = Headroom(CONFIG, now=now, engine=lambda: EngineLoad(0.3, 0, 36, 36, 12))
    few.evaluate()
    now.t += 5
    assert not few.evaluate().refusing and few.signals.late_share is None
    # Overruns count within the overrun window only.
    counter = {"n": 0}
    runs = Headroom(CONFIG, now=now, engine=lambda: EngineLoad(0.3, counter["n"], 0, 0, 0))
    runs.evaluate()
    counter["n"] = 1
    now.t += 1
    assert not runs.evaluate().saturated
    now.t += CONFIG.overrun_window_s + 1
    runs.evaluate()
    counter["n"] = 2  # the second overrun comes long after the first
    now.t += 1
    assert not runs.evaluate().saturated
    counter["n"] = 3
    now.t += 1
    assert runs.evaluate().saturated


def test_stalls_of_the_loop_or_a_playout_are_seen_one_is_forgiven_three_saturate():
    """The loop monitor's median lag of a second hides one 150 ms stall; the worst gap shows
    it, and a call's playout pacer that woke late reports its own gap. A run of late samples is
    one stall; one refuses nobody, `stalls_enter` within the stall window saturate."""
    now = FakeTime()
    headroom = Headroom(CONFIG, now=now, active=lambda: 10)
    meter = headroom.meter()

    def samples(count: int, lag: float = 0.001) -> None:
        for _ in range(count):
            now.t += 0.05
            headroom.note_loop(lag, 0.2)
            headroom.evaluate()

    samples(20)
    samples(3, lag=0.150)  # one stall, three samples long
    samples(5)
    body = headroom.describe()
    assert body["loop_lag_ms"] < 5 and body["worst_gap_ms"] == pytest.approx(150.0)
    assert body["stalls"] == 1 and not headroom.refusing
    meter.woke_late(0.130)  # a call's pacer: the loop's own samples did not see this one
    samples(1)
    assert headroom.describe()["stalls"] == 2 and not headroom.refusing
    meter.woke_late(0.020)  # within what a call rides out: no stall
    samples(1)
    assert headroom.describe()["stalls"] == 2
    samples(1, lag=0.120)
    verdict = headroom.evaluate()
    assert verdict.saturated and verdict.reasons == ("stalls",)
    samples(round(CONFIG.stall_window_s / 0.05) + 2)  # the stall window passes without one
    assert headroom.describe()["stalls"] == 0
    samples(round(CONFIG.exit_hold_s / 0.05) + 1)
    assert not headroom.refusing


# -- the embedded host applies it ------------------------------------------------------------------


async def test_a_manager_whose_engine_cannot_keep_the_frame_refuses_new_calls_and_sheds_its_queue():
    """An engine whose steps take 95 % of the frame period (fake time): after step_load_hold_s
    the manager refuses opens and reservations with SaturatedError, says `saturated` on
    readiness and sheds the caller waiting in its queue (`saturated`); the sessions it carries
    go on. Once the engine is quick again and the exit hold has passed, it admits again."""
    clock = FakeClock(T0)
    engine = TimedEngine(clock, step_s=0.076, num_slots=2)
    manager = fake_manager(clock, engine, max_queue=2)
    talking = join(manager)
    caller(clock, talking, start=T0 + 0.01, frames=40)
    busy = join(manager)  # the last free slot
    waiting = join(manager)  # queued behind it
    assert waiting.queue_position == 1
    run_until(clock, manager, T0 + 2.0)

    manager.headroom.evaluate()
    clock.t += CONFIG.step_load_hold_s
    assert manager.headroom.evaluate().saturated
    assert waiting.closed and waiting.close_reason == "saturated"
    with pytest.raises(SaturatedError):
        await waiting.ready()
    with pytest.raises(SaturatedError, match="step_load"):
        await manager.open(Persona())
    with pytest.raises(SaturatedError):
        manager.reserve(ttl_s=10, persona=Persona())
    assert manager.available == 0
    ok, body = manager.readiness()
    assert not ok and body["status"] == "saturated" and body["headroom"]["reasons"] == ["step_load"]
    assert not talking.closed and not busy.closed
    metrics = values_of(manager.metrics_snapshots()[0].instruments)
    assert metrics["sessions_rejected_total"]["saturated"] == 2
    assert metrics["sessions_closed_total"]["saturated"] == 1
    assert metrics["saturated"] == 1.0

    manager.scheduler.recent_steps.extend([0.010] * 25)  # the engine's next 2 s of steps: quick
    manager.headroom.evaluate()
    clock.t += CONFIG.exit_hold_s
    assert not manager.headroom.evaluate().refusing
    manager.headroom.check()
    assert manager.readiness()[1]["status"] == "full"  # both slots still held, no longer saturated
    await busy.close()
    assert manager.readiness()[0] and manager.available == 1


def test_the_engine_load_counts_late_silence_per_tick_and_slips_count_once_audio_resumes():
    """The scheduler's own report: late silence fed to streaming sessions over the last second.
    As a slip of the call (its `inserted_ms`, `audio_inserted_seconds_total`), late silence
    counts once the caller's audio resumes after it: the silence after a caller's last audio
    (who hung up) is not one."""
    clock = FakeClock(T0)
    engine = TimedEngine(clock, step_s=0.01, num_slots=4)
    manager = fake_manager(clock, engine)
    sessions = [join(manager) for _ in range(4)]
    for i, session in enumerate(sessions):
        # Two of the four stop pushing after 10 frames: late every tick from then on.
        caller(clock, session, start=T0 + 0.01, frames=40 if i < 2 else 10)
    run_until(clock, manager, T0 + 2.0)
    load = manager.scheduler.engine_load()
    assert load.ticks == 12 and load.streaming_frames == 48
    assert load.late_frames == 24
    assert load.step_load == pytest.approx(0.01 / 0.08)

    quiet = sessions[2]
    late = quiet.stats["late_frames"]
    assert late > 10 and quiet.stats["trailing_late_frames"] == late
    assert quiet.stats["inserted_ms"] == {"late_input": 0.0}
    inserted = values_of(manager.metrics.snapshot())["audio_inserted_seconds_total"]
    assert inserted.get("late_input", 0.0) == 0.0
    quiet.push(np.zeros(1920, np.float32))  # the caller is back
    assert quiet.record.stream.take_frame() is not None
    assert quiet.stats["inserted_ms"] == {"late_input": pytest.approx(80.0 * late)}
    inserted = values_of(manager.metrics.snapshot())["audio_inserted_seconds_total"]
    assert inserted["late_input"] == pytest.approx(0.08 * late)


@pytest.mark.parametrize("callers", [5, 50])
def test_callers_whose_audio_comes_late_or_in_bursts_never_shut_the_door_on_others(callers):
    """`callers` sessions whose audio arrives 0.4 s at a time every 1.2 s (a poor mobile link,
    or on purpose), on an otherwise idle server (fake clock, an engine that steps in an eighth
    of the frame): most of their ticks get late silence, each call counts its own loss, and for
    ten seconds readiness stays `ready` and a new caller is admitted."""
    clock = FakeClock(T0)
    engine = TimedEngine(clock, step_s=0.01, num_slots=callers + 1)
    manager = fake_manager(clock, engine)
    sessions = [join(manager) for _ in range(callers)]
    burst_frames = 5  # 0.4 s
    for session in sessions:
        for m in range(9):  # every 1.2 s, 0.4 s of audio at once
            clock.at(
                T0 + 0.01 + 1.2 * m,
                lambda s=session: s.push(np.full(burst_frames * 1920, 0.1, np.float32)),
            )
    verdicts, readiness, admitted = [], [], []
    for k in range(1, 41):  # the policy looks every 250 ms, as the loop monitor would have it
        clock.at(T0 + 0.25 * k, lambda: verdicts.append(manager.headroom.evaluate()))
        clock.at(T0 + 0.25 * k + 0.01, lambda: readiness.append(manager.readiness()))
    # New callers all along: each admitted (its reservation taken, then given back).
    for k in range(1, 10):
        clock.at(T0 + k + 0.02, lambda: admitted.append(manager.cancel(manager.reserve(ttl_s=5).id)))
    run_until(clock, manager, T0 + 10.0)

    assert len(verdicts) == 40 and not any(v.refusing for v in verdicts)
    assert all(ok and body["status"] == "ready" for ok, body in readiness), readiness[-1]
    assert admitted == [True] * 9
    assert readiness[-1][1]["headroom"]["late_share"] >= 0.5  # they are late, and it shows
    for session in sessions:
        assert session.stats["late_frames"] > 40
        assert session.stats["inserted_ms"]["late_input"] > 0  # the caller's loss, counted per call


def test_a_sessions_first_second_is_left_out_of_the_late_input_the_engine_reports():
    """Four callers whose audio stalls in their first second (their start-up: the line finding
    its phase against the ticks): each counts its own late frames, the engine's report of late
    input (what `late_share` shows) leaves them out; the same stall a second later is in it."""
    clock = FakeClock(T0)
    engine = TimedEngine(clock, step_s=0.01, num_slots=4)
    manager = fake_manager(clock, engine)
    sessions = [join(manager) for _ in range(4)]
    for session in sessions:
        # Frames 2-5 come 0.3 s late (their ticks get silence); frames 22-25 likewise, later.
        late = {k: 0.3 for k in (2, 3, 4, 5, 22, 23, 24, 25)}
        caller(clock, session, start=T0 + 0.01, frames=40, late=late)
    loads = []
    clock.at(T0 + 0.95, lambda: loads.append(manager.scheduler.engine_load()))
    clock.at(T0 + 2.4, lambda: loads.append(manager.scheduler.engine_load()))
    run_until(clock, manager, T0 + 2.5)

    early, later = loads
    assert all(s.stats["late_frames"] >= 6 for s in sessions)  # each call counts its own
    assert early.late_frames == 0  # but its start-up is not the engine's report
    assert later.late_frames >= 8 and later.streaming_frames >= 40
