"""SessionManager on the LoopbackEngine: admission, ticks, limits, cache, isolation."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref

import numpy as np
import pytest
from support_sessions import assert_echo, audio, collect, echo_call, wait_until

from personaplex_voice.engine.base import (
    FRAME_SIZE,
    CapacityError,
    EngineError,
    Persona,
    PersonaError,
    Sampling,
)
from personaplex_voice.engine.loopback import LoopbackEngine
from personaplex_voice.metrics import values_of
from personaplex_voice.sessions import OutFrame, Session, SessionClosed

pytestmark = pytest.mark.timeout(60)


async def test_echo_session_frames_text_and_end(manager_factory):
    engine = LoopbackEngine(num_slots=2, text_pieces=[" hi", None])
    manager = manager_factory(engine)
    x = audio(7, seed=1)
    x = x[: x.size - 500]  # a partial last frame is padded by end_input
    session = await manager.open(Persona(text_prompt="You are kind."))
    assert manager.active_count == 1
    await session.ready()
    session.push(x[:1000])  # odd chunk sizes are framed by the session
    session.push(x[1000:])
    session.end_input()
    out = await collect(session)
    assert len(out) == 7
    assert_echo(out, np.concatenate([x, np.zeros(500, np.float32)]))
    assert [f.text for f in out] == [" hi", None] * 3 + [" hi"]
    assert all(f.pcm.dtype == np.float32 and f.pcm.shape == (FRAME_SIZE,) for f in out)
    assert session.closed and session.close_reason == "input_ended"
    assert session.stats["frames_in"] == 7 and session.stats["frames_out"] == 7
    await wait_until(lambda: not engine.slot_in_use(session.slot))
    assert manager.active_count == 0
    await session.close()  # idempotent
    assert session.close_reason == "input_ended"


async def test_push_rejects_bad_audio_and_ignores_after_close(manager_factory):
    manager = manager_factory()
    session = await manager.open(Persona())
    await session.ready()
    with pytest.raises(ValueError, match="1-D"):
        session.push(np.zeros((2, 100), np.float32))
    with pytest.raises(ValueError, match="int16"):
        session.push(np.zeros(100, np.int16))
    with pytest.raises(ValueError, match="NaN"):
        session.push(np.array([0.0, np.nan], np.float32))
    session.push(np.zeros((FRAME_SIZE, 1), np.float32))  # a column is fine
    await session.close()
    session.push(np.zeros(FRAME_SIZE, np.float32))  # no error after close
    assert session.close_reason == "client"
    with pytest.raises(PersonaError, match="unknown voice"):
        await manager.open(Persona(voice="../../etc/passwd"))
    assert manager.active_count == 0


async def test_batched_sessions_are_isolated_and_join_at_any_tick(manager_factory):
    engine = LoopbackEngine(num_slots=4, delay_frames=2)
    manager = manager_factory(engine)
    inputs = [audio(12 + 3 * i, seed=10 + i) for i in range(4)]
    sessions: list[Session] = []
    pushed = [0] * len(inputs)
    tasks = []

    def feed(i: int, n_frames: int | None = None) -> None:
        end = inputs[i].size if n_frames is None else pushed[i] + n_frames * FRAME_SIZE
        sessions[i].push(inputs[i][pushed[i] : end])
        pushed[i] = end

    for i in range(len(inputs)):
        # each newcomer joins while the earlier ones are mid-stream
        session = await manager.open(Persona(text_prompt=f"p{i % 2}"))
        await session.ready()
        sessions.append(session)
        feed(i, 3)
        for j in range(i):
            feed(j, 1)
        tasks.append(asyncio.ensure_future(collect(session)))
        await wait_until(lambda s=session: s.stats["frames_out"] >= 1)
    for i in range(len(inputs)):
        feed(i)
        sessions[i].end_input()
    outs = await asyncio.gather(*tasks)
    for x, out in zip(inputs, outs, strict=True):
        assert_echo(out, x, delay=2)
    assert engine.steps < sum(len(x) // FRAME_SIZE for x in inputs)  # really batched


async def test_any_loop_any_thread(manager_factory):
    """Sessions opened from two different event loops (threads) share one manager."""
    manager = manager_factory()
    await manager.start()
    results: dict[str, list[OutFrame]] = {}
    xs = {"a": audio(5, seed=3), "b": audio(6, seed=4)}

    def other_loop(name: str) -> None:
        results[name] = asyncio.run(echo_call(manager, xs[name]))

    threads = [threading.Thread(target=other_loop, args=(n,)) for n in xs]
    for t in threads:
        t.start()
    own = await echo_call(manager, audio(4, seed=5))
    for t in threads:
        await asyncio.get_running_loop().run_in_executor(None, t.join)
    assert_echo(own, audio(4, seed=5))
    for name, x in xs.items():
        assert_echo(results[name], x)


async def test_full_manager_refuses_and_running_sessions_are_unchanged(manager_factory):
    manager = manager_factory(LoopbackEngine(num_slots=2), retry_after_s=7.5)
    x = [audio(10, seed=20), audio(10, seed=21)]
    sessions = [await manager.open(Persona()) for _ in range(2)]
    for s in sessions:
        await s.ready()
        s.push(x[sessions.index(s)][: 5 * FRAME_SIZE])
    with pytest.raises(CapacityError) as err:
        await manager.open(Persona())
    assert err.value.retry_after_s == 7.5 and err.value.queue_position is None
    assert manager.metrics.sessions_rejected.values() == {"full": 1.0}
    for s, xi in zip(sessions, x, strict=True):
        s.push(xi[5 * FRAME_SIZE :])
        s.end_input()
    for s, xi in zip(sessions, x, strict=True):
        assert_echo(await collect(s), xi)


async def test_queue_positions_update_and_queued_session_gets_a_slot(manager_factory):
    manager = manager_factory(LoopbackEngine(num_slots=1), max_queue=2)
    first = await manager.open(Persona())
    await first.ready()
    second = await manager.open(Persona(text_prompt="2"))
    third = await manager.open(Persona(text_prompt="3"))
    assert (second.queue_position, third.queue_position) == (1, 2)
    assert manager.queued_count == 2
    with pytest.raises(CapacityError, match="queue"):
        await manager.open(Persona())
    assert manager.metrics.sessions_rejected.values() == {"queue_full": 1.0}
    await second.close()  # leaving the queue moves the others up
    assert third.queue_position == 1 and second.queue_position is None
    ready = asyncio.ensure_future(third.ready())
    await asyncio.sleep(0.05)
    assert not ready.done()
    await first.close()  # frees the slot: the head of the queue is admitted at once
    assert third.queue_position is None and manager.queued_count == 0
    await asyncio.wait_for(ready, 5)
    x = audio(3, seed=30)
    third.push(x)
    third.end_input()
    assert_echo(await collect(third), x)
    assert third.stats["queue_wait_ms"] > 0
    with pytest.raises(SessionClosed):
        await second.ready()


async def test_persona_cache_hit_restores_and_gives_the_same_output(manager_factory):
    engine = LoopbackEngine(num_slots=2, delay_frames=3, prefill_s=0.01)
    manager = manager_factory(engine)
    x = audio(6, seed=40)
    persona = Persona(text_prompt="same", voice="LOOPM0")
    first = await echo_call(manager, x, persona)
    second = await echo_call(manager, x, Persona(text_prompt="same", voice="LOOPM0.pt", seed=5))
    assert (engine.starts, engine.restores) == (1, 1)
    assert [f.pcm.tobytes() for f in first] == [f.pcm.tobytes() for f in second]
    other = await echo_call(manager, x, Persona(text_prompt="different", voice="LOOPM0"))
    assert_echo(other, x, delay=3)
    assert engine.starts == 2
    snap = values_of(manager.metrics.snapshot())
    assert snap["persona_cache_hits_total"] == 1 and snap["persona_cache_misses_total"] == 2
    assert snap["persona_cache_entries"] == 2
    assert snap["persona_cache_bytes"] == 2 * 3 * FRAME_SIZE * 4


async def test_persona_cache_is_bounded_in_bytes(manager_factory):
    engine = LoopbackEngine(num_slots=1, delay_frames=1)  # one snapshot = 7680 bytes
    manager = manager_factory(engine, cache_bytes=2 * FRAME_SIZE * 4)
    for prompt in ["a", "b", "c", "a"]:
        await echo_call(manager, audio(1, seed=1), Persona(text_prompt=prompt))
    assert len(manager.cache) == 2 and manager.cache.nbytes <= 2 * FRAME_SIZE * 4
    assert manager.metrics.cache_evictions.value == 2  # "a" evicted by "c", then "b" by "a"
    assert engine.starts == 4 and engine.restores == 0
    disabled = manager_factory(LoopbackEngine(num_slots=1), cache_bytes=0)
    for _ in range(2):
        await echo_call(disabled, audio(1, seed=1))
    assert disabled.engine.starts == 2 and len(disabled.cache) == 0


class PickyEngine(LoopbackEngine):
    """Fails `begin_start` for one prompt, records what reached it."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.started_personas: list[Persona] = []

    def begin_start(self, slot, prepared):
        if prepared.persona.text_prompt == "explode":
            raise PersonaError("voice file is corrupt")
        if prepared.persona.text_prompt == "crash":
            raise RuntimeError("CUDA out of memory")
        self.started_personas.append(prepared.persona)
        return super().begin_start(slot, prepared)


