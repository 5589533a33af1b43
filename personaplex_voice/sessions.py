"""The embedded session host: `SessionManager` and its `Session`s, one engine in this process.

The manager is the thin asyncio layer around the engine's `Scheduler`
(`personaplex_voice.engine.scheduler`), which owns every session's state (queue, tickets, slots,
transitions) and runs the inference thread. Here live what is not state: preparing a persona on
the prepare thread, each session's input and output buffers (`SessionStream`, the thread's side
of a session), and handing frames and state changes to whichever asyncio loop awaits them
(`loop.call_soon_threadsafe`).

Transports live on any asyncio loop: they `push` audio into thread-safe bounded buffers and
await frames; they see this module only through the declared API
(`personaplex_voice.session_api`: `SessionHost`, `CallSession`). See docs/sessions.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from personaplex_voice.audio.framing import FrameBuffer
from personaplex_voice.engine.arrivals import ArrivalConfig
from personaplex_voice.engine.base import (
    FRAME_SIZE,
    SAMPLE_RATE,
    Engine,
    EngineError,
    Persona,
    PersonaError,
    PreparedPersona,
    SaturatedError,
    VoiceInfo,
)
from personaplex_voice.engine.headroom import DISABLED, Headroom, HeadroomConfig, Verdict
from personaplex_voice.engine.jitter import SpareTrimmer
from personaplex_voice.engine.persona_cache import PersonaCache
from personaplex_voice.engine.scheduler import (
    FRAME_SECONDS,
    Clock,
    RecordReadout,
    ScheduledSession,
    Scheduler,
    SchedulerConfig,
    SessionState,
    Ticket,
    TicketError,
)
from personaplex_voice.engine.start_burst import StartBurst
from personaplex_voice.metrics import LabelledSnapshot, SessionMetrics
from personaplex_voice.session_api import OutFrame, SessionClosed, clock_slips, occupancy, pushed_samples

__all__ = [
    "OutFrame",
    "Session",
    "SessionClosed",
    "SessionManager",
    "Ticket",
    "TicketError",
    "pushed_samples",
]


# Input pieces up to 250 ms are taken as a client's own cushion (`Session.expect_input_pieces`):
# longer ones would hide a real burst.
MAX_PIECE_CUSHION_FRAMES = 2


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class SessionStream:
    """A session's buffers and waiters: the inference thread's side of it (`SlotStream`) and the
    asyncio plumbing that wakes its awaiters. `_lock` guards everything here."""

    def __init__(self, session: Session, config: SchedulerConfig, clock: Clock, metrics: SessionMetrics):
        self.session = session
        self._clock = clock
        self._metrics = metrics
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        # a start burst larger than the input bound (a slow prefill) is kept whole: see
        # SchedulerConfig.start_burst_frames
        bound = max(config.max_input_samples, config.start_burst_frames * FRAME_SIZE)
        self._input = FrameBuffer(FRAME_SIZE, max_samples=bound)
        self._out: deque[OutFrame] = deque()
        self._input_ended = False
        self._had_input = False  # a full frame was consumed at least once
        self._last_input = clock.now()
        self._spare = SpareTrimmer()  # realtime jitter buffer policy (inference thread only)
        # Input kept from before the session ran (or flushed by a client right after its
        # handshake) is a start burst: exempt from the jitter buffer, consumed by catch-up steps
        # (engine/start_burst.py; inference thread only).
        # The burst arrives within the input bound's worth of ticks (a bridge hands over what it
        # held right after `ready`); a longer allowance must not widen that window.
        frames = config.start_burst_frames
        self._burst = StartBurst(frames, window_ticks=min(frames, config.max_input_samples // FRAME_SIZE))
        # Whole frames the client's own input pieces leave spare between ticks (`expect_pieces`):
        # neither a start burst to catch up nor late input to trim.
        self._piece_cushion = 0
        self.counts = {
            "frames_in": 0,
            "frames_out": 0,
            "late_frames": 0,
            "lead_in_frames": 0,
            "dropped_output_frames": 0,
            "dropped_input_samples": 0,
            "jitter_dropped_frames": 0,
            "dropped_pre_ready_samples": 0,
            "catchup_frames": 0,
            # Late frames since the caller's last audio: silence put in the call only once its
            # audio resumes (a caller who hung up is not a slip of the clock).
            "trailing_late_frames": 0,
        }

    # ---- the transport's side (Session calls these) ----------------------------------------

    def push(self, x: np.ndarray) -> int:
        """Buffer input (copied); returns the samples the backlog bound dropped."""
        with self._lock:
            dropped = self._input.push(x)
            self._last_input = self._clock.now()
            if dropped:
                self.counts["dropped_input_samples"] += dropped
            return dropped

    def expect_pieces(self, samples: int) -> None:
        """The client pushes its input in pieces of about `samples` (a carrier's 100 ms messages):
        after some ticks up to ceil(piece / frame) - 1 whole frames stay queued that the next
        ticks take before the next piece comes. They are the client's cushion: catching them up
        as a start burst would leave the next tick nothing (silence put in, and the call one frame
        later for good, each time), trimming them would drop its audio."""
        frames = -(-max(0, samples) // FRAME_SIZE) - 1
        with self._lock:
            self._piece_cushion = min(max(0, frames), MAX_PIECE_CUSHION_FRAMES)

    def count_pre_ready(self, samples: int) -> None:
        """Input the bound dropped before the session ran (its caller's first words)."""
        with self._lock:
            self.counts["dropped_pre_ready_samples"] += samples

    def end(self) -> bool:
        """No more input: the partial last frame is padded. False when it had ended already."""
        with self._lock:
            if self._input_ended:
                return False
            partial = len(self._input) % FRAME_SIZE
            if partial:
                self._input.push(np.zeros(FRAME_SIZE - partial, np.float32))
            self._input_ended = True
            return True

    def take_output(self) -> OutFrame | None:
        """The oldest queued output frame, or None (never waits)."""
        with self._lock:
            return self._out.popleft() if self._out else None

    def next_frame(self) -> tuple[OutFrame | None, asyncio.Future | None]:
        """(an output frame, None), or (None, a future for the next change) while none is queued,
        or (None, None) once the session ended and every frame was taken."""
        with self._lock:
            if self._out:
                return self._out.popleft(), None
            if self.session.closed:
                return None, None
            return None, self._add_waiter()

    def wait_unless(self, done: Callable[[], bool]) -> asyncio.Future | None:
        """None when `done()`, else a future for the next change (checked and registered under
        the lock every change is announced under, so none slips in between)."""
        with self._lock:
            return None if done() else self._add_waiter()

    def sizes(self) -> tuple[dict[str, int], int, int]:
        with self._lock:
            return dict(self.counts), len(self._input), len(self._out)

    # ---- the inference thread's side (`engine.scheduler.SlotStream`) -------------------------

    @property
    def had_input(self) -> bool:
        return self._had_input

    @property
    def input_ended(self) -> bool:
        return self._input_ended

    @property
    def last_input(self) -> float:
        return self._last_input

    def has_frame(self) -> bool:
        return len(self._input) >= FRAME_SIZE

    def take_frame(self) -> np.ndarray | None:
        with self._lock:
            frame = self._input.pop()
            if frame is not None:
                self.counts["frames_in"] += 1
                self._had_input = True
                self._resumed()
            return frame

    def count_silence(self, late: bool) -> None:
        with self._lock:
            self.counts["late_frames" if late else "lead_in_frames"] += 1
            self.counts["trailing_late_frames"] += late

    def _resumed(self) -> None:
        """The caller's audio came after late frames: they were silence put in the call."""
        run = self.counts["trailing_late_frames"]
        if run:
            self.counts["trailing_late_frames"] = 0
            self._metrics.audio_inserted.inc(run * FRAME_SECONDS, label="late_input")

    def trim_spare(self, slack_frames: int, settle_ticks: int | None) -> int:
        """Drops the spare whole frames `SpareTrimmer` gives up, oldest first, so a client's
        frame phase is kept; a start burst's frames are exempt (catch-up steps take them)."""
        with self._lock:
            spare = len(self._input) // FRAME_SIZE
            spare -= min(spare, self._piece_cushion)  # the client's own cushion stays as it is
            spare -= self._burst.after_tick(spare)
            drop = self._spare.frames_to_drop(spare, slack_frames, settle_ticks)
            if drop:
                self._input.drop_oldest(drop * FRAME_SIZE)
                self.counts["jitter_dropped_frames"] += drop
                self.counts["dropped_input_samples"] += drop * FRAME_SIZE
            return drop

    def catchup_due(self) -> bool:
        return self._burst.owed > 0

    def take_catchup_frame(self) -> np.ndarray | None:
        with self._lock:
            if len(self._input) < FRAME_SIZE or not self._burst.take():
                return None
            frame = self._input.pop()
            self.counts["frames_in"] += 1
            self.counts["catchup_frames"] += 1
            self._resumed()
            return frame

    def output_backlog(self) -> int:
        return len(self._out)

    def frames_out(self) -> int:
        return self.counts["frames_out"]

    def deliver(self, pcm: np.ndarray, text: str | None, tokens: np.ndarray | None, max_frames: int) -> int:
        with self._lock:
            frame = OutFrame(pcm=pcm, text=text, index=self.counts["frames_out"], tokens=tokens)
            dropped = 0
            while len(self._out) >= max_frames:
                self._out.popleft()
                dropped += 1
            self._out.append(frame)
            self.counts["frames_out"] += 1
            self.counts["dropped_output_frames"] += dropped
            self._wake()
            return dropped

    def state_changed(self) -> None:
        with self._lock:
            self._wake()

    def ended(self) -> None:
        with self._lock:
            self._input.clear()
            self._wake()

    # ---- asyncio plumbing (callers hold `_lock`) ----------------------------------------------

    def _add_waiter(self) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._waiters.append((loop, fut))
        return fut

    def _wake(self) -> None:
        for loop, fut in self._waiters:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits there any more
                loop.call_soon_threadsafe(_resolve, fut)
        self._waiters.clear()


class Session(RecordReadout):
    """One conversation on this process's engine (a `session_api.CallSession`). Made by
    `SessionManager.open`; its state is the scheduler's `SessionRecord`, read here."""

    def __init__(self, manager: SessionManager, prepared: PreparedPersona):
        self.id = uuid.uuid4().hex[:16]
        self.persona: Persona = prepared.persona
        self._manager = manager
        self._scheduler = manager.scheduler
        self._stream = SessionStream(self, manager.config, self._scheduler.clock, manager.metrics)
        self._record = ScheduledSession(self.id, prepared, self._stream, self._scheduler.clock.now())

    # ---- state (read off the scheduler's record) ----------------------------------------------

    @property
    def record(self) -> ScheduledSession:
        return self._record

    @property
    def slot(self) -> int | None:
        return self._record.slot

    @property
    def stats(self) -> dict[str, Any]:
        counts, backlog, queued_out = self._stream.sizes()
        record = self._record
        dropped, inserted = clock_slips(counts)
        return {
            "id": self.id,
            "state": record.state.value,
            "slot": record.slot,
            "queue_position": record.queue_position,
            "close_reason": record.close_reason,
            **counts,
            "input_backlog_samples": backlog,
            "output_queued_frames": queued_out,
            "cache_hit": record.cache_hit,
            "prefill_ms": None if record.prefill_s is None else record.prefill_s * 1000.0,
            "queue_wait_ms": None if record.queue_wait_s is None else record.queue_wait_s * 1000.0,
            "duration_s": counts["frames_out"] * FRAME_SECONDS,
            "dropped_ms": dropped,
            "inserted_ms": inserted,
        }

    # ---- the API ----------------------------------------------------------------------------

    async def ready(self) -> None:
        """Wait until the session holds a slot with its system prompt in.

        Raises the PersonaError / EngineError that failed the prefill, or SessionClosed when the
        session ended before it became ready. Returns at once for a session that was ready.
        """
        record = self._record
        while (fut := self._stream.wait_unless(lambda: record.was_ready or record.closed)) is not None:
            await fut
        if record.was_ready:
            return
        if record.error is not None:
            raise record.error
        raise SessionClosed(record.close_reason or "closed")

    def push(self, pcm: np.ndarray) -> None:
        """Queue user audio: float32 mono 24 kHz in [-1, 1], any length. Never blocks.

        Audio pushed after the session ended is ignored. Audio pushed before the session is
        ready (queued, prefilling) is kept, in order, up to the start-burst bound (`start_burst_s`,
        5 s by default in realtime; at least the input bound `max_input_s`): the caller's first
        words. Beyond the bound the oldest samples go (counted, before the
        session runs also in `dropped_pre_ready_samples`).
        Raises ValueError for audio that is not float, not 1-D or not finite.
        """
        x = pushed_samples(pcm)
        if self._record.closed or self._stream.input_ended:
            return
        dropped = self._stream.push(x)
        if dropped:
            if self._record.state is not SessionState.RUNNING:
                self._stream.count_pre_ready(dropped)
            self._manager.metrics.dropped_input_samples.inc(dropped)
            self._manager.metrics.audio_dropped.inc(dropped / SAMPLE_RATE, label="input_bound")
        self._scheduler.input_arrived()

    def end_input(self) -> None:
        """No more audio will be pushed. A partial last frame is padded with zeros; once the
        buffered input has been stepped the session closes with reason "input_ended"."""
        if self._record.closed:
            return
        if self._stream.end():
            self._scheduler.input_arrived()

    async def frames(self) -> AsyncIterator[OutFrame]:
        """Output frames as the engine makes them; ends when the session has ended and every
        produced frame was taken."""
        while True:
            frame, fut = self._stream.next_frame()
            if frame is not None:
                self._scheduler.output_taken()
                yield frame
            elif fut is None:
                return
            else:
                await fut

    def expect_input_pieces(self, seconds: float) -> None:
        """The transport pushes the caller's audio in pieces of about `seconds` (a carrier that
        sends 100 ms messages): the whole frames such a piece leaves queued between ticks are
        its cushion, kept for the ticks before the next piece, neither caught up as a start
        burst nor trimmed (docs/sessions.md). Call it before the first push; 0 for frame-sized
        or smaller pieces (the default)."""
        self._stream.expect_pieces(round(max(0.0, seconds) * SAMPLE_RATE))

    def seconds_to_next_tick(self) -> float | None:
        """How long until the engine's next tick takes an input frame (None while its clock is
        idle: the first full frame of a ready session then starts it at once). Transports that
        pace input (the phone bridges) use it to phase their audio against the ticks."""
        return self._scheduler.seconds_to_next_tick()

    async def close(self, reason: str = "client") -> None:
        """End the session and free its slot at once (idempotent)."""
        self._scheduler.abort(self._record, reason)

    def close_nowait(self, reason: str = "client") -> None:
        """`close` for synchronous code (any thread)."""
        self._scheduler.abort(self._record, reason)

    def __repr__(self) -> str:
        return f"<Session {self.id} {self._record.state.value} slot={self._record.slot}>"


class SessionManager:
    """The embedded `session_api.SessionHost`: one engine, its scheduler, its sessions.

    `SessionManager(engine, config)` or `SessionManager(engine, **options)` with the keywords
    of `SchedulerConfig.create` (realtime, max_queue, max_call_s, idle_timeout_s, late_wait_s,
    input_slack_s, input_settle_s, max_input_s, output_frames, lossless, retry_after_s,
    frame_period_s, max_catchup_ticks); `cache_bytes` is the persona cache's budget (0: off).
    `headroom`: the saturation policy's knobs (engine/headroom.py; realtime managers only, None
    for the defaults); while the process has no real-time headroom, `open` without a ticket and
    `reserve` raise `SaturatedError` and the sessions waiting in the queue are shed. `arrivals`:
    how call set-up is paced on the transports' event loop (engine/arrivals.py; realtime only).
    """

    def __init__(
        self,
        engine: Engine,
        config: SchedulerConfig | None = None,
        *,
        cache_bytes: int = 1 << 30,
        clock: Clock | None = None,
        headroom: HeadroomConfig | None = None,
        arrivals: ArrivalConfig | None = None,
        **options: Any,
    ):
        if config is not None and options:
            raise TypeError("give either a SchedulerConfig or its options, not both")
        self.engine = engine
        self.config = config if config is not None else SchedulerConfig.create(**options)
        self.metrics = SessionMetrics.create()
        self.cache = PersonaCache(cache_bytes)
        self.scheduler = Scheduler(engine, self.config, metrics=self.metrics, cache=self.cache, clock=clock)
        scheduler = self.scheduler
        self.headroom = Headroom(
            headroom if self.config.realtime else DISABLED,
            now=scheduler.clock.now,
            engine=scheduler.engine_load,
            active=lambda: scheduler.held_count + scheduler.reserved_count,
            retry_after_s=self.config.retry_after_s,
            arrivals=arrivals if self.config.realtime else ArrivalConfig(enabled=False),
        )
        self.headroom.on_change(self._saturation_changed)
        self._shut_down = False  # open() does not restart a manager that was shut down
        self._prepare_pool: ThreadPoolExecutor | None = None  # made by start(), ended by shutdown()

    # ---- occupancy -----------------------------------------------------------------------------

    @property
    def realtime(self) -> bool:
        return self.config.realtime

    @property
    def model_name(self) -> str:
        return self.engine.name

    @property
    def capacity(self) -> int:
        return self.scheduler.capacity

    @property
    def active_count(self) -> int:
        """Sessions holding a slot (joining or running)."""
        return self.scheduler.held_count

    @property
    def queued_count(self) -> int:
        return self.scheduler.queued_count

    @property
    def reserved_count(self) -> int:
        """Slots set aside by reservation tickets (not yet redeemed, not expired)."""
        return self.scheduler.reserved_count

    @property
    def available(self) -> int:
        """Slots an `open` without a ticket could take now (0 = it would queue or be refused;
        0 too while the process has no real-time headroom)."""
        if self.headroom.refusing:
            return 0
        return self.scheduler.available

    @property
    def sessions(self) -> list[Session]:
        """Every session not yet closed (queued, joining or running)."""
        return [record.stream.session for record in self.scheduler.records]  # type: ignore[attr-defined]

    def voices(self) -> list[VoiceInfo]:
        return list(self.engine.voices())

    # ---- life ----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the inference thread (idempotent; also restarts a manager after `shutdown`)."""
        if self.scheduler.alive:
            return
        self._shut_down = False
        if self._prepare_pool is None:
            self._prepare_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="personaplex-prepare")
        self.scheduler.start()

    async def shutdown(self) -> None:
        """Close every session (reason "shutdown") and stop the inference thread."""
        self._shut_down = True
        pool, self._prepare_pool = self._prepare_pool, None
        thread = self.scheduler.shut_down("shutdown")
        if pool is not None:
            pool.shutdown(wait=False)
        if thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, thread.join)

    # ---- sessions and tickets --------------------------------------------------------------------

    async def open(self, persona: Persona | None = None, *, ticket: str | None = None) -> Session:
        """Admit a conversation. Returns at once (prefill happens on the inference thread; await
        `session.ready()`). Raises PersonaError for a bad persona, CapacityError when full
        (SaturatedError when the process has no real-time headroom left), TicketError for a
        ticket that is unknown, expired or used.

        With `ticket` (from `reserve`) the session takes the slot set aside for it, ahead of any
        queue; `persona` may then be None to use the ticket's.
        """
        if self._shut_down:
            raise EngineError("the session manager is shutting down")
        if ticket is None:
            self._check_headroom()  # a ticket's call was admitted when it was reserved
        await self.start()
        scheduler = self.scheduler
        reserved = scheduler.redeem(ticket) if ticket is not None else None
        if reserved is None:
            scheduler.check_open()  # refuse before doing any work when clearly full
        try:
            chosen = persona if persona is not None else (reserved.persona if reserved else None)
            if chosen is None:
                raise PersonaError("no persona given (and the ticket carries none)")
            # One prepare at a time: engines need not make `prepare` re-entrant (the real one
            # plans prompts on a shared scratch ring), and it keeps CPU for the inference thread.
            loop = asyncio.get_running_loop()
            prepared = await loop.run_in_executor(self._prepare_pool, self.engine.prepare, chosen)
        except BaseException:
            if reserved is not None:
                scheduler.unredeem()
            raise
        session = Session(self, prepared)
        scheduler.add(session.record, redeemed=reserved is not None)
        if reserved is None:
            self.headroom.admitted()
        return session

    def reserve(
        self, ttl_s: float = 20.0, persona: Persona | None = None, ticket_id: str | None = None
    ) -> Ticket:
        """Set a slot aside for one later `open(..., ticket=ticket.id)`.

        The slot counts as taken (for every other open, for queueing, for readiness) until the
        ticket is redeemed, cancelled (`cancel`) or `ttl_s` passes. Raises CapacityError when no
        slot is free for it (reservations never jump the queue). `persona` is used by an `open`
        that redeems the ticket without naming one. `ticket_id` names the ticket (a cluster
        front-end mints the id its engine worker reserves under); by default a new one.
        """
        if self._shut_down:
            raise EngineError("the session manager is shutting down")
        self._check_headroom()
        ticket = self.scheduler.reserve(ttl_s, persona, ticket_id)
        self.headroom.admitted()
        return ticket

    def cancel(self, ticket_id: str) -> bool:
        """Give a reserved slot back (e.g. the call it was for hung up first). True when the
        ticket was still outstanding."""
        return self.scheduler.cancel(ticket_id)

    # ---- what the server shows ---------------------------------------------------------------------

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        counts = occupancy(self)
        headroom = self.headroom.describe()
        if headroom["saturated"]:
            return False, {"status": "saturated", **counts, "headroom": headroom}
        if counts["available"] <= 0:
            return False, {"status": "full", **counts, "headroom": headroom}
        return True, {"status": "ready", **counts, "headroom": headroom}

    def describe(self) -> dict[str, Any]:
        frontend = {"id": "embedded", "pid": os.getpid(), "torch_loaded": "torch" in sys.modules}
        return {
            "mode": "embedded",
            "frontend": frontend,
            **occupancy(self),
            "headroom": self.headroom.describe(),
        }

    def metrics_snapshots(self) -> list[LabelledSnapshot]:
        return [LabelledSnapshot({}, {**self.metrics.snapshot(), **self.headroom.metrics.snapshot()})]

    # ---- saturation ------------------------------------------------------------------------------

    def _check_headroom(self) -> None:
        try:
            self.headroom.check()
        except SaturatedError:
            self.metrics.sessions_rejected.inc(label="saturated")
            raise

    def _saturation_changed(self, saturated: bool, verdict: Verdict) -> None:
        """Saturated: the sessions waiting for a slot are told so now ("saturated"), rather than
        admitted into a process that cannot carry them (their callers may go elsewhere)."""
        if not saturated:
            return
        for record in self.scheduler.records:
            if record.state is SessionState.QUEUED:
                error = SaturatedError(
                    f"this server ran out of real-time headroom ({verdict.why}) while the call waited",
                    retry_after_s=self.config.retry_after_s,
                )
                self.scheduler.abort(record, "saturated", error)
