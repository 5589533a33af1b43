"""The scheduler's slot ownership, per-slot step failures and first-input start (LoopbackEngine)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from support_sessions import audio, collect, wait_until

from personaplex_voice.engine.base import FRAME_SIZE, EngineError, Persona, SlotError
from personaplex_voice.engine.loopback import LoopbackEngine

pytestmark = pytest.mark.timeout(60)


class RecordingEngine(LoopbackEngine):
    """Logs every slot operation in order; can hold the release of one slot until told to go on."""

    def __init__(self, hold_release: int | None = None, **kw):
        super().__init__(**kw)
        self.calls: list[tuple[str, int]] = []
        self.hold_release = hold_release
        self.holding = threading.Event()
        self.go_on = threading.Event()

    def begin_start(self, slot, prepared):
        self.calls.append(("start", slot))
        return super().begin_start(slot, prepared)

    def release(self, slot):
        self.calls.append(("release", slot))
        if slot == self.hold_release and not self.go_on.is_set():
            self.holding.set()
            assert self.go_on.wait(10)
        super().release(slot)

    def step(self, pcm, active):
        for slot in np.flatnonzero(active):
            if not self.slot_in_use(int(slot)):
                raise SlotError(f"slot {slot} is active but was never started", [int(slot)])
        return super().step(pcm, active)


async def test_a_slot_is_released_before_its_next_holder_starts(manager_factory):
    """The release/join race, forced: while the inference thread is busy releasing slot 1, the
    holder of slot 0 leaves and a newcomer takes slot 0. The old scheduler took its set of
    slots to release before the leaver's close, then started the newcomer and only afterwards
    released slot 0, wiping the newcomer's prompt (the next step failed with "never started").
    One FIFO of slot operations makes that order impossible."""
    engine = RecordingEngine(hold_release=1, num_slots=2, delay_frames=0)
    manager = manager_factory(engine)
    leaver = await manager.open(Persona(text_prompt="first"))
    other = await manager.open(Persona(text_prompt="second"))
    await asyncio.wait_for(asyncio.gather(leaver.ready(), other.ready()), 5)
    assert (leaver.slot, other.slot) == (0, 1)

    await other.close()  # the thread now sits in engine.release(1)
    await asyncio.get_running_loop().run_in_executor(None, engine.holding.wait, 5)
    await leaver.close()
    newcomer = await manager.open(Persona(text_prompt="next"))
    assert newcomer.slot == 0  # the slot is free for admission at once
    engine.go_on.set()

    await asyncio.wait_for(newcomer.ready(), 5)
    slot0 = [call for call in engine.calls if call[1] == 0]
    assert slot0 == [("start", 0), ("release", 0), ("start", 0)], engine.calls
    x = audio(3, seed=3)
    newcomer.push(x)
    newcomer.end_input()
    out = await collect(newcomer)
    assert newcomer.close_reason == "input_ended"
    np.testing.assert_array_equal(np.concatenate([f.pcm for f in out]), x)
    assert manager.metrics.engine_errors.value == 0


class FaultySlotEngine(LoopbackEngine):
    """Fails every step that includes `bad_slot`: with SlotError naming it, or with a bare
    RuntimeError the scheduler has to pin down itself."""

    def __init__(self, bad_slot: int, attributed: bool, **kw):
        super().__init__(**kw)
        self.bad_slot = bad_slot
        self.attributed = attributed
        self.armed = False
        self.batches: list[tuple[int, ...]] = []

    def step(self, pcm, active):
        slots = tuple(int(s) for s in np.flatnonzero(active))
        self.batches.append(slots)
        if self.armed and self.bad_slot in slots:
            if self.attributed:
                raise SlotError("poisoned slot", [self.bad_slot])
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().step(pcm, active)


@pytest.mark.parametrize("attributed", [True, False], ids=["slot_error", "unattributed"])
async def test_a_step_failing_for_one_slot_ends_only_that_session(manager_factory, attributed):
    engine = FaultySlotEngine(bad_slot=2, attributed=attributed, num_slots=4, delay_frames=0)
    manager = manager_factory(engine)
    sessions = [await manager.open(Persona(text_prompt=f"p{i}")) for i in range(4)]
    await asyncio.wait_for(asyncio.gather(*(s.ready() for s in sessions)), 5)
    assert [s.slot for s in sessions] == [0, 1, 2, 3]
    inputs = [audio(6, seed=10 + i) for i in range(4)]
    for session, x in zip(sessions, inputs, strict=True):
        session.push(x[: 2 * FRAME_SIZE])
    await wait_until(lambda: all(s.stats["frames_out"] == 2 for s in sessions))
    engine.armed = True
    for session, x in zip(sessions, inputs, strict=True):
        session.push(x[2 * FRAME_SIZE :])
        session.end_input()
    outs = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in sessions)), 10)

    bad = sessions[2]
    assert bad.close_reason == "engine_error"
    assert len(outs[2]) == 2  # what it got before the fault, nothing after
    for i in (0, 1, 3):  # every neighbour got every frame, each exactly once, in order
        assert sessions[i].close_reason == "input_ended"
        assert [f.index for f in outs[i]] == list(range(6))
        np.testing.assert_array_equal(np.concatenate([f.pcm for f in outs[i]]), inputs[i])
    assert manager.metrics.slot_failures.value == 1
    assert manager.metrics.engine_errors.values() == {"step": 1.0}
    assert manager.active_count == 0


async def test_realtime_output_starts_with_the_first_input_frame(manager_factory):
    """As the published server: a ready session is not stepped until its first input frame, so a
    client that starts listening late misses nothing; the first frame out answers the first in."""
    engine = LoopbackEngine(num_slots=2, delay_frames=0)
    manager = manager_factory(engine, realtime=True, idle_timeout_s=None)
    session = await manager.open(Persona(text_prompt="hello"))
    await asyncio.wait_for(session.ready(), 5)
    await asyncio.sleep(0.5)  # ~6 ticks' worth of time with nothing pushed
    assert session.stats["frames_out"] == 0 and session.stats["lead_in_frames"] == 0
    assert session.seconds_to_next_tick() is None  # nobody streams: the clock is idle
    x = audio(3, seed=7)
    session.push(x)
    frames = session.frames()
    first = await asyncio.wait_for(frames.__anext__(), 2)
    assert first.index == 0
    np.testing.assert_array_equal(first.pcm, x[:FRAME_SIZE])
    due = session.seconds_to_next_tick()
    assert due is not None and 0 <= due <= 0.08 + 1e-3
    await session.close()


async def test_a_failing_prefill_chunk_fails_only_its_session(manager_factory):
    class BrokenChunks(LoopbackEngine):
        def begin_start(self, slot, prepared):
            job = super().begin_start(slot, prepared)
            if prepared.persona.text_prompt != "broken":
                return job

            class Broken:
                remaining = 1

                def run_chunk(self):
                    raise RuntimeError("out of memory")

            return Broken()

    manager = manager_factory(BrokenChunks(num_slots=2))
    good = await manager.open(Persona(text_prompt="good"))
    broken = await manager.open(Persona(text_prompt="broken"))
    with pytest.raises(EngineError):
        await asyncio.wait_for(broken.ready(), 5)
    await asyncio.wait_for(good.ready(), 5)
    assert broken.close_reason == "engine_error" and manager.active_count == 1
    assert manager.metrics.engine_errors.values() == {"start": 1.0}
