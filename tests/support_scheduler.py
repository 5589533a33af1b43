"""Drive the scheduler's real loop on fake time: scheduler policies tested deterministically.

`FakeClock` is the scheduler's `Clock`: waiting advances time instead of sleeping, and the events
a test schedules (a caller's pushes, opens, closes) run when their time comes. `TimedEngine` is
the loopback echo whose steps and prefill chunks cost the fake seconds the test sets. The loop
(`Scheduler.run`) runs in the test's own thread, so every run is the same run, whatever the
machine is doing.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from personaplex_voice.engine.base import FRAME_SIZE, Persona, PreparedPersona
from personaplex_voice.engine.loopback import LoopbackEngine
from personaplex_voice.engine.scheduler import FRAME_SECONDS
from personaplex_voice.sessions import Session, SessionManager


class FakeClock:
    """Time that moves only when the scheduler waits or the engine works."""

    def __init__(self, start: float = 100.0):
        self.t = start
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        # An event that raised: kept for the test (raising into the scheduler's loop would be
        # taken for an engine failure).
        self.errors: list[BaseException] = []

    def now(self) -> float:
        return self.t

    def elapsed(self) -> float:
        return self.t

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, next(self._order), action))

    def after(self, delay: float, action: Callable[[], None]) -> None:
        self.at(self.t + delay, action)

    def advance(self, seconds: float) -> None:
        """The engine worked for `seconds`: events due meanwhile happen (as pushes from other
        threads would), in time order."""
        self._run_until(self.t + seconds)

    def wait(self, cond: threading.Condition, timeout: float | None) -> None:
        """Until the next event (which runs, and may wake the waiter) or the timeout."""
        target = self.t + (timeout if timeout is not None else 3600.0)
        if self._events and self._events[0][0] <= target:
            self._run_until(max(self.t, self._events[0][0]))
        else:
            self.t = target

    def _run_until(self, when: float) -> None:
        while self._events and self._events[0][0] <= when:
            due, _, action = heapq.heappop(self._events)
            self.t = max(self.t, due)
            try:
                action()
            except Exception as exc:
                self.errors.append(exc)
        self.t = max(self.t, when)


@dataclass
class StepLog:
    """What the engine did and when: each step's start time and its active slots."""

    steps: list[tuple[float, tuple[int, ...]]] = field(default_factory=list)
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (start time, slot)
    calls: list[tuple[str, int]] = field(default_factory=list)  # ("start" | "release", slot) in order

    def step_times(self, slot: int) -> np.ndarray:
        return np.array([t for t, slots in self.steps if slot in slots])


class TimedEngine(LoopbackEngine):
    """The loopback echo (no delay) whose work costs fake time: `step_s` per batched step,
    `chunk_s` per prefill chunk of `prefill_chunk` prompt steps."""

    def __init__(self, clock: FakeClock, *, step_s: float = 0.02, chunk_s: float = 0.02, **kw):
        kw.setdefault("delay_frames", 0)
        super().__init__(**kw)
        self.clock = clock
        self.step_s = step_s
        self.chunk_s = chunk_s
        self.log = StepLog()

    def begin_start(self, slot: int, prepared: PreparedPersona):  # type: ignore[override]
        self.log.calls.append(("start", slot))
        job = super().begin_start(slot, prepared)
        run_chunk = job.run_chunk

        def timed_chunk() -> bool:
            self.log.chunks.append((self.clock.now(), slot))
            self.clock.advance(self.chunk_s)
            return run_chunk()

        job.run_chunk = timed_chunk  # type: ignore[method-assign]
        return job

    def release(self, slot: int) -> None:
        self.log.calls.append(("release", slot))
        super().release(slot)

    def step(self, pcm, active):
        self.log.steps.append((self.clock.now(), tuple(int(s) for s in np.flatnonzero(active))))
        self.clock.advance(self.step_s)
        return super().step(pcm, active)


def fake_manager(clock: FakeClock, engine: TimedEngine, **options) -> SessionManager:
    options.setdefault("idle_timeout_s", None)
    return SessionManager(engine, clock=clock, cache_bytes=0, **options)


def join(manager: SessionManager, persona: Persona | None = None) -> Session:
    """A session admitted at the clock's now (no prepare thread, no event loop)."""
    session = Session(manager, manager.engine.prepare(persona or Persona()))
    manager.scheduler.add(session.record)
    return session


def long_persona(i: int, words: int = 600) -> Persona:
    """A distinct prompt of 1 + `words` words (the loopback takes 13 + words prompt steps)."""
    return Persona(text_prompt=f"caller{i} " + " ".join(["a"] * words))


def numbered(k: int) -> np.ndarray:
    return np.full(FRAME_SIZE, k / 1000.0, np.float32)


def caller(
    clock: FakeClock,
    session: Session,
    *,
    start: float,
    frames: int,
    late: dict[int, float] | None = None,
    lead: float = 0.01,
) -> None:
    """Schedule a caller pushing frame k (numbered k + 1): the first at `start` (which starts
    the frame clock when it is idle), then each `lead` seconds before its tick is due, plus
    `late[k]` seconds for the frames listed (frames keep their order: a frame held back holds
    the ones after it)."""
    late = late or {}
    last = start
    for k in range(frames):
        when = start if k == 0 else start + k * FRAME_SECONDS - lead
        when = max(last, when + late.get(k, 0.0))
        last = when
        clock.at(when, lambda k=k: session.push(numbered(k + 1)))


def run_until(clock: FakeClock, manager: SessionManager, end: float) -> None:
    """Run the scheduler's loop in this thread until the fake time `end`."""
    clock.at(end, manager.scheduler.stop)
    manager.scheduler.run()
    if clock.errors:
        raise clock.errors[0]


def drain(session: Session) -> list[np.ndarray]:
    """The output frames queued for `session` (the run is over: nothing more comes)."""
    frames = []
    while (frame := session.record.stream.take_output()) is not None:
        frames.append(frame.pcm)
    return frames
