"""SessionManager and Session: the one API every transport uses to reach the engine.

One manager per process owns one engine and one *inference thread*. Only that thread calls the
engine's `start`, `snapshot`, `restore`, `step` and `release` (`prepare` runs in a worker
thread from `open`). Transports live on any asyncio loop: they `push` audio into thread-safe
bounded buffers and await frames that the inference thread hands over through
`loop.call_soon_threadsafe`.

Each *tick* steps every running session in one batched `engine.step` with an active mask.
Sessions join (system prompt prefill, or a restore from the persona cache) and leave between
ticks. Two clocks:

- realtime (default): a tick every 80 ms. A session whose next input frame is missing at the
  tick (after a short bounded wait) gets a frame of silence, counted as late: the model keeps
  real time for everybody. Each session's input is a small jitter buffer: whole frames queued
  beyond what the ticks need (late audio that came after all) are dropped, at once beyond a
  slack and otherwise once they went unused for a while, so lateness never adds lasting latency.
- non-realtime (`realtime=False`, tests and offline): a tick runs as soon as every running
  session has a full frame buffered (or has ended its input), and by default waits for room in
  every output queue instead of dropping frames, so results are exact and repeatable.

See docs/sessions.md for the policies (late input, queueing, cache, limits, metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from personaplex_voice.engine.base import (
    FRAME_SIZE,
    SAMPLE_RATE,
    CapacityError,
    Engine,
    EngineError,
    Persona,
    PersonaError,
    PreparedPersona,
    StepOutput,
)
from personaplex_voice.engine.persona_cache import PersonaCache
from personaplex_voice.metrics import SessionMetrics

log = logging.getLogger(__name__)

FRAME_SECONDS = FRAME_SIZE / SAMPLE_RATE  # 0.08


class SessionClosed(EngineError):
    """The session ended before it became ready (or was used after it ended)."""

    def __init__(self, reason: str):
        super().__init__(f"session closed ({reason})")
        self.reason = reason


@dataclass(frozen=True)
class OutFrame:
    """One 80 ms frame of agent output.

    `tokens` is int64 [1 + n_audio_codebooks] (text token, then the agent's audio tokens) when
    the engine reports tokens (the real model does; the loopback does not).
    """

    pcm: np.ndarray  # float32 [FRAME_SIZE]
    text: str | None
    index: int  # 0, 1, 2... per session
    tokens: np.ndarray | None = None


class _State(enum.Enum):
    QUEUED = "queued"  # waiting for a free slot
    JOINING = "joining"  # holds a slot; prefill or restore pending / running on the inference thread
    RUNNING = "running"  # stepped every tick
    CLOSED = "closed"


class _SampleFifo:
    """FIFO of float32 samples with a size bound; overflow drops the oldest samples."""

    def __init__(self, max_samples: int):
        self.max_samples = max_samples
        self._chunks: deque[np.ndarray] = deque()
        self._head = 0  # samples already consumed from _chunks[0]
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def push(self, x: np.ndarray) -> int:
        """Append; returns how many of the oldest samples were dropped to stay in bound."""
        if x.size:
            self._chunks.append(x)
            self._size += x.size
        over = self._size - self.max_samples
        if over > 0:
            self._discard(over)
            return over
        return 0

    def pop(self, n: int) -> np.ndarray | None:
        """The next `n` samples, or None when fewer are buffered."""
        if self._size < n:
            return None
        out = np.empty(n, np.float32)
        filled = 0
        while filled < n:
            chunk = self._chunks[0]
            take = min(n - filled, chunk.size - self._head)
            out[filled : filled + take] = chunk[self._head : self._head + take]
            filled += take
            self._head += take
            if self._head == chunk.size:
                self._chunks.popleft()
                self._head = 0
        self._size -= n
        return out

    def drop_oldest(self, n: int) -> None:
        """Discard the `n` oldest samples (at most what is buffered)."""
        self._discard(min(n, self._size))

    def clear(self) -> None:
        self._chunks.clear()
        self._head = 0
        self._size = 0

    def _discard(self, n: int) -> None:
        while n > 0:
            chunk = self._chunks[0]
            take = min(n, chunk.size - self._head)
            self._head += take
            n -= take
            self._size -= take
            if self._head == chunk.size:
                self._chunks.popleft()
                self._head = 0


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class Session:
    """One conversation. Created by `SessionManager.open`; see the module docstring.

    Thread model: the transport calls `push`, `ready`, `frames`, `close` from its asyncio loop;
    the inference thread fills the output queue and takes input frames. `self._lock` guards the
    buffers and the waiter list; the manager's lock guards the state.
    """

    def __init__(self, manager: SessionManager, prepared: PreparedPersona):
        self.id = uuid.uuid4().hex[:16]
        self.persona: Persona = prepared.persona
        self._manager = manager
        self._prepared: PreparedPersona | None = prepared
        self._state = _State.QUEUED
        self.slot: int | None = None
        self.queue_position: int | None = None
        self.close_reason: str | None = None
        self._error: BaseException | None = None
        self._was_ready = False
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._input = _SampleFifo(manager.max_input_samples)
        self._out: deque[OutFrame] = deque()
        self._input_ended = False
        self._had_input = False  # a full frame was consumed at least once
        self._last_input = time.monotonic()
        self._opened_at = time.monotonic()
        self._counts = {
            "frames_in": 0,
            "frames_out": 0,
            "late_frames": 0,
            "lead_in_frames": 0,
            "dropped_output_frames": 0,
            "dropped_input_samples": 0,
            "jitter_dropped_frames": 0,
            "dropped_pre_ready_samples": 0,
        }
        # Realtime jitter buffer (inference thread only): ticks in a row that left at least one
        # whole spare frame queued, and the fewest spare frames seen over those ticks.
        self._spare_streak = 0
        self._spare_floor = 0
        self._prefill_s: float | None = None
        self._cache_hit: bool | None = None
        self._queue_wait_s: float | None = None

    # ---- public API -------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._state is _State.CLOSED

    @property
    def ready_now(self) -> bool:
        """True while the session is being stepped."""
        return self._state is _State.RUNNING

    @property
    def stats(self) -> dict[str, Any]:
        with self._lock:
            counts = dict(self._counts)
            backlog = len(self._input)
            queued_out = len(self._out)
        return {
            "id": self.id,
            "state": self._state.value,
            "slot": self.slot,
            "queue_position": self.queue_position,
            "close_reason": self.close_reason,
            **counts,
            "input_backlog_samples": backlog,
            "output_queued_frames": queued_out,
            "cache_hit": self._cache_hit,
            "prefill_ms": None if self._prefill_s is None else self._prefill_s * 1000.0,
            "queue_wait_ms": None if self._queue_wait_s is None else self._queue_wait_s * 1000.0,
            "duration_s": counts["frames_out"] * FRAME_SECONDS,
        }

    async def ready(self) -> None:
        """Wait until the session holds a slot with its system prompt in.

        Raises the PersonaError / EngineError that failed the prefill, or SessionClosed when the
        session ended before it became ready. Returns at once for a session that was ready.
        """
        while True:
            with self._lock:
                if self._was_ready:
                    return
                if self._state is _State.CLOSED:
                    if self._error is not None:
                        raise self._error
                    raise SessionClosed(self.close_reason or "closed")
                fut = self._add_waiter()
            await fut

    def push(self, pcm: np.ndarray) -> None:
        """Queue user audio: float32 mono 24 kHz in [-1, 1], any length. Never blocks.

        Audio pushed after the session ended is ignored. In realtime mode audio pushed before
        the session is ready is dropped (counted): the conversation has not started yet.
        Raises ValueError for audio that is not float, not 1-D or not finite.
        """
        raw = np.asarray(pcm)
        if raw.dtype.kind not in "f":
            raise ValueError(f"push wants float samples in [-1, 1], got {raw.dtype} (scale int16 by 1/32768)")
        x = raw.astype(np.float32, copy=False)
        if x.ndim == 2 and 1 in x.shape:
            x = x.reshape(-1)
        if x.ndim != 1:
            raise ValueError(f"push wants mono samples (1-D), got shape {x.shape}")
        if not np.isfinite(x).all():
            raise ValueError("push got NaN or infinite samples")
        if self._state is _State.CLOSED or self._input_ended:
            return
        manager = self._manager
        if manager.realtime and self._state is not _State.RUNNING:
            with self._lock:
                self._counts["dropped_pre_ready_samples"] += x.size
            return
        x = x.copy()  # the caller may reuse its buffer
        with self._lock:
            dropped = self._input.push(x)
            self._last_input = time.monotonic()
            if dropped:
                self._counts["dropped_input_samples"] += dropped
        if dropped:
            manager.metrics.dropped_input_samples.inc(dropped)
        manager._input_arrived()

    def end_input(self) -> None:
        """No more audio will be pushed. A partial last frame is padded with zeros; once the
        buffered input has been stepped the session closes with reason "input_ended"."""
        if self._input_ended or self._state is _State.CLOSED:
            return
        with self._lock:
            partial = len(self._input) % FRAME_SIZE
            if partial:
                self._input.push(np.zeros(FRAME_SIZE - partial, np.float32))
            self._input_ended = True
        self._manager._input_arrived()

    async def frames(self) -> AsyncIterator[OutFrame]:
        """Output frames as the engine makes them; ends when the session has ended and every
        produced frame was taken."""
        while True:
            with self._lock:
                if self._out:
                    frame = self._out.popleft()
                    fut = None
                elif self._state is _State.CLOSED:
                    return
                else:
                    frame = None
                    fut = self._add_waiter()
            if frame is not None:
                self._manager._output_taken()
                yield frame
            else:
                await fut

    async def close(self, reason: str = "client") -> None:
        """End the session and free its slot at once (idempotent)."""
        self._manager._close(self, reason)

    def close_nowait(self, reason: str = "client") -> None:
        """`close` for synchronous code (any thread)."""
        self._manager._close(self, reason)

    def __repr__(self) -> str:
        return f"<Session {self.id} {self._state.value} slot={self.slot}>"

    # ---- used by the manager (inference thread) ---------------------------------------------

    def _add_waiter(self) -> asyncio.Future:
        """A future resolved at the next state change or output frame. Call with `_lock` held."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._waiters.append((loop, fut))
        return fut

    def _wake(self) -> None:
        """Resolve every waiter, on its own loop. Call with `_lock` held."""
        for loop, fut in self._waiters:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits there any more
                loop.call_soon_threadsafe(_resolve, fut)
        self._waiters.clear()

    def _take_frame(self) -> np.ndarray | None:
        with self._lock:
            frame = self._input.pop(FRAME_SIZE)
            if frame is not None:
                self._counts["frames_in"] += 1
                self._had_input = True
            return frame

    def _has_frame(self) -> bool:
        return len(self._input) >= FRAME_SIZE

    def _trim_spare(self, slack_frames: int, settle_ticks: int | None) -> int:
        """Realtime jitter buffer, run by each tick after it took (or missed) this session's
        frame. Whole frames still queued are *spare*: cushion against late input, but also
        latency. Spare beyond `slack_frames` goes at once; spare that stayed queued through
        `settle_ticks` ticks in a row was never needed and goes then. The oldest frames go, in
        whole frames, so a client's frame phase is kept. Returns the frames dropped."""
        with self._lock:
            spare = len(self._input) // FRAME_SIZE
            drop = max(0, spare - slack_frames)
            kept = spare - drop
            if kept == 0:  # the cushion was used (or there was none): start over
                self._spare_streak = 0
            else:
                self._spare_floor = kept if self._spare_streak == 0 else min(self._spare_floor, kept)
                self._spare_streak += 1
                if settle_ticks is not None and self._spare_streak >= settle_ticks:
                    drop += self._spare_floor
                    self._spare_streak = 0
            if drop:
                self._input.drop_oldest(drop * FRAME_SIZE)
                self._counts["jitter_dropped_frames"] += drop
                self._counts["dropped_input_samples"] += drop * FRAME_SIZE
            return drop

    def _deliver(self, frame: OutFrame, max_frames: int) -> int:
        """Queue an output frame; drop the oldest beyond `max_frames`. Returns frames dropped."""
        with self._lock:
            dropped = 0
            while len(self._out) >= max_frames:
                self._out.popleft()
                dropped += 1
            self._out.append(frame)
            self._counts["frames_out"] += 1
            self._counts["dropped_output_frames"] += dropped
            self._wake()
            return dropped


class SessionManager:
    """Admission, the inference thread and the tick loop around one engine. One per process.

    Options:
      max_queue: 0 refuses opens when every slot is taken (CapacityError with retry_after_s);
        N > 0 lets up to N sessions wait in order (`session.queue_position` = 1..N).
      realtime: True = a tick every 80 ms; False = a tick as soon as every running session has a
        frame buffered (tests, offline).
      cache_bytes: persona cache budget (sum of snapshot `nbytes`); 0 disables it.
      max_call_s: calls end with close_reason "max_duration" after this much audio (None = no limit).
      idle_timeout_s: a running session that pushes nothing for this long (wall clock) ends with
        close_reason "idle" (None = never).
      late_wait_s: realtime only; the most a tick waits past its due time for late input (less
        when the engine's recent steps leave less of the frame period).
      input_slack_s: realtime jitter buffer; spare input (whole frames queued beyond the one a
        tick takes) above this is dropped at once, oldest first.
      input_settle_s: realtime jitter buffer; spare input that stayed queued, unused, this long
        is dropped, bringing the latency back to under one frame (None: never).
      max_input_s: bound of each session's input backlog (default 1 s realtime, 600 s otherwise);
        overflow drops the oldest samples.
      output_frames: bound of each session's output queue; a slow consumer loses its oldest.
      lossless: wait for room in every output queue instead of dropping (default: not realtime).
      retry_after_s: the hint given with CapacityError.
      frame_period_s: the realtime tick period (80 ms; tests and benches may shorten it).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        max_queue: int = 0,
        realtime: bool = True,
        cache_bytes: int = 1 << 30,
        max_call_s: float | None = 3600.0,
        idle_timeout_s: float | None = 60.0,
        late_wait_s: float = 0.020,
        input_slack_s: float = 0.16,
        input_settle_s: float | None = 1.0,
        max_input_s: float | None = None,
        output_frames: int = 64,
        lossless: bool | None = None,
        retry_after_s: float = 5.0,
        frame_period_s: float = FRAME_SECONDS,
        max_catchup_ticks: int = 3,
    ):
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if output_frames < 1:
            raise ValueError(f"output_frames must be >= 1, got {output_frames}")
        self.engine = engine
        self.max_queue = max_queue
        self.realtime = realtime
        self.max_call_frames = None if max_call_s is None else max(1, round(max_call_s / FRAME_SECONDS))
        self.idle_timeout_s = idle_timeout_s
        self.late_wait_s = late_wait_s
        self.input_slack_frames = max(0, int(input_slack_s / FRAME_SECONDS + 1e-9))
        self.input_settle_ticks = (
            None if input_settle_s is None else max(1, round(input_settle_s / FRAME_SECONDS))
        )
        if max_input_s is None:
            max_input_s = 1.0 if realtime else 600.0
        self.max_input_samples = max(FRAME_SIZE, round(max_input_s * SAMPLE_RATE))
        self.output_frames = output_frames
        self.lossless = (not realtime) if lossless is None else lossless
        self.retry_after_s = retry_after_s
        self.frame_period_s = frame_period_s
        self.max_catchup_ticks = max_catchup_ticks
        self.metrics = SessionMetrics.create()
        self.cache = PersonaCache(cache_bytes)

        n = engine.num_slots
        self._cond = threading.Condition()
        self._slots: list[Session | None] = [None] * n
        self._queue: list[Session] = []
        self._joining: deque[Session] = deque()
        self._to_release: set[int] = set()
        self._sessions: dict[str, Session] = {}
        self._want_input = False  # the inference thread waits for pushes
        self._want_room = False  # the inference thread waits for consumers (lossless mode)
        self._stopping = False
        self._shut_down = False  # open() does not restart a manager that was shut down
        self._thread: threading.Thread | None = None
        self._prepare_pool: ThreadPoolExecutor | None = None  # made by start(), ended by shutdown()
        self._pcm_in = np.zeros((n, FRAME_SIZE), np.float32)
        self._active = np.zeros(n, bool)
        self._recent_steps: deque[float] = deque(maxlen=25)  # engine.step seconds, last 2 s

    # ---- public API -------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.engine.num_slots

    @property
    def active_count(self) -> int:
        """Sessions holding a slot (joining or running)."""
        return sum(s is not None for s in self._slots)

    @property
    def queued_count(self) -> int:
        return len(self._queue)

    @property
    def sessions(self) -> list[Session]:
        """Every session not yet closed (queued, joining or running)."""
        with self._cond:
            return list(self._sessions.values())

    async def start(self) -> None:
        """Start the inference thread (idempotent; also restarts a manager after `shutdown`)."""
        with self._cond:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stopping = self._shut_down = False
            if self._prepare_pool is None:
                self._prepare_pool = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="personaplex-prepare"
                )
            self._thread = threading.Thread(target=self._run, name="personaplex-inference", daemon=True)
            self._thread.start()

    async def open(self, persona: Persona) -> Session:
        """Admit a conversation. Returns at once (prefill happens on the inference thread; await
        `session.ready()`). Raises PersonaError for a bad persona, CapacityError when full."""
        if not self._shut_down:
            await self.start()
        with self._cond:
            self._check_capacity()  # refuse before doing any work when clearly full
            pool = self._prepare_pool
        loop = asyncio.get_running_loop()
        # One prepare at a time: engines need not make `prepare` re-entrant (the real one
        # plans prompts on a shared scratch ring), and it keeps CPU for the inference thread.
        prepared = await loop.run_in_executor(pool, self.engine.prepare, persona)
        session = Session(self, prepared)
        with self._cond:
            self._check_capacity()
            self._sessions[session.id] = session
            slot = self._free_slot()
            if slot is not None and not self._queue:
                self._assign(session, slot)
            else:
                self._queue.append(session)
                session.queue_position = len(self._queue)
            self.metrics.sessions_opened.inc()
            self._update_gauges()
            self._cond.notify_all()
        return session

    async def shutdown(self) -> None:
        """Close every session (reason "shutdown") and stop the inference thread."""
        with self._cond:
            self._stopping = self._shut_down = True  # from here on, open() refuses
            self._cond.notify_all()
            thread = self._thread
            pool, self._prepare_pool = self._prepare_pool, None
        for session in self.sessions:
            self._close(session, "shutdown")
        if pool is not None:
            pool.shutdown(wait=False)
        if thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, thread.join)

    # ---- admission (callers hold self._cond) ------------------------------------------------

    def _check_capacity(self) -> None:
        if self._stopping:
            raise EngineError("the session manager is shutting down")
        if self._free_slot() is not None and not self._queue:
            return
        if len(self._queue) < self.max_queue:
            return
        reason = "full" if self.max_queue == 0 else "queue_full"
        self.metrics.sessions_rejected.inc(label=reason)
        raise CapacityError(
            f"all {self.capacity} sessions are busy"
            + (f" and the queue of {self.max_queue} is full" if self.max_queue else "")
            + f"; retry in {self.retry_after_s:g} s",
            retry_after_s=self.retry_after_s,
        )

    def _free_slot(self) -> int | None:
        for i, holder in enumerate(self._slots):
            if holder is None:
                return i
        return None

    def _assign(self, session: Session, slot: int) -> None:
        session.slot = slot
        session._state = _State.JOINING
        session.queue_position = None
        session._queue_wait_s = time.monotonic() - session._opened_at
        self._slots[slot] = session
        self._joining.append(session)

    def _admit_from_queue(self) -> None:
        moved = False
        while self._queue:
            slot = self._free_slot()
            if slot is None:
                break
            self._assign(self._queue.pop(0), slot)
            moved = True
        if moved:
            for i, waiting in enumerate(self._queue):
                waiting.queue_position = i + 1

    def _update_gauges(self) -> None:
        self.metrics.active_slots.set(self.active_count)
        self.metrics.queued_sessions.set(len(self._queue))

    # ---- closing (any thread) ---------------------------------------------------------------

    def _close(self, session: Session, reason: str, error: BaseException | None = None) -> None:
        with self._cond:
            if session._state is _State.CLOSED:
                return
            previous = session._state
            session._state = _State.CLOSED
            session.close_reason = reason
            session._error = error
            if previous is _State.QUEUED:
                self._queue.remove(session)
                for i, waiting in enumerate(self._queue):
                    waiting.queue_position = i + 1
                session.queue_position = None
            elif session.slot is not None and self._slots[session.slot] is session:
                # The slot is free for admission now; the inference thread calls
                # engine.release before anything else runs in it.
                self._slots[session.slot] = None
                self._to_release.add(session.slot)
                if previous is _State.JOINING and session in self._joining:
                    self._joining.remove(session)
                self._admit_from_queue()
            self._sessions.pop(session.id, None)
            session._prepared = None
            self.metrics.sessions_closed.inc(label=reason)
            self._update_gauges()
            self._cond.notify_all()
        with session._lock:
            session._input.clear()
            session._wake()

    # ---- wake-ups from transports -----------------------------------------------------------

    def _input_arrived(self) -> None:
        if self._want_input:
            with self._cond:
                self._cond.notify_all()

    def _output_taken(self) -> None:
        if self._want_room:
            with self._cond:
                self._cond.notify_all()

    # ---- inference thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:  # keep no session waiting on a dead thread
            log.exception("inference thread crashed")
            for session in self.sessions:
                self._close(session, "engine_error", EngineError("the inference thread crashed"))
        finally:
            self._release_pending()
            for slot, holder in enumerate(self._slots):
                if holder is None:
                    continue
                self._safe_release(slot)

    def _loop(self) -> None:
        next_tick: float | None = None
        while True:
            deadline = next_tick if (self.realtime and next_tick is not None) else None
            self._control(deadline)
            with self._cond:
                if self._stopping:
                    return
                running = self._running()
                if not running:
                    next_tick = None
                    if not self._joining and not self._to_release:
                        self._cond.wait(timeout=0.5)
                    continue
            if self.realtime:
                now = time.monotonic()
                if next_tick is None:
                    next_tick = now
                if now < next_tick:
                    with self._cond:
                        if not self._joining and not self._to_release and not self._stopping:
                            self._cond.wait(timeout=next_tick - now)
                    if time.monotonic() < next_tick:
                        continue  # woke early for a join/close: handle it, then wait again
                self._wait_for_late(running, next_tick + self._late_wait())
            elif not self._wait_for_inputs(running):
                continue
            self._tick()
            if self.realtime:
                next_tick += self.frame_period_s
                behind = time.monotonic() - next_tick
                if behind > self.max_catchup_ticks * self.frame_period_s:
                    self.metrics.tick_overruns.inc()
                    next_tick = time.monotonic()

    def _running(self) -> list[Session]:
        return [s for s in self._slots if s is not None and s._state is _State.RUNNING]

    def _control(self, deadline: float | None) -> None:
        """Between ticks: release freed slots, start joiners (at least one, then as many as fit
        before `deadline`), end sessions past their limits."""
        self._release_pending()
        first = True
        while True:
            with self._cond:
                if not self._joining or self._stopping:
                    break
                if not first and deadline is not None and time.monotonic() >= deadline:
                    break
                session = self._joining.popleft()
            first = False
            self._join(session)
            self._release_pending()
        self._enforce_limits()

    def _release_pending(self) -> None:
        with self._cond:
            slots, self._to_release = self._to_release, set()
        for slot in sorted(slots):
            self._safe_release(slot)

    def _safe_release(self, slot: int) -> None:
        try:
            self.engine.release(slot)
        except Exception:
            log.exception("engine.release(%d) failed", slot)
            self.metrics.engine_errors.inc(label="release")

    def _join(self, session: Session) -> None:
        """Prefill (or restore) a joining session's slot; fail only this session on error."""
        prepared, slot = session._prepared, session.slot
        if prepared is None or slot is None or session._state is not _State.JOINING:
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
            self._close(session, "persona_error", exc)
            return
        except Exception as exc:
            log.exception("engine failed to start slot %d", slot)
            self.metrics.engine_errors.inc(label="start")
            self._close(session, "engine_error", EngineError(f"the engine failed to start: {exc}"))
            return
        session._prefill_s = time.perf_counter() - t0
        session._cache_hit = snapshot is not None
        with self._cond:
            if session._state is not _State.JOINING or self._slots[slot] is not session:
                return  # closed during the prefill; its slot is already queued for release
            session._state = _State.RUNNING
            session._last_input = time.monotonic()
        with session._lock:
            session._was_ready = True
            session._wake()

    def _enforce_limits(self) -> None:
        now = time.monotonic()
        for session in self._running():
            if session._input_ended and not session._has_frame():
                self._close(session, "input_ended")
            elif self.max_call_frames is not None and session._counts["frames_out"] >= self.max_call_frames:
                self._close(session, "max_duration")
            elif (
                self.idle_timeout_s is not None
                and now - session._last_input > self.idle_timeout_s
                and not session._has_frame()  # input waiting to be stepped is not idleness
            ):
                self._close(session, "idle")

    def _late_wait(self) -> float:
        """The wait for late input at this tick: `late_wait_s`, cut to what the engine's slowest
        recent step leaves of the frame period (minus a tenth of it as margin), so waiting for
        one late caller never makes the clock fall behind for everybody."""
        slowest = max(self._recent_steps, default=0.0)
        room = self.frame_period_s * 0.9 - slowest
        return max(0.0, min(self.late_wait_s, room))

    def _wait_for_late(self, running: list[Session], until: float) -> None:
        """Realtime: give sessions that are streaming but short of a frame until `until`."""
        with self._cond:
            self._want_input = True
            try:
                while not self._stopping:
                    late = [
                        s
                        for s in running
                        if s._state is _State.RUNNING
                        and s._had_input
                        and not s._input_ended
                        and not s._has_frame()
                    ]
                    remaining = until - time.monotonic()
                    if not late or remaining <= 0:
                        return
                    self._cond.wait(timeout=remaining)
            finally:
                self._want_input = False

    def _wait_for_inputs(self, running: list[Session]) -> bool:
        """Non-realtime: True when every running session has a frame (and, lossless, room for
        its output). Otherwise waits a little for pushes and returns False to recheck."""
        with self._cond:
            self._want_input = self._want_room = True
            try:
                if self._stopping or self._joining or self._to_release:
                    return False
                for s in running:
                    if s._state is not _State.RUNNING:
                        return False
                    if not s._has_frame():
                        if s._input_ended:
                            return False  # it ends in _control
                        self._cond.wait(timeout=0.1)
                        return False
                    if self.lossless and len(s._out) >= self.output_frames:
                        self._cond.wait(timeout=0.1)
                        return False
                return True
            finally:
                self._want_input = self._want_room = False

    def _tick(self) -> None:
        """One batched step of every running session."""
        with self._cond:
            running = self._running()
        if not running:
            return
        pcm, active = self._pcm_in, self._active
        pcm.fill(0.0)
        active.fill(False)
        late = trimmed = 0
        for session in running:
            frame = session._take_frame()
            if frame is not None:
                pcm[session.slot] = frame
            else:
                key = "late_frames" if session._had_input and not session._input_ended else "lead_in_frames"
                with session._lock:
                    session._counts[key] += 1
                late += key == "late_frames"
            if self.realtime and session._had_input and not session._input_ended:
                trimmed += session._trim_spare(self.input_slack_frames, self.input_settle_ticks)
            active[session.slot] = True
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
            for session in running:
                self._close(session, "engine_error", EngineError(f"the engine failed: {exc}"))
            return
        step_s = time.perf_counter() - t0
        self.metrics.tick_seconds.observe(step_s)
        self._recent_steps.append(step_s)
        self.metrics.ticks.inc()
        dropped = 0
        for session in running:
            slot = session.slot
            if slot is None or self._slots[slot] is not session or session._state is not _State.RUNNING:
                continue  # closed during the step
            frame = OutFrame(
                pcm=np.array(out.pcm[slot], dtype=np.float32),
                text=out.text[slot],
                index=session._counts["frames_out"],
                tokens=_tokens_of(out, slot),
            )
            dropped += session._deliver(frame, self.output_frames)
        if dropped:
            self.metrics.dropped_output_frames.inc(dropped)
        self._enforce_limits()


def _tokens_of(out: StepOutput, slot: int) -> np.ndarray | None:
    if out.text_tokens is None:
        return None
    text = np.asarray(out.text_tokens[slot], np.int64).reshape(1)
    if out.audio_tokens is None:
        return text
    return np.concatenate([text, np.asarray(out.audio_tokens[slot], np.int64).reshape(-1)])