async def test_start_errors_fail_only_that_session_and_sampling_reaches_the_engine(manager_factory):
    engine = PickyEngine(num_slots=2)
    manager = manager_factory(engine)
    good = await manager.open(Persona(text_prompt="fine"))
    await good.ready()
    for prompt, error, reason in [
        ("explode", PersonaError, "persona_error"),
        ("crash", EngineError, "engine_error"),
    ]:
        bad = await manager.open(Persona(text_prompt=prompt))
        with pytest.raises(error):
            await asyncio.wait_for(bad.ready(), 5)
        assert bad.closed and bad.close_reason == reason
        assert [f async for f in bad.frames()] == []
    assert manager.active_count == 1
    x = audio(4, seed=50)
    good.push(x)
    good.end_input()
    assert_echo(await collect(good), x)
    sampling = Sampling(text_temperature=0.3, text_topk=5, greedy=False)
    out = await echo_call(manager, audio(1, seed=0), Persona(text_prompt="s", sampling=sampling, seed=1234))
    assert len(out) == 1
    assert engine.started_personas[-1].sampling == sampling and engine.started_personas[-1].seed == 1234
    assert manager.metrics.engine_errors.values() == {"start": 1.0}


class FailingStepEngine(LoopbackEngine):
    fail = False

    def step(self, pcm, active):
        if self.fail:
            self.fail = False
            raise RuntimeError("boom")
        return super().step(pcm, active)


