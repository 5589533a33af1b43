"""The frame clock: one inference thread that steps every running slot of an `Engine` per tick.

Only this thread calls the engine's `start`, `snapshot`, `restore`, `step` and `release`.
Each *tick* steps every running slot in one batched `engine.step` with an active mask; between
ticks it releases freed slots, joins new sessions (system prompt prefill, or a restore from the
persona cache) and ends sessions past their limits. Two clocks:

- realtime: a tick every frame period on a monotonic deadline clock. A slot whose next input
  frame is missing at the tick (after a short bounded wait) gets a frame of silence, counted as
  late; whole frames queued beyond what the ticks need are trimmed (`SpareTrimmer`), so
  lateness never adds lasting latency.
- non-realtime: a tick runs as soon as every running slot has a full frame buffered (or has
  ended its input) and, lossless, room for its output.

The scheduler knows nothing of asyncio or sockets. What sits in a slot is a `SlotClient` (the
session layer's `Session`); admission, queueing and handing frames to event loops are the
session layer's (`personaplex_voice.sessions`), which shares this scheduler's lock (`cond`) for
the slot table. See docs/sessions.md for the policies.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import numpy as np

from personaplex_voice.engine.base import (
    FRAME_SIZE,
    SAMPLE_RATE,
    Engine,
    EngineError,
    PersonaError,
    PreparedPersona,
    StepOutput,
)
from personaplex_voice.engine.persona_cache import PersonaCache
from personaplex_voice.metrics import SessionMetrics

log = logging.getLogger(__name__)

FRAME_SECONDS = FRAME_SIZE / SAMPLE_RATE  # 0.08


class SlotState(enum.Enum):
    """A session's life as both sides see it."""

    QUEUED = "queued"  # waiting for a free slot (the session layer's)
    JOINING = "joining"  # holds a slot; prefill or restore pending / running on the inference thread
    RUNNING = "running"  # stepped every tick
    CLOSED = "closed"


class SlotClient(Protocol):
    """What the scheduler needs from the session in a slot.

    The members are underscored because they are no transport's business: the session layer
    implements them for this thread. `slot`, `_state` and `_prepared` change only under the
    scheduler's `cond`; the rest the session guards with its own lock.
    """

    slot: int | None
    _state: SlotState
    _prepared: PreparedPersona | None  # None once closed
    _input_ended: bool  # no more input will come
    _last_input: float  # time.monotonic() of the last push

    @property
    def _streaming(self) -> bool:
        """A full input frame was taken at least once and the input has not ended."""

    def _has_frame(self) -> bool:
        """A full input frame is buffered."""

    def _take_frame(self) -> np.ndarray | None:
        """The next input frame (float32 [FRAME_SIZE]), or None when short of one."""

    def _count_silence(self, late: bool) -> None:
        """A tick fed silence: a late frame, or lead-in before the first full frame."""

    def _trim_spare(self, slack_frames: int, settle_ticks: int | None) -> int:
        """The realtime jitter buffer after a tick (see `SpareTrimmer`); frames dropped."""

    def _output_backlog(self) -> int:
        """Output frames not yet taken by the consumer."""

    def _frames_out(self) -> int:
        """Output frames made so far."""

    def _deliver(self, pcm: np.ndarray, text: str | None, tokens: np.ndarray | None, max_frames: int) -> int:
        """Hand one output frame to the consumer, dropping the oldest beyond `max_frames`;
        returns the frames dropped. Must not block."""

    def _joined(self, seconds: float, cache_hit: bool) -> None:
        """The prefill (or restore) took `seconds`; called even if the session closed meanwhile."""

    def _became_ready(self) -> None:
        """The session is running: wake whoever awaits it."""


CloseFn = Callable[[SlotClient, str, BaseException | None], None]


