"""The `Scheduler`: the one owner of every session's state, and the frame clock that steps them.

Shaped like vLLM's scheduler, which owns its requests: the waiting queue, the reservation
tickets, the slot table and every state transition of a session (`add`, `abort`, and the
finishes it decides itself: input used up, call too long, idle) live here, configured by one
frozen `SchedulerConfig`. The session layer (`personaplex_voice.sessions`) keeps each session's
audio buffers and its asyncio waiters and only *reads* the `SessionRecord` this module writes.

One inference thread (`run`) steps every running slot of an `Engine` per tick. Only it calls the
engine's `begin_start`, `snapshot`, `restore`, `step` and `release`. A slot taken from one
session and given to the next becomes two entries in one FIFO of slot operations that the thread
carries out in order, so the slot is always released in the engine before it is started again.

Between ticks the thread carries out those operations (releases; joins: a restore from the
persona cache, or the start of a system prompt prefill), runs prefill chunks while the next tick
is not due (chunked prefill: a long prompt spreads over as many gaps as it needs, so joining
callers never hold up running ones), runs catch-up steps for sessions holding a start burst
(input kept from before they ran: `engine.start_burst`) while one more step fits, ends sessions
past their limits and expires tickets.

Two clocks:
- realtime: a tick every frame period on a deadline clock. A session takes part from its first
  full input frame on (the published server answers each input frame). A streaming slot whose
  next frame is missing at the tick (after a short bounded wait) gets a frame of silence,
  counted as late; spare whole frames are trimmed by the session's jitter buffer, so lateness
  never adds lasting latency.
- non-realtime: a tick runs as soon as every running slot has a full frame buffered (or has
  ended its input) and, lossless, room for its output.

Time comes from a `Clock` (`MonotonicClock` in production), so tests can drive the whole loop on
a fake clock with a fake engine whose steps cost what the test says (tests/support_scheduler.py).

A step that fails ends only the sessions it fails for: an engine that can tell which slots are
at fault raises `SlotError` before touching any state and the others are stepped again at once;
any other error is isolated by stepping halves of the batch until each failing slot is alone.

No asyncio and no sockets here: the thread reaches a session's audio only through its
`SlotStream`. See docs/sessions.md for the policies.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from personaplex_voice.engine.base import (
    FRAME_SIZE,
    CapacityError,
    Engine,
    EngineError,
    Persona,
    PersonaError,
    PreparedPersona,
    SlotPrefill,
    StepOutput,
)
from personaplex_voice.engine.headroom import EngineLoad
from personaplex_voice.engine.persona_cache import PersonaCache
from personaplex_voice.engine.scheduler.clock import Clock, MonotonicClock
from personaplex_voice.engine.scheduler.config import FRAME_SECONDS, SchedulerConfig
from personaplex_voice.engine.scheduler.isolation import step_isolating
from personaplex_voice.engine.scheduler.records import (
    ScheduledSession,
    SessionState,
    SlotStream,
    Ticket,
    TicketError,
    WaitingQueue,
    new_ticket_id,
)
from personaplex_voice.engine.start_burst import worth_delivering
from personaplex_voice.metrics import SessionMetrics

log = logging.getLogger("personaplex_voice.engine.scheduler")

# A prefill that got no chunk for this many ticks in a row (the engine's steps leave no room in
# the frame period) gets one anyway: joining callers are slowed down, never starved.
PREFILL_STARVE_TICKS = 4
# A session's first second of streaming (in frames) is its start-up: late input then is its
# caller's audio finding its phase against the ticks, not lateness (`engine_load` leaves it out).
STARTUP_FRAMES = 12
# The idle thread wakes at least this often (tickets expire within it of their TTL).
HOUSEKEEPING_S = 0.5


@dataclass(frozen=True)
class _SlotOp:
    """One slot table change, carried out by the thread in FIFO order."""

    kind: str  # "join" (start or restore `record` in `slot`) or "release"
    slot: int
    record: ScheduledSession


@dataclass
class _Prefill:
    """A joining session's system prompt, run a chunk at a time between ticks."""

    record: ScheduledSession
    job: SlotPrefill
    seconds: float = 0.0  # engine time spent on it so far
    waited_ticks: int = 0  # ticks since it last got a chunk