async def test_step_error_ends_the_batch_cleanly_and_manager_keeps_serving(manager_factory):
    engine = FailingStepEngine(num_slots=2)
    manager = manager_factory(engine)
    session = await manager.open(Persona())
    await session.ready()
    engine.fail = True
    session.push(audio(2, seed=1))
    assert await collect(session) == []
    assert session.close_reason == "engine_error"
    x = audio(3, seed=2)
    assert_echo(await echo_call(manager, x), x)


async def test_max_call_duration_and_idle_end_calls(manager_factory):
    manager = manager_factory(max_call_s=5 * 0.08, idle_timeout_s=0.3)
    long_call = await manager.open(Persona())
    await long_call.ready()
    long_call.push(audio(20, seed=1))
    out = await collect(long_call)
    assert len(out) == 5 and long_call.close_reason == "max_duration"
    # A silent session would hold every non-realtime tick; the idle timeout ends it.
    quiet = await manager.open(Persona())
    talker = await manager.open(Persona())
    await quiet.ready()
    await talker.ready()
    talker.push(audio(3, seed=2))
    talker.end_input()
    out = await collect(talker)
    assert len(out) == 3
    assert quiet.close_reason == "idle"


async def test_close_during_prefill_and_mid_stream_frees_slots(manager_factory):
    engine = LoopbackEngine(num_slots=2, prefill_s=0.05)
    manager = manager_factory(engine)
    joining = await manager.open(Persona(text_prompt="slow"))
    await asyncio.sleep(0.01)  # the inference thread is inside engine.start now
    await joining.close()
    assert manager.active_count == 0  # the slot is free at once for admission
    with pytest.raises(SessionClosed):
        await joining.ready()
    streaming = await manager.open(Persona(text_prompt="slow"))
    await streaming.ready()
    streaming.push(audio(3, seed=1))
    frames = streaming.frames()
    first = await asyncio.wait_for(frames.__anext__(), 5)
    assert first.index == 0
    await streaming.close()
    assert streaming.close_reason == "client"
    await wait_until(lambda: not any(engine.slot_in_use(i) for i in range(2)))