class SpareTrimmer:
    """The realtime jitter buffer's policy for one session's input.

    After each tick took (or missed) the session's frame, the whole frames still queued are
    *spare*: cushion against late input, but also latency. Spare beyond `slack_frames` goes at
    once; spare that stayed queued through `settle_ticks` ticks in a row was never needed and
    goes then. A tick that finds no spare (the cushion was used) starts the count over.
    """

    def __init__(self) -> None:
        self._streak = 0  # ticks in a row that left at least one whole spare frame queued
        self._floor = 0  # the fewest spare frames seen over those ticks

    def frames_to_drop(self, spare: int, slack_frames: int, settle_ticks: int | None) -> int:
        drop = max(0, spare - slack_frames)
        kept = spare - drop
        if kept == 0:  # the cushion was used (or there was none): start over
            self._streak = 0
        else:
            self._floor = kept if self._streak == 0 else min(self._floor, kept)
            self._streak += 1
            if settle_ticks is not None and self._streak >= settle_ticks:
                drop += self._floor
                self._streak = 0
        return drop


class Scheduler:
    """The inference thread and the slot table around one engine.

    `close(client, reason, error)` and `close_all(reason, error)` are the session layer's
    callbacks: the thread calls them (without holding `cond`) to end sessions past their limits
    or failed by the engine; `close` must take the client out of its slot with `vacate`. The
    session layer calls `free_slot` / `assign` / `vacate` with `cond` held (it is re-entrant).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        metrics: SessionMetrics,
        cache: PersonaCache,
        close: CloseFn,
        close_all: Callable[[str, BaseException], None],
        realtime: bool,
        lossless: bool,
        frame_period_s: float,
        max_catchup_ticks: int,
        late_wait_s: float,
        input_slack_frames: int,
        input_settle_ticks: int | None,
        output_frames: int,
        max_call_frames: int | None,
        idle_timeout_s: float | None,
    ):
        self.engine = engine
        self.metrics = metrics
        self.cache = cache
        self._close = close
        self._close_all = close_all
        self.realtime = realtime
        self.lossless = lossless
        self.frame_period_s = frame_period_s
        self.max_catchup_ticks = max_catchup_ticks
        self.late_wait_s = late_wait_s
        self.input_slack_frames = input_slack_frames
        self.input_settle_ticks = input_settle_ticks
        self.output_frames = output_frames
        self.max_call_frames = max_call_frames
        self.idle_timeout_s = idle_timeout_s

        n = engine.num_slots
        self.cond = threading.Condition()  # re-entrant; guards everything below but the arrays
        self.slots: list[SlotClient | None] = [None] * n
        self.joining: deque[SlotClient] = deque()
        self.to_release: set[int] = set()
        self.stopping = False
        self._want_input = False  # the thread waits for pushes
        self._want_room = False  # the thread waits for consumers (lossless mode)
        self._thread: threading.Thread | None = None
        self._pcm_in = np.zeros((n, FRAME_SIZE), np.float32)
        self._active = np.zeros(n, bool)
        self.recent_steps: deque[float] = deque(maxlen=25)  # engine.step seconds, last 2 s

    # ---- the session layer's side (slot table calls with `cond` held) ------------------------

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def held_count(self) -> int:
        """Slots held (joining or running)."""
        return sum(s is not None for s in self.slots)

    def start(self) -> None:
        """Start the inference thread unless it runs."""
        with self.cond:
            if self.alive:
                return
            self.stopping = False
            self._thread = threading.Thread(target=self._run, name="personaplex-inference", daemon=True)
            self._thread.start()

    def request_stop(self) -> threading.Thread | None:
        """Ask the thread to end after its current tick; returns it, for joining."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
            return self._thread

    def free_slot(self) -> int | None:
        for i, holder in enumerate(self.slots):
            if holder is None:
                return i
        return None

    def assign(self, client: SlotClient, slot: int) -> None:
        """Give `client` the free `slot`; the thread joins it between ticks."""
        client.slot = slot
        client._state = SlotState.JOINING
        self.slots[slot] = client
        self.joining.append(client)

    def vacate(self, client: SlotClient) -> bool:
        """Take a closing client out of its slot; True when it held one. The slot is free for
        assignment at once; the thread calls engine.release before anything else runs in it."""
        slot = client.slot
        if slot is None or self.slots[slot] is not client:
            return False
        self.slots[slot] = None
        self.to_release.add(slot)
        if client in self.joining:
            self.joining.remove(client)
        return True

    def input_arrived(self) -> None:
        """A push or end of input (any thread)."""
        if self._want_input:
            with self.cond:
                self.cond.notify_all()

    def output_taken(self) -> None:
        """A consumer took a frame (any thread)."""
        if self._want_room:
            with self.cond:
                self.cond.notify_all()

    def late_wait(self) -> float:
        """The wait for late input at this tick: `late_wait_s`, cut to what the engine's slowest
        recent step leaves of the frame period (minus a tenth of it as margin), so waiting for
        one late caller never makes the clock fall behind for everybody."""
        slowest = max(self.recent_steps, default=0.0)
        room = self.frame_period_s * 0.9 - slowest
        return max(0.0, min(self.late_wait_s, room))

    # ---- the inference thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:  # keep no session waiting on a dead thread
            log.exception("inference thread crashed")
            self._close_all("engine_error", EngineError("the inference thread crashed"))
        finally:
            self._release_pending()
            for slot, holder in enumerate(self.slots):
                if holder is None:
                    continue
                self._safe_release(slot)

    def _loop(self) -> None:
        next_tick: float | None = None
        while True:
            deadline = next_tick if (self.realtime and next_tick is not None) else None
            self._control(deadline)
            with self.cond:
                if self.stopping:
                    return
                running = self._running()
                if not running:
                    next_tick = None
                    if not self.joining and not self.to_release:
                        self.cond.wait(timeout=0.5)
                    continue
            if self.realtime:
                now = time.monotonic()
                if next_tick is None:
                    next_tick = now
                if now < next_tick:
                    with self.cond:
                        if not self.joining and not self.to_release and not self.stopping:
                            self.cond.wait(timeout=next_tick - now)
                    if time.monotonic() < next_tick:
                        continue  # woke early for a join/close: handle it, then wait again
                self._wait_for_late(running, next_tick + self.late_wait())
            elif not self._wait_for_inputs(running):
                continue
            self._tick()
            if self.realtime:
                next_tick += self.frame_period_s
                behind = time.monotonic() - next_tick
                if behind > self.max_catchup_ticks * self.frame_period_s:
                    self.metrics.tick_overruns.inc()
                    next_tick = time.monotonic()

    def _running(self) -> list[SlotClient]:
        return [s for s in self.slots if s is not None and s._state is SlotState.RUNNING]

    def _control(self, deadline: float | None) -> None:
        """Between ticks: release freed slots, start joiners (at least one, then as many as fit
        before `deadline`), end sessions past their limits."""
        self._release_pending()
        first = True
        while True:
            with self.cond:
                if not self.joining or self.stopping:
                    break
                if not first and deadline is not None and time.monotonic() >= deadline:
                    break
                client = self.joining.popleft()
            first = False
            self._join(client)
            self._release_pending()
        self._enforce_limits()

    def _release_pending(self) -> None:
        with self.cond:
            slots, self.to_release = self.to_release, set()
        for slot in sorted(slots):
            self._safe_release(slot)

    def _safe_release(self, slot: int) -> None:
        try:
            self.engine.release(slot)
        except Exception:
            log.exception("engine.release(%d) failed", slot)
            self.metrics.engine_errors.inc(label="release")

    def _join(self, client: SlotClient) -> None:
        """Prefill (or restore) a joining client's slot; fail only this client on error."""
        prepared, slot = client._prepared, client.slot
        if prepared is None or slot is None or client._state is not SlotState.JOINING:
            return
        key = prepared.cache_key
        snapshot = self.cache.get(key) if self.cache.enabled else None
        t0 = time.perf_counter()
        try:
            if snapshot is not None:
                self.engine.restore(slot, snapshot, prepared)
                self.metrics.restore_seconds.observe(time.perf_counter() - t0)
                self.metrics.cache_hits.inc()
            else:
                self.engine.start(slot, prepared)
                self.metrics.prefill_seconds.observe(time.perf_counter() - t0)
                self.metrics.cache_misses.inc()
                if self.cache.enabled:
                    self.metrics.cache_evictions.inc(self.cache.put(key, self.engine.snapshot(slot)))
                    self.metrics.cache_bytes.set(self.cache.nbytes)
                    self.metrics.cache_entries.set(len(self.cache))
        except PersonaError as exc:
            self._close(client, "persona_error", exc)
            return
        except Exception as exc:
            log.exception("engine failed to start slot %d", slot)
            self.metrics.engine_errors.inc(label="start")
            self._close(client, "engine_error", EngineError(f"the engine failed to start: {exc}"))
            return
        client._joined(time.perf_counter() - t0, snapshot is not None)
        with self.cond:
            if client._state is not SlotState.JOINING or self.slots[slot] is not client:
                return  # closed during the prefill; its slot is already queued for release
            client._state = SlotState.RUNNING
            client._last_input = time.monotonic()
        client._became_ready()

    def _enforce_limits(self) -> None:
        now = time.monotonic()
        for client in self._running():
            if client._input_ended and not client._has_frame():
                self._close(client, "input_ended", None)
            elif self.max_call_frames is not None and client._frames_out() >= self.max_call_frames:
                self._close(client, "max_duration", None)
            elif (
                self.idle_timeout_s is not None
                and now - client._last_input > self.idle_timeout_s
                and not client._has_frame()  # input waiting to be stepped is not idleness
            ):
                self._close(client, "idle", None)

    def _wait_for_late(self, running: list[SlotClient], until: float) -> None:
        """Realtime: give clients that are streaming but short of a frame until `until`."""
        with self.cond:
            self._want_input = True
            try:
                while not self.stopping:
                    late = [
                        c
                        for c in running
                        if c._state is SlotState.RUNNING and c._streaming and not c._has_frame()
                    ]
                    remaining = until - time.monotonic()
                    if not late or remaining <= 0:
                        return
                    self.cond.wait(timeout=remaining)
            finally:
                self._want_input = False

    def _wait_for_inputs(self, running: list[SlotClient]) -> bool:
        """Non-realtime: True when every running client has a frame (and, lossless, room for
        its output). Otherwise waits a little for pushes and returns False to recheck."""
        with self.cond:
            self._want_input = self._want_room = True
            try:
                if self.stopping or self.joining or self.to_release:
                    return False
                for c in running:
                    if c._state is not SlotState.RUNNING:
                        return False
                    if not c._has_frame():
                        if c._input_ended:
                            return False  # it ends in _control
                        self.cond.wait(timeout=0.1)
                        return False
                    if self.lossless and c._output_backlog() >= self.output_frames:
                        self.cond.wait(timeout=0.1)
                        return False
                return True
            finally:
                self._want_input = self._want_room = False

    def _tick(self) -> None:
        """One batched step of every running client."""
        with self.cond:
            running = self._running()
        if not running:
            return
        pcm, active = self._pcm_in, self._active
        pcm.fill(0.0)
        active.fill(False)
        late = trimmed = 0
        for client in running:
            frame = client._take_frame()
            if frame is not None:
                pcm[client.slot] = frame
            else:  # silence: late for a client that was streaming, lead-in before its first frame
                is_late = client._streaming
                client._count_silence(is_late)
                late += is_late
            if self.realtime and client._streaming:
                trimmed += client._trim_spare(self.input_slack_frames, self.input_settle_ticks)
            active[client.slot] = True
        if late:
            self.metrics.late_frames.inc(late)
        if trimmed:
            self.metrics.jitter_dropped_frames.inc(trimmed)
            self.metrics.dropped_input_samples.inc(trimmed * FRAME_SIZE)
        t0 = time.perf_counter()
        try:
            out = self.engine.step(pcm, active)
        except Exception as exc:
            log.exception("engine.step failed")
            self.metrics.engine_errors.inc(label="step")
            for client in running:
                self._close(client, "engine_error", EngineError(f"the engine failed: {exc}"))
            return
        step_s = time.perf_counter() - t0
        self.metrics.tick_seconds.observe(step_s)
        self.recent_steps.append(step_s)
        self.metrics.ticks.inc()
        dropped = 0
        for client in running:
            slot = client.slot
            if slot is None or self.slots[slot] is not client or client._state is not SlotState.RUNNING:
                continue  # closed during the step
            pcm_out = np.array(out.pcm[slot], dtype=np.float32)
            dropped += client._deliver(pcm_out, out.text[slot], _tokens_of(out, slot), self.output_frames)
        if dropped:
            self.metrics.dropped_output_frames.inc(dropped)
        self._enforce_limits()


def _tokens_of(out: StepOutput, slot: int) -> np.ndarray | None:
    return None if out.tokens is None else np.array(out.tokens[slot], dtype=np.int64)
