"""SessionManager and Session: the one API every transport uses to reach the engine.

One manager per process owns one engine. Its inference thread and frame clock are the engine
layer's `personaplex_voice.engine.scheduler.Scheduler`; this module is the asyncio-facing side:
admission and queueing, the per-session input and output buffers, and handing frames and state
changes to whichever loop awaits them (`loop.call_soon_threadsafe`). `prepare` runs on the
manager's one prepare thread from `open`.

Transports live on any asyncio loop: they `push` audio into thread-safe bounded buffers and
await frames. Realtime managers tick every 80 ms and feed silence for late input (with a small
jitter buffer so lateness never adds lasting latency); non-realtime ones (tests, offline) tick
as soon as every running session has a frame and lose nothing.

See docs/sessions.md for the policies (late input, queueing, cache, limits, metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from personaplex_voice.audio.framing import FrameBuffer
from personaplex_voice.engine.base import (
    FRAME_SIZE,
    SAMPLE_RATE,
    CapacityError,
    Engine,
    EngineError,
    Persona,
    PersonaError,
    PreparedPersona,
)
from personaplex_voice.engine.persona_cache import PersonaCache
from personaplex_voice.engine.scheduler import FRAME_SECONDS, Scheduler, SlotState, SpareTrimmer
from personaplex_voice.engine.start_burst import StartBurst
from personaplex_voice.metrics import SessionMetrics


class TicketError(CapacityError):
    """A reservation ticket that is unknown, expired or already used: the caller gets no slot."""


@dataclass(frozen=True)
class Ticket:
    """A slot set aside by `SessionManager.reserve` for one later `open(..., ticket=id)`.

    `id` is unguessable (it is the only thing a redeemer presents) and works once;
    `expires_at` is on the `time.monotonic()` clock; `persona` is the one `open` uses when
    given none (so whoever reserved can decide who the agent is, e.g. a Twilio webhook).
    """

    id: str
    expires_at: float
    persona: Persona | None = None


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


def pushed_samples(pcm: np.ndarray) -> np.ndarray:
    """What `push` accepts, as float32 1-D (no copy when it already is): float samples, mono
    (1-D, or 2-D with one channel), finite. Raises ValueError saying what is wrong otherwise."""
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
    return x


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
        self._state = SlotState.QUEUED
        self.slot: int | None = None
        self.queue_position: int | None = None
        self.close_reason: str | None = None
        self._error: BaseException | None = None
        self._was_ready = False
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._input = FrameBuffer(FRAME_SIZE, max_samples=manager.max_input_samples)
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
            "catchup_frames": 0,
        }
        self._spare = SpareTrimmer()  # realtime jitter buffer policy (inference thread only)
        # issue 16: input kept from before the session ran (or flushed by the client right after
        # its handshake) is a start burst, exempt from the jitter buffer and consumed by catch-up
        # steps (engine/start_burst.py; inference thread only).
        self._burst = StartBurst(manager.start_burst_frames, window_ticks=manager.start_burst_frames)
        self._prefill_s: float | None = None
        self._cache_hit: bool | None = None
        self._queue_wait_s: float | None = None

    # ---- public API -------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._state is SlotState.CLOSED

    @property
    def ready_now(self) -> bool:
        """True while the session is being stepped."""
        return self._state is SlotState.RUNNING

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
                if self._state is SlotState.CLOSED:
                    if self._error is not None:
                        raise self._error
                    raise SessionClosed(self.close_reason or "closed")
                fut = self._add_waiter()
            await fut

    def push(self, pcm: np.ndarray) -> None:
        """Queue user audio: float32 mono 24 kHz in [-1, 1], any length. Never blocks.

        Audio pushed after the session ended is ignored. Audio pushed before the session is
        ready (queued, prefilling) is kept, in order, up to the input bound (`max_input_s`): the
        caller's first words. Beyond the bound the oldest samples go (counted, before the
        session runs also in `dropped_pre_ready_samples`).
        Raises ValueError for audio that is not float, not 1-D or not finite.
        """
        x = pushed_samples(pcm)
        if self._state is SlotState.CLOSED or self._input_ended:
            return
        manager = self._manager
        with self._lock:  # the buffer copies: the caller may reuse its array
            dropped = self._input.push(x)
            self._last_input = time.monotonic()
            if dropped:
                self._counts["dropped_input_samples"] += dropped
                if self._state is not SlotState.RUNNING:
                    self._counts["dropped_pre_ready_samples"] += dropped
        if dropped:
            manager.metrics.dropped_input_samples.inc(dropped)
        manager._scheduler.input_arrived()

    def end_input(self) -> None:
        """No more audio will be pushed. A partial last frame is padded with zeros; once the
        buffered input has been stepped the session closes with reason "input_ended"."""
        if self._input_ended or self._state is SlotState.CLOSED:
            return
        with self._lock:
            partial = len(self._input) % FRAME_SIZE
            if partial:
                self._input.push(np.zeros(FRAME_SIZE - partial, np.float32))
            self._input_ended = True
        self._manager._scheduler.input_arrived()

    async def frames(self) -> AsyncIterator[OutFrame]:
        """Output frames as the engine makes them; ends when the session has ended and every
        produced frame was taken."""
        while True:
            with self._lock:
                if self._out:
                    frame = self._out.popleft()
                    fut = None
                elif self._state is SlotState.CLOSED:
                    return
                else:
                    frame = None
                    fut = self._add_waiter()
            if frame is not None:
                self._manager._scheduler.output_taken()
                yield frame
            else:
                await fut

    def seconds_to_next_tick(self) -> float | None:
        """How long until the engine's next tick takes an input frame (None while its clock is
        idle: the first full frame of a ready session then starts it at once). Transports that
        pace input (the Twilio bridge) use it to phase their audio against the ticks."""
        return self._manager._scheduler.seconds_to_next_tick()

    async def close(self, reason: str = "client") -> None:
        """End the session and free its slot at once (idempotent)."""
        self._manager._close(self, reason)

    def close_nowait(self, reason: str = "client") -> None:
        """`close` for synchronous code (any thread)."""
        self._manager._close(self, reason)

    def __repr__(self) -> str:
        return f"<Session {self.id} {self._state.value} slot={self.slot}>"

    # ---- asyncio plumbing (any thread) -------------------------------------------------------

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

    # ---- the scheduler's side (engine.scheduler.SlotClient; inference thread) ---------------

    @property
    def _streaming(self) -> bool:
        return self._had_input and not self._input_ended

    def _has_frame(self) -> bool:
        return len(self._input) >= FRAME_SIZE

    def _take_frame(self) -> np.ndarray | None:
        with self._lock:
            frame = self._input.pop()
            if frame is not None:
                self._counts["frames_in"] += 1
                self._had_input = True
            return frame

    def _count_silence(self, late: bool) -> None:
        with self._lock:
            self._counts["late_frames" if late else "lead_in_frames"] += 1

    def _trim_spare(self, slack_frames: int, settle_ticks: int | None) -> int:
        """Realtime jitter buffer, run by each tick after it took (or missed) this session's
        frame: drops the spare whole frames `SpareTrimmer` gives up, oldest first, so a
        client's frame phase is kept. Spare frames of a start burst are exempt (`StartBurst`:
        catch-up steps take them). Returns the frames dropped."""
        with self._lock:
            spare = len(self._input) // FRAME_SIZE
            spare -= self._burst.after_tick(spare)  # issue 16: the start burst is not trimmed
            drop = self._spare.frames_to_drop(spare, slack_frames, settle_ticks)
            if drop:
                self._input.drop_oldest(drop * FRAME_SIZE)
                self._counts["jitter_dropped_frames"] += drop
                self._counts["dropped_input_samples"] += drop * FRAME_SIZE
            return drop

    # issue 16: catch-up steps for a start burst (scheduler.Scheduler._catch_up)
    def _catchup_due(self) -> bool:
        return self._burst.owed > 0

    def _take_catchup_frame(self) -> np.ndarray | None:
        """The next input frame for an extra step, while the start burst is owed one."""
        with self._lock:
            if len(self._input) < FRAME_SIZE or not self._burst.take():
                return None
            frame = self._input.pop()
            self._counts["frames_in"] += 1
            self._counts["catchup_frames"] += 1
            return frame

    def _output_backlog(self) -> int:
        return len(self._out)

    def _frames_out(self) -> int:
        return self._counts["frames_out"]

    def _deliver(self, pcm: np.ndarray, text: str | None, tokens: np.ndarray | None, max_frames: int) -> int:
        """Queue an output frame; drop the oldest beyond `max_frames`. Returns frames dropped."""
        with self._lock:
            frame = OutFrame(pcm=pcm, text=text, index=self._counts["frames_out"], tokens=tokens)
            dropped = 0
            while len(self._out) >= max_frames:
                self._out.popleft()
                dropped += 1
            self._out.append(frame)
            self._counts["frames_out"] += 1
            self._counts["dropped_output_frames"] += dropped
            self._wake()
            return dropped

    def _joined(self, seconds: float, cache_hit: bool) -> None:
        self._prefill_s = seconds
        self._cache_hit = cache_hit

    def _became_ready(self) -> None:
        with self._lock:
            self._was_ready = True
            self._wake()


class SessionManager:
    """Admission, queueing and the sessions around one engine and its scheduler (the inference
    thread and frame clock, `engine.scheduler.Scheduler`). One per process.

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
      start_burst_s: realtime; input a session holds at its start beyond real time (audio kept
        from before it ran, a client's queue flushed after its handshake) that the jitter buffer
        leaves alone and catch-up steps consume (default: `max_input_s`; 0 = none).
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
        start_burst_s: float | None = None,
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
        burst_s = max_input_s if start_burst_s is None else min(start_burst_s, max_input_s)
        self.start_burst_frames = int(burst_s * SAMPLE_RATE) // FRAME_SIZE if realtime else 0
        self.output_frames = output_frames
        self.lossless = (not realtime) if lossless is None else lossless
        self.retry_after_s = retry_after_s
        self.frame_period_s = frame_period_s
        self.max_catchup_ticks = max_catchup_ticks
        self.metrics = SessionMetrics.create()
        self.cache = PersonaCache(cache_bytes)

        self._scheduler = Scheduler(
            engine,
            housekeeping=self._expire_tickets,
            metrics=self.metrics,
            cache=self.cache,
            close=self._close,
            close_all=self._close_all,
            realtime=realtime,
            lossless=self.lossless,
            frame_period_s=frame_period_s,
            max_catchup_ticks=max_catchup_ticks,
            late_wait_s=late_wait_s,
            input_slack_frames=self.input_slack_frames,
            input_settle_ticks=self.input_settle_ticks,
            output_frames=output_frames,
            max_call_frames=self.max_call_frames,
            idle_timeout_s=idle_timeout_s,
        )
        # One lock for the slot table (the scheduler's) and the queue: admission moves sessions
        # between them atomically.
        self._cond = self._scheduler.cond
        self._queue: list[Session] = []
        self._sessions: dict[str, Session] = {}
        self._tickets: dict[str, Ticket] = {}  # reserved slots not yet redeemed
        self._redeeming = 0  # tickets presented to an `open` still preparing its persona
        self._shut_down = False  # open() does not restart a manager that was shut down
        self._prepare_pool: ThreadPoolExecutor | None = None  # made by start(), ended by shutdown()

    # ---- public API -------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.engine.num_slots

    @property
    def active_count(self) -> int:
        """Sessions holding a slot (joining or running)."""
        return self._scheduler.held_count

    @property
    def queued_count(self) -> int:
        return len(self._queue)

    @property
    def reserved_count(self) -> int:
        """Slots set aside by reservation tickets (not yet redeemed, not expired)."""
        with self._cond:
            self._expire_tickets()
            return len(self._tickets) + self._redeeming

    @property
    def available(self) -> int:
        """Slots an `open` without a ticket could take now (0 = it would queue or be refused)."""
        with self._cond:
            self._expire_tickets()
            return max(0, self._unreserved_free()) if not self._queue else 0

    def reserve(self, ttl_s: float = 20.0, persona: Persona | None = None) -> Ticket:
        """Set a slot aside for one later `open(..., ticket=ticket.id)`.

        The slot counts as taken (for every other open, for queueing, for readiness) until the
        ticket is redeemed, cancelled (`cancel`) or `ttl_s` passes. Raises CapacityError when no
        slot is free for it (reservations never jump the queue). `persona` is used by an `open`
        that redeems the ticket without naming one.
        """
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        with self._cond:
            self._expire_tickets()
            if self._scheduler.stopping or self._shut_down:
                raise EngineError("the session manager is shutting down")
            if self._queue or self._unreserved_free() <= 0:
                self.metrics.tickets.inc(label="refused")
                self.metrics.sessions_rejected.inc(label="reserve_full")
                raise CapacityError(
                    f"all {self.capacity} sessions are busy or reserved; retry in {self.retry_after_s:g} s",
                    retry_after_s=self.retry_after_s,
                )
            ticket = Ticket(secrets.token_urlsafe(18), time.monotonic() + ttl_s, persona)
            self._tickets[ticket.id] = ticket
            self.metrics.tickets.inc(label="issued")
            self._update_gauges()
            return ticket

    def cancel(self, ticket_id: str) -> bool:
        """Give a reserved slot back (e.g. the call it was for hung up first). True when the
        ticket was still outstanding."""
        with self._cond:
            ticket = self._tickets.pop(ticket_id, None)
            if ticket is None:
                return False
            self.metrics.tickets.inc(label="cancelled")
            self._admit_from_queue()
            self._update_gauges()
            self._cond.notify_all()
            return True

    @property
    def sessions(self) -> list[Session]:
        """Every session not yet closed (queued, joining or running)."""
        with self._cond:
            return list(self._sessions.values())

    async def start(self) -> None:
        """Start the inference thread (idempotent; also restarts a manager after `shutdown`)."""
        with self._cond:
            if self._scheduler.alive:
                return
            self._shut_down = False
            if self._prepare_pool is None:
                self._prepare_pool = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="personaplex-prepare"
                )
            self._scheduler.start()

    async def open(self, persona: Persona | None = None, *, ticket: str | None = None) -> Session:
        """Admit a conversation. Returns at once (prefill happens on the inference thread; await
        `session.ready()`). Raises PersonaError for a bad persona, CapacityError when full,
        TicketError for a ticket that is unknown, expired or used.

        With `ticket` (from `reserve`) the session takes the slot set aside for it, ahead of any
        queue; `persona` may then be None to use the ticket's.
        """
        if not self._shut_down:
            await self.start()
        reserved: Ticket | None = None
        with self._cond:
            if ticket is not None:
                reserved = self._redeem(ticket)
            else:
                self._check_capacity()  # refuse before doing any work when clearly full
            pool = self._prepare_pool
        try:
            chosen = persona if persona is not None else (reserved.persona if reserved else None)
            if chosen is None:
                raise PersonaError("no persona given (and the ticket carries none)")
            loop = asyncio.get_running_loop()
            # One prepare at a time: engines need not make `prepare` re-entrant (the real one
            # plans prompts on a shared scratch ring), and it keeps CPU for the inference thread.
            prepared = await loop.run_in_executor(pool, self.engine.prepare, chosen)
        except BaseException:
            if reserved is not None:
                with self._cond:
                    self._redeeming -= 1
                    self._admit_from_queue()
                    self._update_gauges()
            raise
        session = Session(self, prepared)
        with self._cond:
            if reserved is not None:
                self._redeeming -= 1
                slot = self._scheduler.free_slot()  # held + reserved <= capacity: one is free
                if slot is None:
                    raise EngineError("internal: a redeemed ticket found no free slot")
                self._sessions[session.id] = session
                self._assign(session, slot)
            else:
                self._check_capacity()
                self._sessions[session.id] = session
                if self._unreserved_free() > 0 and not self._queue:
                    self._assign(session, self._scheduler.free_slot())
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
            self._shut_down = True  # from here on, open() and reserve() refuse
            self._tickets.clear()
            pool, self._prepare_pool = self._prepare_pool, None
        for session in self.sessions:
            self._close(session, "shutdown")
        # After the closes: the thread releases their slots in the engine before it ends.
        thread = self._scheduler.request_stop()
        if pool is not None:
            pool.shutdown(wait=False)
        if thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, thread.join)
        self._update_gauges()

    # ---- admission (callers hold self._cond) ------------------------------------------------

    def _unreserved_free(self) -> int:
        """Free slots not set aside by tickets (may be negative while a redeemed ticket's
        session is being prepared and slots are being handed back)."""
        free = self.capacity - self._scheduler.held_count
        return free - len(self._tickets) - self._redeeming

    def _redeem(self, ticket_id: str) -> Ticket:
        self._expire_tickets()
        if self._scheduler.stopping or self._shut_down:
            raise EngineError("the session manager is shutting down")
        ticket = self._tickets.pop(ticket_id, None)
        if ticket is None:
            self.metrics.tickets.inc(label="refused")
            self.metrics.sessions_rejected.inc(label="bad_ticket")
            raise TicketError("unknown, expired or already used reservation ticket")
        self._redeeming += 1
        self.metrics.tickets.inc(label="redeemed")
        return ticket

    def _expire_tickets(self) -> None:
        """Drop tickets past their TTL and hand their slots to the queue. Callers hold
        `_cond` (or it is the scheduler's housekeeping call, which takes it)."""
        if not self._tickets:
            return
        with self._cond:
            now = time.monotonic()
            expired = [t for t in self._tickets.values() if t.expires_at <= now]
            if not expired:
                return
            for ticket in expired:
                del self._tickets[ticket.id]
            self.metrics.tickets.inc(len(expired), label="expired")
            self._admit_from_queue()
            self._update_gauges()
            self._cond.notify_all()

    def _check_capacity(self) -> None:
        if self._scheduler.stopping or self._shut_down:
            raise EngineError("the session manager is shutting down")
        if self._unreserved_free() > 0 and not self._queue:
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

    def _assign(self, session: Session, slot: int) -> None:
        session.queue_position = None
        session._queue_wait_s = time.monotonic() - session._opened_at
        self._scheduler.assign(session, slot)

    def _admit_from_queue(self) -> None:
        moved = False
        while self._queue:
            slot = self._scheduler.free_slot()
            if slot is None or self._unreserved_free() <= 0:
                break
            self._assign(self._queue.pop(0), slot)
            moved = True
        if moved:
            for i, waiting in enumerate(self._queue):
                waiting.queue_position = i + 1

    def _update_gauges(self) -> None:
        self.metrics.active_slots.set(self.active_count)
        self.metrics.queued_sessions.set(len(self._queue))
        self.metrics.reserved_slots.set(len(self._tickets) + self._redeeming)

    # ---- closing (any thread) ---------------------------------------------------------------

    def _close(self, session: Session, reason: str, error: BaseException | None = None) -> None:
        with self._cond:
            if session._state is SlotState.CLOSED:
                return
            previous = session._state
            session._state = SlotState.CLOSED
            session.close_reason = reason
            session._error = error
            if previous is SlotState.QUEUED:
                self._queue.remove(session)
                for i, waiting in enumerate(self._queue):
                    waiting.queue_position = i + 1
                session.queue_position = None
            elif self._scheduler.vacate(session):  # the slot is free for admission now
                self._admit_from_queue()
            self._sessions.pop(session.id, None)
            session._prepared = None
            self.metrics.sessions_closed.inc(label=reason)
            self._update_gauges()
            self._cond.notify_all()
        with session._lock:
            session._input.clear()
            session._wake()

    def _close_all(self, reason: str, error: BaseException) -> None:
        """The inference thread died: end every session, queued ones too."""
        for session in self.sessions:
            self._close(session, reason, error)