async def test_realtime_late_input_gets_silence_and_does_not_hold_others(manager_factory):
    engine = LoopbackEngine(num_slots=2, delay_frames=0)
    manager = manager_factory(engine, realtime=True, frame_period_s=0.01, late_wait_s=0.002)
    steady = await manager.open(Persona())
    stalled = await manager.open(Persona())
    await steady.ready()
    await stalled.ready()
    said = audio(1, seed=1)
    stalled.push(said)  # one frame, then the client goes quiet
    steady_frames = steady.frames()
    got = []
    for k in range(20):
        steady.push(audio(1, seed=100 + k))
        got.append(await asyncio.wait_for(steady_frames.__anext__(), 5))
    assert stalled.stats["late_frames"] > 0
    assert manager.metrics.late_frames.value >= stalled.stats["late_frames"]
    assert stalled.stats["frames_out"] >= 15  # silence was fed: the stalled slot kept real time
    await stalled.close()
    stalled_out = await collect(stalled)  # what was queued: lead-in, the echo, then silence
    spoken = [f for f in stalled_out if np.any(f.pcm != 0)]
    assert len(spoken) == 1 and len(stalled_out) >= 15
    np.testing.assert_array_equal(spoken[0].pcm, said)
    assert [f.index for f in got] == list(range(20))


async def _take(session: Session, n: int):
    count = 0
    async for frame in session.frames():
        yield frame
        count += 1
        if count == n:
            return


async def test_realtime_slow_consumer_loses_only_its_own_oldest_frames(manager_factory):
    engine = LoopbackEngine(num_slots=2, delay_frames=0)
    keep = 8
    # The input comes in one burst, not in real time: no jitter buffer trimming it.
    manager = manager_factory(
        engine,
        realtime=True,
        frame_period_s=0.02,
        output_frames=keep,
        max_input_s=5.0,
        input_slack_s=5.0,
        input_settle_s=None,
    )
    reader = await manager.open(Persona())
    sleeper = await manager.open(Persona())
    await reader.ready()
    await sleeper.ready()
    x = audio(30, seed=7)
    sleeper.push(x)
    reader.push(x)
    reader.end_input()
    out = await collect(reader)
    await sleeper.close()  # no more frames for it: what is queued now is what it kept
    lead_in = reader.stats["lead_in_frames"]  # ticks between ready() and the first push
    assert all(np.all(f.pcm == 0) for f in out[:lead_in])
    np.testing.assert_array_equal(np.concatenate([f.pcm for f in out[lead_in:]]), x)
    assert [f.index for f in out] == list(range(len(out)))
    assert reader.stats["dropped_output_frames"] == 0
    stats = sleeper.stats
    assert stats["frames_out"] >= 30 and stats["output_queued_frames"] == keep
    assert stats["dropped_output_frames"] == stats["frames_out"] - keep
    kept = await collect(sleeper)
    # the kept frames are the newest ones, in order, each what the loopback echoed then
    assert [f.index for f in kept] == list(range(stats["frames_out"] - keep, stats["frames_out"]))
    padded = np.concatenate([np.zeros(stats["lead_in_frames"] * FRAME_SIZE, np.float32), x])
    padded = np.pad(padded, (0, stats["frames_out"] * FRAME_SIZE - padded.size))  # late silence after x
    for frame in kept:
        np.testing.assert_array_equal(
            frame.pcm, padded[frame.index * FRAME_SIZE : (frame.index + 1) * FRAME_SIZE]
        )
    assert manager.metrics.dropped_output_frames.value == stats["dropped_output_frames"]