@dataclass
class _Tickets:
    """Reserved slots not yet redeemed (and opens redeeming one, still preparing)."""

    outstanding: dict[str, Ticket] = field(default_factory=dict)
    redeeming: int = 0

    @property
    def held(self) -> int:
        return len(self.outstanding) + self.redeeming


class Scheduler:
    """The state of every session of one engine, and the inference thread that steps them.

    Transports never call this directly: the session layer does, from any thread. Every public
    method takes the one lock (`cond`, re-entrant) that guards the records, the queue, the
    tickets and the slot table.
    """

    def __init__(
        self,
        engine: Engine,
        config: SchedulerConfig,
        *,
        metrics: SessionMetrics | None = None,
        cache: PersonaCache | None = None,
        clock: Clock | None = None,
    ):
        self.engine = engine
        self.config = config
        self.metrics = metrics if metrics is not None else SessionMetrics.create()
        self.cache = cache if cache is not None else PersonaCache(0)
        self.clock: Clock = clock if clock is not None else MonotonicClock()

        n = engine.num_slots
        self.cond = threading.Condition(threading.RLock())
        self._slots: list[ScheduledSession | None] = [None] * n
        self._records: dict[str, ScheduledSession] = {}
        self._queue: WaitingQueue[_Queued] = WaitingQueue(config.max_queue)
        self._tickets = _Tickets()
        self._ops: deque[_SlotOp] = deque()
        self._accepting = True  # False once shut down: opens and reservations are refused
        self._stopping = False
        self._thread: threading.Thread | None = None
        # Thread-only state below.
        self._prefills: dict[int, _Prefill] = {}  # slot -> prefill in progress, oldest first
        self._chunk_seconds: deque[float] = deque(maxlen=8)  # recent prefill chunk durations
        self._join_seconds: deque[float] = deque(maxlen=8)  # recent joins (restore or prefill start)
        self._joined_since_tick = 0
        self._want_input = False  # the thread waits for pushes
        self._want_room = False  # the thread waits for consumers (lossless mode)
        self._pcm_in = np.zeros((n, FRAME_SIZE), np.float32)
        self.recent_steps: deque[float] = deque(maxlen=25)  # engine.step seconds, last 2 s
        # Per tick of the last second: (streaming sessions fed late silence, streaming sessions).
        self._recent_late: deque[tuple[int, int]] = deque(maxlen=round(1.0 / config.frame_period_s))
        self._catchup_steps: deque[float] = deque(maxlen=8)  # recent catch-up step seconds
        self._next_tick: float | None = None  # the realtime clock's next due time, when running

    # ---- occupancy (any thread) ----------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.engine.num_slots

    @property
    def held_count(self) -> int:
        """Slots held (joining or running)."""
        with self.cond:
            return sum(s is not None for s in self._slots)

    @property
    def queued_count(self) -> int:
        with self.cond:
            return len(self._queue)

    @property
    def reserved_count(self) -> int:
        """Slots set aside by tickets (outstanding, or being redeemed by an open)."""
        with self.cond:
            self._expire_tickets()
            return self._tickets.held

    @property
    def available(self) -> int:
        """Slots an open without a ticket could take now (0: it would queue or be refused)."""
        with self.cond:
            self._expire_tickets()
            return 0 if self._queue or not self._accepting else max(0, self._unreserved_free())

    @property
    def records(self) -> list[ScheduledSession]:
        """Every session not yet closed (queued, joining or running)."""
        with self.cond:
            return list(self._records.values())

    @property
    def settled(self) -> bool:
        """No slot operation waits for the thread and no prefill is in progress."""
        with self.cond:
            return not self._ops and not self._prefills

    @property
    def accepting(self) -> bool:
        return self._accepting and not self._stopping

    # ---- admission (any thread) ----------------------------------------------------------------

    def check_open(self) -> None:
        """Raise as `add` would for an open without a ticket, before its persona is prepared
        (so a full server refuses without doing any work)."""
        with self.cond:
            self._expire_tickets()
            self._check_room()

    def add(self, record: ScheduledSession, *, redeemed: bool = False) -> None:
        """Admit a new session: a slot when one is free (for a `redeemed` ticket: the slot it
        set aside), else a place in the queue; raises CapacityError when neither."""
        with self.cond:
            if redeemed:
                self._tickets.redeeming -= 1
                if not self.accepting:
                    raise EngineError("the session manager is shutting down")
                slot = self._free_slot()  # held + reserved <= capacity: one is free
                if slot is None:
                    raise EngineError("internal: a redeemed ticket found no free slot")
                self._records[record.id] = record
                self._assign(record, slot)
            else:
                self._expire_tickets()
                self._check_room()
                self._records[record.id] = record
                if self._unreserved_free() > 0 and not self._queue:
                    self._assign(record, self._free_slot())  # type: ignore[arg-type]
                else:
                    self._queue.append(_Queued(record))
            self.metrics.sessions_opened.inc()
            self._update_gauges()
            self.cond.notify_all()
        record.stream.state_changed()

    def abort(self, record: ScheduledSession, reason: str, error: BaseException | None = None) -> None:
        """End a session (idempotent; the first reason sticks). Its slot is free for admission at
        once; the thread releases it in the engine before anything later runs there."""
        with self.cond:
            previous = record.state
            if not record.mark_closed(reason, error):
                return
            if previous is SessionState.QUEUED:
                self._queue.remove(_Queued(record))
            elif self._vacate(record):
                self._admit_from_queue()
            self._records.pop(record.id, None)
            self.metrics.sessions_closed.inc(label=reason)
            self._update_gauges()
            self.cond.notify_all()
        record.stream.ended()

    def abort_all(self, reason: str, error: BaseException | None = None) -> None:
        for record in self.records:
            self.abort(record, reason, error)

    # ---- reservations (any thread) ---------------------------------------------------------------

    def reserve(self, ttl_s: float, persona: Persona | None = None, ticket_id: str | None = None) -> Ticket:
        """Set a slot aside for one later open presenting the ticket (`ticket_id`, or a new one).
        Raises CapacityError when no unreserved slot is free (reservations never jump the
        queue); an id already outstanding is refused too (a ticket is one slot)."""
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        with self.cond:
            self._expire_tickets()
            if not self.accepting:
                raise EngineError("the session manager is shutting down")
            if ticket_id is not None and ticket_id in self._tickets.outstanding:
                self.metrics.tickets.inc(label="refused")
                raise TicketError("this reservation ticket is already outstanding")
            if self._queue or self._unreserved_free() <= 0:
                self.metrics.tickets.inc(label="refused")
                self.metrics.sessions_rejected.inc(label="reserve_full")
                raise CapacityError(
                    f"all {self.capacity} sessions are busy or reserved; retry in "
                    f"{self.config.retry_after_s:g} s",
                    retry_after_s=self.config.retry_after_s,
                )
            ticket = Ticket(ticket_id or new_ticket_id(), self.clock.now() + ttl_s, persona)
            self._tickets.outstanding[ticket.id] = ticket
            self.metrics.tickets.inc(label="issued")
            self._update_gauges()
            return ticket

    def redeem(self, ticket_id: str) -> Ticket:
        """Take a ticket for an open (its slot stays set aside while the persona is prepared):
        `add(..., redeemed=True)` or `unredeem()` must follow. Raises TicketError."""
        with self.cond:
            self._expire_tickets()
            if not self.accepting:
                raise EngineError("the session manager is shutting down")
            ticket = self._tickets.outstanding.pop(ticket_id, None)
            if ticket is None:
                self.metrics.tickets.inc(label="refused")
                self.metrics.sessions_rejected.inc(label="bad_ticket")
                raise TicketError("unknown, expired or already used reservation ticket")
            self._tickets.redeeming += 1
            self.metrics.tickets.inc(label="redeemed")
            return ticket

    def unredeem(self) -> None:
        """A redeeming open failed before `add`: its slot goes back to the queue."""
        with self.cond:
            self._tickets.redeeming -= 1
            self._admit_from_queue()
            self._update_gauges()
            self.cond.notify_all()

    def cancel(self, ticket_id: str) -> bool:
        """Give a reserved slot back; True when the ticket was still outstanding."""
        with self.cond:
            if self._tickets.outstanding.pop(ticket_id, None) is None:
                return False
            self.metrics.tickets.inc(label="cancelled")
            self._admit_from_queue()
            self._update_gauges()
            self.cond.notify_all()
            return True

    # ---- the thread's life -------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the inference thread unless it runs (also after `stop`: it accepts again)."""
        with self.cond:
            if self.alive:
                return
            self._stopping = False
            self._accepting = True
            self._thread = threading.Thread(target=self.run, name="personaplex-inference", daemon=True)
            self._thread.start()

    def shut_down(self, reason: str = "shutdown") -> threading.Thread | None:
        """Refuse new opens and reservations, end every session, ask the thread to end after its
        current tick (it releases every slot in the engine first); returns it, for joining."""
        with self.cond:
            self._accepting = False
            self._tickets.outstanding.clear()
        self.abort_all(reason)
        with self.cond:
            self._update_gauges()
        return self.stop()

    def stop(self) -> threading.Thread | None:
        """Ask the loop to end after its current tick, leaving the sessions as they are (tests
        that drive `run` on a fake clock stop it this way); returns the thread, for joining."""
        with self.cond:
            self._stopping = True
            self.cond.notify_all()
            return self._thread

    def run(self) -> None:
        """The inference loop, on the calling thread, until `shut_down`."""
        try:
            self._loop()
        except BaseException:  # keep no session waiting on a dead thread
            log.exception("inference thread crashed")
            self.abort_all("engine_error", EngineError("the inference thread crashed"))
        finally:
            self._next_tick = None
            self._apply_ops(releases_only=True)
            self._prefills.clear()
            for slot, holder in enumerate(self._slots):
                if holder is not None:
                    self._safe_release(slot)

    # ---- what the session layer tells the thread (any thread) --------------------------------------

    def input_arrived(self) -> None:
        """A push or end of input."""
        if self._want_input:
            with self.cond:
                self.cond.notify_all()

    def output_taken(self) -> None:
        """A consumer took a frame."""
        if self._want_room:
            with self.cond:
                self.cond.notify_all()

    def seconds_to_next_tick(self) -> float | None:
        """When the realtime clock's next tick is due, from now (None while the clock is idle:
        then the next tick comes as soon as a ready session has a full input frame)."""
        due = self._next_tick
        if due is None or not self.config.realtime:
            return None
        now = self.clock.now()
        while due < now:  # the thread is stepping or about to: the following tick
            due += self.config.frame_period_s
        return due - now

    def engine_load(self) -> EngineLoad:
        """The clock's own load for the process's headroom (engine/headroom.py): recent step
        times over the frame period, overruns, late silence fed to streaming sessions. Any
        thread; copies of the thread's deques (taken whole under the GIL)."""
        steps = sorted(list(self.recent_steps))
        late = list(self._recent_late)
        period = self.config.frame_period_s
        step_load = steps[min(len(steps) - 1, int(0.9 * len(steps)))] / period if steps else None
        return EngineLoad(
            step_load=step_load,
            overruns=int(self.metrics.tick_overruns.value),
            late_frames=sum(n for n, _ in late),
            streaming_frames=sum(m for _, m in late),
            ticks=len(late),
        )

    def late_wait(self) -> float:
        """The wait for late input at this tick: `late_wait_s`, cut to what the engine's slowest
        recent step leaves of the frame period (minus a tenth of it as margin), so waiting for
        one late caller never makes the clock fall behind for everybody."""
        slowest = max(self.recent_steps, default=0.0)
        room = self.config.frame_period_s * 0.9 - slowest
        return max(0.0, min(self.config.late_wait_s, room))

    # ---- admission internals (callers hold `cond`) -----------------------------------------------

    def _unreserved_free(self) -> int:
        """Free slots not set aside by tickets (may be negative while a redeemed ticket's session
        is being prepared and slots are being handed back)."""
        free = sum(s is None for s in self._slots)
        return free - self._tickets.held

    def _check_room(self) -> None:
        if not self.accepting:
            raise EngineError("the session manager is shutting down")
        if self._unreserved_free() > 0 and not self._queue:
            return
        if not self._queue.full:
            return
        reason, error = self._queue.refusal(self.capacity, self.config.retry_after_s)
        self.metrics.sessions_rejected.inc(label=reason)
        raise error

    def _free_slot(self) -> int | None:
        for i, holder in enumerate(self._slots):
            if holder is None:
                return i
        return None

    def _assign(self, record: ScheduledSession, slot: int) -> None:
        """Give `record` the free `slot`; the thread joins it after every earlier operation."""
        if self._slots[slot] is not None:
            raise RuntimeError(f"slot {slot} is taken")
        record.mark_joining(slot, self.clock.now() - record.opened_at)
        self._slots[slot] = record
        self._ops.append(_SlotOp("join", slot, record))
        self.cond.notify_all()

    def _vacate(self, record: ScheduledSession) -> bool:
        slot = record.slot
        if slot is None or self._slots[slot] is not record:
            return False
        self._slots[slot] = None
        self._ops.append(_SlotOp("release", slot, record))
        return True

    def _admit_from_queue(self) -> None:
        admitted: list[ScheduledSession] = []
        while self._queue:
            slot = self._free_slot()
            if slot is None or self._unreserved_free() <= 0:
                break
            record = self._queue.pop_first().record
            self._assign(record, slot)
            admitted.append(record)
        for record in admitted:
            record.stream.state_changed()

    def _expire_tickets(self) -> None:
        outstanding = self._tickets.outstanding
        if not outstanding:
            return
        now = self.clock.now()
        expired = [t.id for t in outstanding.values() if t.expires_at <= now]
        if not expired:
            return
        for ticket_id in expired:
            del outstanding[ticket_id]
        self.metrics.tickets.inc(len(expired), label="expired")
        self._admit_from_queue()
        self._update_gauges()
        self.cond.notify_all()

    def _update_gauges(self) -> None:
        self.metrics.active_slots.set(sum(s is not None for s in self._slots))
        self.metrics.queued_sessions.set(len(self._queue))
        self.metrics.reserved_slots.set(self._tickets.held)

    # ---- the inference thread ------------------------------------------------------------------------

    def _loop(self) -> None:
        clock, config = self.clock, self.config
        next_tick: float | None = None
        while True:
            self._next_tick = next_tick if config.realtime else None
            deadline = next_tick if (config.realtime and next_tick is not None) else None
            self._control(deadline)
            with self.cond:
                if self._stopping:
                    return
                running = self._tickable()
                if not running:
                    next_tick = None
                    self._next_tick = None
                    if not self._ops and not self._prefills:
                        # Ready sessions may start streaming: a push must wake this wait.
                        self._want_input = True
                        try:
                            clock.wait(self.cond, HOUSEKEEPING_S)
                        finally:
                            self._want_input = False
                    continue
            if config.realtime:
                now = clock.now()
                if next_tick is None:
                    next_tick = now
                    self._next_tick = next_tick
                if now < next_tick:
                    with self.cond:
                        idle = not self._ops or (
                            self._joined_since_tick > 0 and not self._join_fits(next_tick)
                        )
                        if idle and not self._stopping and not self._prefill_fits(next_tick):
                            clock.wait(self.cond, next_tick - now)
                    if clock.now() < next_tick:
                        continue  # woke early for a join/close or prefill work: do it, then wait again
                self._wait_for_late(running, next_tick + self.late_wait())
            elif not self._wait_for_inputs(running):
                continue
            self._tick()
            self._joined_since_tick = 0
            if config.realtime:
                assert next_tick is not None
                next_tick += config.frame_period_s
                behind = clock.now() - next_tick
                if behind > config.max_catchup_ticks * config.frame_period_s:
                    self.metrics.tick_overruns.inc()
                    next_tick = clock.now()
                for prefill in self._prefills.values():
                    prefill.waited_ticks += 1

    def _running(self) -> list[ScheduledSession]:
        return [s for s in self._slots if s is not None and s.state is SessionState.RUNNING]

    def _tickable(self) -> list[ScheduledSession]:
        """The running sessions a tick steps: realtime, those that have started streaming."""
        running = self._running()
        if not self.config.realtime:
            return running
        return [r for r in running if r.stream.had_input or r.stream.has_frame()]

    def _control(self, deadline: float | None) -> None:
        """Between ticks: carry out the slot operations in order, run prefill chunks while they
        fit before `deadline`, end sessions past their limits, expire tickets."""
        self._apply_ops(deadline=deadline)
        self._run_prefills(deadline)
        self._catch_up(deadline)
        self._enforce_limits()
        with self.cond:
            self._expire_tickets()

    # ---- slot operations and joins ---------------------------------------------------------------------

    def _apply_ops(self, releases_only: bool = False, deadline: float | None = None) -> None:
        """The slot operations, in order. Before `deadline` (the next tick), joins after the first
        only while one more fits by the slowest recent join (a persona cache copy, a prefill's
        start): a burst of callers joining at once never holds up the tick of those talking.
        One join per tick goes whatever it costs (joining callers are slowed, never starved)."""
        while True:
            with self.cond:
                if not self._ops:
                    return
                if self._joined_since_tick and deadline is not None and not self._join_fits(deadline):
                    return
                op = self._ops.popleft()
            if op.kind == "release":
                prefill = self._prefills.get(op.slot)
                if prefill is not None and prefill.record is op.record:
                    del self._prefills[op.slot]  # closed while joining: abandon its prefill
                self._safe_release(op.slot)
            elif not releases_only:
                t0 = self.clock.elapsed()
                self._join(op.record, op.slot)
                self._join_seconds.append(self.clock.elapsed() - t0)
                self._joined_since_tick += 1

    def _join_fits(self, deadline: float) -> bool:
        """The next slot operation is a release, or a join that ends before `deadline` with a
        tenth of the frame period to spare, by the slowest of the recent joins."""
        if self._ops and self._ops[0].kind == "release":
            return True
        slowest = max(self._join_seconds, default=0.0)
        return self.clock.now() + slowest < deadline - 0.1 * self.config.frame_period_s

    def _safe_release(self, slot: int) -> None:
        try:
            self.engine.release(slot)
        except Exception:
            log.exception("engine.release(%d) failed", slot)
            self.metrics.engine_errors.inc(label="release")

    def _joining(self, record: ScheduledSession, slot: int) -> bool:
        return record.state is SessionState.JOINING and self._slots[slot] is record

    def _join(self, record: ScheduledSession, slot: int) -> None:
        """Restore a joining session's slot from the persona cache, or begin its prefill."""
        prepared = record.prepared
        if prepared is None or not self._joining(record, slot):
            return  # closed before its turn; its release follows in the FIFO
        snapshot = self.cache.get(prepared.cache_key) if self.cache.enabled else None
        t0 = self.clock.elapsed()
        try:
            if snapshot is not None:
                self.engine.restore(slot, snapshot, prepared)
                seconds = self.clock.elapsed() - t0
                self.metrics.restore_seconds.observe(seconds)
                self.metrics.cache_hits.inc()
                self._ready(record, slot, seconds, cache_hit=True)
                return
            job = self.engine.begin_start(slot, prepared)
        except Exception as exc:
            self._fail_join(record, slot, exc)
            return
        self._prefills[slot] = _Prefill(record, job, seconds=self.clock.elapsed() - t0)

    def _prefill_fits(self, deadline: float) -> bool:
        """A prefill chunk is waiting and fits before `deadline` (or has waited too long)."""
        if not self._prefills:
            return False
        oldest = next(iter(self._prefills.values()))
        if oldest.waited_ticks >= PREFILL_STARVE_TICKS:
            return True
        chunk_s = max(self._chunk_seconds, default=0.0)
        return self.clock.now() + chunk_s < deadline

    def _run_prefills(self, deadline: float | None) -> None:
        """Prefill chunks, oldest join first, while they fit before `deadline` (all when None)."""
        while self._prefills:
            slot, prefill = next(iter(self._prefills.items()))
            record = prefill.record
            if not self._joining(record, slot):
                del self._prefills[slot]  # closed: its release is queued
                continue
            if deadline is not None and not self._prefill_fits(deadline):
                return
            t0 = self.clock.elapsed()
            try:
                done = prefill.job.run_chunk()
            except Exception as exc:
                del self._prefills[slot]
                self._fail_join(record, slot, exc)
                continue
            spent = self.clock.elapsed() - t0
            self._chunk_seconds.append(spent)
            prefill.seconds += spent
            prefill.waited_ticks = 0
            if not done:
                continue
            del self._prefills[slot]
            self.metrics.prefill_seconds.observe(prefill.seconds)
            self.metrics.cache_misses.inc()
            prepared = record.prepared
            if self.cache.enabled and prepared is not None:
                self._cache_snapshot(slot, prepared)
            self._ready(record, slot, prefill.seconds, cache_hit=False)

    def _cache_snapshot(self, slot: int, prepared: PreparedPersona) -> None:
        try:
            snapshot = self.engine.snapshot(slot)
        except Exception:
            log.exception("engine.snapshot(%d) failed; the persona is not cached", slot)
            self.metrics.engine_errors.inc(label="snapshot")
            return
        self.metrics.cache_evictions.inc(self.cache.put(prepared.cache_key, snapshot))
        self.metrics.cache_bytes.set(self.cache.nbytes)
        self.metrics.cache_entries.set(len(self.cache))

    def _ready(self, record: ScheduledSession, slot: int, seconds: float, cache_hit: bool) -> None:
        with self.cond:
            if not self._joining(record, slot):
                return  # closed meanwhile; its release is queued
            record.mark_running(self.clock.now(), seconds, cache_hit)
        record.stream.state_changed()

    def _fail_join(self, record: ScheduledSession, slot: int, exc: BaseException) -> None:
        if isinstance(exc, PersonaError):
            self.abort(record, "persona_error", exc)
            return
        log.error("engine failed to start slot %d: %s", slot, exc, exc_info=exc)
        self.metrics.engine_errors.inc(label="start")
        self.abort(record, "engine_error", EngineError(f"the engine failed to start: {exc}"))

    # ---- limits and waits ----------------------------------------------------------------------------

    def _enforce_limits(self) -> None:
        config = self.config
        now = self.clock.now()
        with self.cond:
            running = self._running()
        for record in running:
            stream = record.stream
            if stream.input_ended and not stream.has_frame():
                self.abort(record, "input_ended")
            elif config.max_call_frames is not None and stream.frames_out() >= config.max_call_frames:
                self.abort(record, "max_duration")
            elif (
                config.idle_timeout_s is not None
                and now - max(stream.last_input, record.running_since or now) > config.idle_timeout_s
                and not stream.has_frame()  # input waiting to be stepped is not idleness
            ):
                self.abort(record, "idle")

    def _wait_for_late(self, running: list[ScheduledSession], until: float) -> None:
        """Realtime: give sessions that are streaming but short of a frame until `until`."""
        with self.cond:
            self._want_input = True
            try:
                while not self._stopping:
                    late = [
                        r
                        for r in running
                        if r.state is SessionState.RUNNING
                        and _streaming(r.stream)
                        and not r.stream.has_frame()
                    ]
                    remaining = until - self.clock.now()
                    if not late or remaining <= 0:
                        return
                    self.clock.wait(self.cond, remaining)
            finally:
                self._want_input = False

    def _wait_for_inputs(self, running: list[ScheduledSession]) -> bool:
        """Non-realtime: True when every running session has a frame (and, lossless, room for
        its output). Otherwise waits a little for pushes and returns False to recheck."""
        with self.cond:
            self._want_input = self._want_room = True
            try:
                if self._stopping or self._ops or self._prefills:
                    return False
                for r in running:
                    if r.state is not SessionState.RUNNING:
                        return False
                    if not r.stream.has_frame():
                        if r.stream.input_ended:
                            return False  # it ends in _control
                        self.clock.wait(self.cond, 0.1)
                        return False
                    if self.config.lossless and r.stream.output_backlog() >= self.config.output_frames:
                        self.clock.wait(self.cond, 0.1)
                        return False
                return True
            finally:
                self._want_input = self._want_room = False

    # ---- the tick --------------------------------------------------------------------------------------

    def _fail_step(self, record: ScheduledSession, exc: BaseException, first: bool) -> None:
        if first:
            log.error("engine.step failed for slot %s: %s", record.slot, exc, exc_info=exc)
        else:
            log.error("engine.step failed for slot %s: %s", record.slot, exc)
        self.metrics.engine_errors.inc(label="step")
        self.metrics.slot_failures.inc()
        self.abort(record, "engine_error", EngineError(f"the engine failed: {exc}"))

    def _tick(self) -> None:
        """One batched step of every running session."""
        config = self.config
        with self.cond:
            running = self._tickable()
        if not running:
            return
        pcm = self._pcm_in
        pcm.fill(0.0)
        late = late_settled = trimmed = settled_streaming = 0
        for record in running:
            stream = record.stream
            was_streaming = _streaming(stream)
            # The engine's report of late input leaves out a session's first second: its
            # caller's audio is still finding its phase against the ticks.
            settled = was_streaming and stream.frames_out() >= STARTUP_FRAMES
            settled_streaming += settled
            frame = stream.take_frame()
            if frame is not None:
                pcm[record.slot] = frame
            else:  # silence: late for a session that was streaming, lead-in before its first frame
                stream.count_silence(was_streaming)
                late += was_streaming
                late_settled += settled
            if config.realtime and _streaming(stream):
                trimmed += stream.trim_spare(config.input_slack_frames, config.input_settle_ticks)
        self._recent_late.append((late_settled, settled_streaming))
        if late:  # (audio_inserted counts them once the caller's audio resumes: SlotStream)
            self.metrics.late_frames.inc(late)
        if trimmed:
            self.metrics.jitter_dropped_frames.inc(trimmed)
            self.metrics.dropped_input_samples.inc(trimmed * FRAME_SIZE)
            self.metrics.audio_dropped.inc(trimmed * FRAME_SECONDS, label="jitter_buffer")
        self._step_and_deliver(running, pcm)

    def _step_and_deliver(
        self, running: list[ScheduledSession], pcm: np.ndarray, catching_up: bool = False
    ) -> None:
        """One batched `engine.step` of `running` on `pcm`, each output frame to its session (of
        a catch-up step only the frames worth hearing: `start_burst.worth_delivering`)."""
        t0 = self.clock.elapsed()
        results = step_isolating(self.engine, running, pcm, self._fail_step)
        step_s = self.clock.elapsed() - t0
        self.metrics.tick_seconds.observe(step_s)
        self.recent_steps.append(step_s)
        self.metrics.ticks.inc()
        dropped = skipped = 0
        for record, out in results:
            slot = record.slot
            if slot is None or self._slots[slot] is not record or record.state is not SessionState.RUNNING:
                continue  # closed during the step
            pcm_out = np.array(out.pcm[slot], dtype=np.float32)
            if catching_up and not worth_delivering(pcm_out, out.text[slot]):
                skipped += 1  # the model's silence over time already past
                continue
            dropped += record.stream.deliver(
                pcm_out, out.text[slot], _tokens_of(out, slot), self.config.output_frames
            )
        if skipped:
            self.metrics.catchup_silent_frames.inc(skipped)
        if dropped:
            self.metrics.dropped_output_frames.inc(dropped)
            self.metrics.audio_dropped.inc(dropped * FRAME_SECONDS, label="slow_consumer")
        self._enforce_limits()

    # ---- catch-up steps ------------------------------------------------------------------------

    def _catch_up(self, deadline: float | None) -> None:
        """Realtime: extra steps, between ticks, for sessions holding a start burst (input kept
        from before they ran, or a client's queue flushed after its handshake: see
        `start_burst.StartBurst`), while one more step fits before the next tick by the slowest
        recent step. Every session owed a frame goes in the same step, so a catch-up step costs
        one batched step whatever the number of sessions. When none fits (an engine whose steps
        fill the frame period), the burst stays queued: latency, never a lost word."""
        if not self.config.realtime or deadline is None:
            return
        while not self._stopping and self._step_fits(deadline):
            with self.cond:
                due = [r for r in self._running() if r.stream.catchup_due()]
            pcm = self._pcm_in
            pcm.fill(0.0)
            stepped = []
            for record in due:
                frame = record.stream.take_catchup_frame()
                if frame is not None:
                    pcm[record.slot] = frame
                    stepped.append(record)
            if not stepped:
                return
            self.metrics.catchup_frames.inc(len(stepped))
            t0 = self.clock.elapsed()
            self._step_and_deliver(stepped, pcm, catching_up=True)
            self._catchup_steps.append(self.clock.elapsed() - t0)

    def _step_fits(self, deadline: float) -> bool:
        """One more catch-up step ends before `deadline` with a tenth of the frame period to
        spare (the margin `late_wait` keeps too): as slow as the slowest recent catch-up step
        (an engine that steps only the active slots makes those cheaper than a full tick), or,
        before any ran, as the slowest tick of the last 2 s."""
        slowest = max(self._catchup_steps or self.recent_steps, default=0.0)
        return self.clock.now() + slowest < deadline - 0.1 * self.config.frame_period_s


@dataclass(frozen=True)
class _Queued:
    """The embedded queue's entry: just the record (a cluster front-end queues its sessions)."""

    record: ScheduledSession


def _streaming(stream: SlotStream) -> bool:
    """A full input frame was taken at least once and the input has not ended."""
    return stream.had_input and not stream.input_ended


def _tokens_of(out: StepOutput, slot: int) -> np.ndarray | None:
    return None if out.tokens is None else np.array(out.tokens[slot], dtype=np.int64)