async def test_shutdown_closes_everything(manager_factory):
    manager = manager_factory(LoopbackEngine(num_slots=1), max_queue=1)
    running = await manager.open(Persona())
    queued = await manager.open(Persona())
    await running.ready()
    frames_task = asyncio.ensure_future(collect(running))
    await manager.shutdown()
    assert await frames_task == []
    assert running.close_reason == queued.close_reason == "shutdown"
    with pytest.raises(EngineError, match="shutting down"):
        await manager.open(Persona())


async def test_thousand_open_close_cycles_leave_nothing_behind(manager_factory):
    engine = LoopbackEngine(num_slots=4, prefill_s=0.0005)
    manager = manager_factory(engine, max_queue=64)
    alive: weakref.WeakSet[Session] = weakref.WeakSet()
    x = audio(2, seed=3)
    closed_in: dict[str, int] = {}

    async def cycle(i: int) -> None:
        session = await manager.open(Persona(text_prompt=f"persona {i % 5}"))
        alive.add(session)
        kind = i % 4
        if kind == 0:  # close while queued or during prefill
            await asyncio.sleep(0.001 * (i % 3))
            state = session.stats["state"]
            closed_in[state] = closed_in.get(state, 0) + 1
            await session.close()
            return
        await session.ready()
        if kind == 1:  # ready, never streams
            await session.close()
            return
        session.push(x)
        frames = session.frames()
        await frames.__anext__()
        if kind == 2:  # mid-stream
            await session.close()
        else:  # to the end of its input
            session.end_input()
            async for _ in frames:
                pass
            assert session.close_reason == "input_ended"

    for start in range(0, 1000, 50):
        await asyncio.wait_for(asyncio.gather(*(cycle(i) for i in range(start, start + 50))), 30)
    assert closed_in.get("queued", 0) > 0 and closed_in.get("joining", 0) > 0, closed_in
    assert manager.active_count == 0 and manager.queued_count == 0 and manager.sessions == []
    await wait_until(lambda: not any(engine.slot_in_use(i) for i in range(4)))
    assert manager.scheduler.settled and manager.scheduler.queued_count == 0

    def none_alive() -> bool:  # the inference thread may hold its last batch until its next wait
        gc.collect()
        return len(alive) == 0

    await wait_until(none_alive, timeout=2.0)  # else: the manager keeps sessions alive
    snap = values_of(manager.metrics.snapshot())
    assert snap["sessions_opened_total"] == 1000
    assert sum(snap["sessions_closed_total"].values()) == 1000
    assert snap["active_slots"] == 0 and snap["queued_sessions"] == 0
    assert snap["persona_cache_entries"] <= 5


async def test_input_backlog_is_bounded_and_drops_the_oldest(manager_factory):
    manager = manager_factory(LoopbackEngine(num_slots=1, delay_frames=0), max_input_s=3 * 0.08)
    session = await manager.open(Persona())
    await session.ready()
    x = audio(5, seed=60)
    session.push(x)  # 5 frames into a 3-frame backlog: the first 2 are dropped
    session.end_input()
    out = await collect(session)
    assert session.stats["dropped_input_samples"] == 2 * FRAME_SIZE
    assert manager.metrics.dropped_input_samples.value == 2 * FRAME_SIZE
    np.testing.assert_array_equal(np.concatenate([f.pcm for f in out]), x[2 * FRAME_SIZE :])
