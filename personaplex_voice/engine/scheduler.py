"""The frame clock: one inference thread that steps every running slot of an `Engine` per tick.

Only this thread calls the engine's `begin_start`, `snapshot`, `restore`, `step` and `release`.
The scheduler is the one owner of the slot table: the session layer *asks* for a slot to be
given (`assign`) or taken back (`vacate`), and each request becomes an entry in one FIFO of slot
operations that this thread carries out in order. A slot freed by one session and given to the
next is therefore always released before it is started again, whatever the timing.

Each *tick* steps every running slot in one batched `engine.step` with an active mask. Between
ticks the thread applies the queued slot operations (releases; joins: a restore from the persona
cache, or the start of a system prompt prefill), runs prefill chunks while the next tick is not
due (chunked prefill: a long prompt is spread over as many gaps between ticks as it needs, so
joining callers never hold up running ones) and ends sessions past their limits.

Two clocks:
- realtime: a tick every frame period on a monotonic deadline clock. A session takes part from
  its first full input frame on (the published server answers each input frame; before it the
  session is ready but not stepped, so a client that starts listening late loses nothing). A
  streaming slot whose next input frame is missing at the tick (after a short bounded wait) gets
  a frame of silence, counted as late; whole frames queued beyond what the ticks need are trimmed
  (`SpareTrimmer`), so lateness never adds lasting latency. A session's start burst (input kept
  from before it ran; `start_burst.StartBurst`) is not trimmed but consumed by extra catch-up
  steps between ticks, when they fit.
- non-realtime: a tick runs as soon as every running slot has a full frame buffered (or has
  ended its input) and, lossless, room for its output.

A step that fails ends only the sessions it fails for: an engine that can tell which slots are
at fault raises `SlotError` before touching any state and the others are stepped again at once;
any other error is isolated by stepping halves of the batch until each failing slot is alone.

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
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from personaplex_voice.engine.base import (
    FRAME_SIZE,
    SAMPLE_RATE,
    Engine,
    EngineError,
    PersonaError,
    PreparedPersona,
    SlotError,
    SlotPrefill,
    StepOutput,
)
from personaplex_voice.engine.persona_cache import PersonaCache
from personaplex_voice.engine.start_burst import worth_delivering
from personaplex_voice.metrics import SessionMetrics

log = logging.getLogger(__name__)

FRAME_SECONDS = FRAME_SIZE / SAMPLE_RATE  # 0.08
# A prefill that got no chunk for this many ticks in a row (the engine's steps leave no room in
# the frame period) gets one anyway: joining callers are slowed down, never starved.
PREFILL_STARVE_TICKS = 4


class SlotState(enum.Enum):
    """A session's life as both sides see it."""

    QUEUED = "queued"  # waiting for a free slot (the session layer's)
    JOINING = "joining"  # holds a slot; its prefill or restore is pending or running
    RUNNING = "running"  # prompt in: stepped every tick (realtime: from its first input frame)
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

    @property
    def _had_input(self) -> bool:
        """A full input frame was taken at least once."""

    def _has_frame(self) -> bool:
        """A full input frame is buffered."""

    def _take_frame(self) -> np.ndarray | None:
        """The next input frame (float32 [FRAME_SIZE]), or None when short of one."""

    def _count_silence(self, late: bool) -> None:
        """A tick fed silence: a late frame, or lead-in before the first full frame."""

    def _trim_spare(self, slack_frames: int, settle_ticks: int | None) -> int:
        """The realtime jitter buffer after a tick (see `SpareTrimmer`); frames dropped."""

    def _catchup_due(self) -> bool:
        """Frames of a start burst are owed a catch-up step (see `start_burst.StartBurst`)."""

    def _take_catchup_frame(self) -> np.ndarray | None:
        """The next input frame for a catch-up step, or None when none is owed."""

    def _output_backlog(self) -> int:
        """Output frames not yet taken by the consumer."""

    def _frames_out(self) -> int:
        """Output frames made so far."""

    def _deliver(self, pcm: np.ndarray, text: str | None, tokens: np.ndarray | None, max_frames: int) -> int:
        """Hand one output frame to the consumer, dropping the oldest beyond `max_frames`;
        returns the frames dropped. Must not block."""

    def _joined(self, seconds: float, cache_hit: bool) -> None:
        """The prefill (or restore) took `seconds` of engine time."""

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


@dataclass(frozen=True)
class _SlotOp:
    """One request of the session layer, carried out by the thread in FIFO order."""

    kind: str  # "join" (start or restore `client` in `slot`) or "release"
    slot: int
    client: SlotClient


@dataclass
class _Prefill:
    """A joining client's system prompt, run a chunk at a time between ticks."""

    client: SlotClient
    job: SlotPrefill
    seconds: float = 0.0  # engine time spent on it so far
    waited_ticks: int = 0  # ticks since it last got a chunk


class Scheduler:
    """The inference thread and the slot table around one engine.

    `close(client, reason, error)` and `close_all(reason, error)` are the session layer's
    callbacks: the thread calls them (without holding `cond`) to end sessions past their limits
    or failed by the engine; `close` must take the client out of its slot with `vacate`.
    `housekeeping()` is called between ticks and at least every half second (the session layer
    expires its reservations there). The session layer calls `free_slot` / `assign` / `vacate`
    with `cond` held (it is re-entrant).
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
        housekeeping: Callable[[], None] | None = None,
    ):
        self.engine = engine
        self.metrics = metrics
        self.cache = cache
        self._close = close
        self._close_all = close_all
        self._housekeeping = housekeeping
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
        self.cond = threading.Condition()  # re-entrant; guards the slot table and the op FIFO
        self.slots: list[SlotClient | None] = [None] * n
        self._ops: deque[_SlotOp] = deque()
        self.stopping = False
        # Thread-only state below.
        self._prefills: dict[int, _Prefill] = {}  # slot -> prefill in progress, oldest first
        self._chunk_seconds: deque[float] = deque(maxlen=8)  # recent prefill chunk durations
        self._want_input = False  # the thread waits for pushes
        self._want_room = False  # the thread waits for consumers (lossless mode)
        self._thread: threading.Thread | None = None
        self._pcm_in = np.zeros((n, FRAME_SIZE), np.float32)
        self.recent_steps: deque[float] = deque(maxlen=25)  # engine.step seconds, last 2 s
        self._catchup_steps: deque[float] = deque(maxlen=8)  # issue 16: recent catch-up steps
        self._next_tick: float | None = None  # the realtime clock's next due time, when running

    # ---- the session layer's side (slot table calls with `cond` held) ------------------------

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def held_count(self) -> int:
        """Slots held (joining or running)."""
        return sum(s is not None for s in self.slots)

    @property
    def settled(self) -> bool:
        """No slot request is waiting for the thread and no prefill is in progress (tests)."""
        with self.cond:
            return not self._ops and not self._prefills

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
        """Give `client` the free `slot`; the thread joins it after every earlier request."""
        if self.slots[slot] is not None:
            raise RuntimeError(f"slot {slot} is taken")
        client.slot = slot
        client._state = SlotState.JOINING
        self.slots[slot] = client
        self._ops.append(_SlotOp("join", slot, client))
        self.cond.notify_all()

    def vacate(self, client: SlotClient) -> bool:
        """Take a closing client out of its slot; True when it held one. The slot is free for
        assignment at once; the thread releases it in the engine before anything later runs there."""
        slot = client.slot
        if slot is None or self.slots[slot] is not client:
            return False
        self.slots[slot] = None
        self._ops.append(_SlotOp("release", slot, client))
        self.cond.notify_all()
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

    def seconds_to_next_tick(self) -> float | None:
        """When the realtime clock's next tick is due, from now (None while the clock is idle:
        then the next tick comes as soon as a ready session has a full input frame)."""
        due = self._next_tick
        if due is None or not self.realtime:
            return None
        now = time.monotonic()
        while due < now:  # the thread is stepping or about to: the following tick
            due += self.frame_period_s
        return due - now

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
            self._next_tick = None
            self._apply_ops(releases_only=True)
            self._prefills.clear()
            for slot, holder in enumerate(self.slots):
                if holder is not None:
                    self._safe_release(slot)

    def _loop(self) -> None:
        next_tick: float | None = None
        while True:
            self._next_tick = next_tick if self.realtime else None
            deadline = next_tick if (self.realtime and next_tick is not None) else None
            self._control(deadline)
            with self.cond:
                if self.stopping:
                    return
                running = self._tickable()
                if not running:
                    next_tick = None
                    self._next_tick = None
                    if not self._ops and not self._prefills:
                        # Ready sessions may start streaming: a push must wake this wait.
                        self._want_input = True
                        try:
                            self.cond.wait(timeout=0.5)
                        finally:
                            self._want_input = False
                    continue
            if self.realtime:
                now = time.monotonic()
                if next_tick is None:
                    next_tick = now
                    self._next_tick = next_tick
                if now < next_tick:
                    with self.cond:
                        if not self._ops and not self.stopping and not self._prefill_fits(next_tick):
                            self.cond.wait(timeout=next_tick - now)
                    if time.monotonic() < next_tick:
                        continue  # woke early for a join/close or prefill work: do it, then wait again
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
                for prefill in self._prefills.values():
                    prefill.waited_ticks += 1

    def _running(self) -> list[SlotClient]:
        return [s for s in self.slots if s is not None and s._state is SlotState.RUNNING]

    def _tickable(self) -> list[SlotClient]:
        """The running clients a tick steps: realtime, those that have started streaming."""
        running = self._running()
        if not self.realtime:
            return running
        return [c for c in running if c._had_input or c._has_frame()]

    def _control(self, deadline: float | None) -> None:
        """Between ticks: carry out the slot requests in order, run prefill chunks while they fit
        before `deadline`, end sessions past their limits."""
        self._apply_ops()
        self._run_prefills(deadline)
        self._catch_up(deadline)
        self._enforce_limits()
        if self._housekeeping is not None:
            self._housekeeping()

    # ---- slot operations and joins ------------------------------------------------------------

    def _apply_ops(self, releases_only: bool = False) -> None:
        while True:
            with self.cond:
                if not self._ops:
                    return
                op = self._ops.popleft()
            if op.kind == "release":
                prefill = self._prefills.get(op.slot)
                if prefill is not None and prefill.client is op.client:
                    del self._prefills[op.slot]  # closed while joining: abandon its prefill
                self._safe_release(op.slot)
            elif not releases_only:
                self._join(op.client, op.slot)

    def _safe_release(self, slot: int) -> None:
        try:
            self.engine.release(slot)
        except Exception:
            log.exception("engine.release(%d) failed", slot)
            self.metrics.engine_errors.inc(label="release")

    def _join(self, client: SlotClient, slot: int) -> None:
        """Restore a joining client's slot from the persona cache, or begin its prefill."""
        prepared = client._prepared
        if prepared is None or client._state is not SlotState.JOINING or client.slot != slot:
            return  # closed before its turn; its release follows in the FIFO
        snapshot = self.cache.get(prepared.cache_key) if self.cache.enabled else None
        t0 = time.perf_counter()
        try:
            if snapshot is not None:
                self.engine.restore(slot, snapshot, prepared)
                seconds = time.perf_counter() - t0
                self.metrics.restore_seconds.observe(seconds)
                self.metrics.cache_hits.inc()
                self._ready(client, slot, seconds, cache_hit=True)
                return
            job = self.engine.begin_start(slot, prepared)
        except Exception as exc:
            self._fail_join(client, slot, exc)
            return
        self._prefills[slot] = _Prefill(client, job, seconds=time.perf_counter() - t0)

    def _prefill_fits(self, deadline: float) -> bool:
        """A prefill chunk is waiting and fits before `deadline` (or has waited too long)."""
        if not self._prefills:
            return False
        oldest = next(iter(self._prefills.values()))
        if oldest.waited_ticks >= PREFILL_STARVE_TICKS:
            return True
        chunk_s = max(self._chunk_seconds, default=0.0)
        return time.monotonic() + chunk_s < deadline

    def _run_prefills(self, deadline: float | None) -> None:
        """Prefill chunks, oldest join first, while they fit before `deadline` (all when None)."""
        while self._prefills:
            slot, prefill = next(iter(self._prefills.items()))
            client = prefill.client
            if client._state is not SlotState.JOINING or self.slots[slot] is not client:
                del self._prefills[slot]  # closed: its release is queued
                continue
            if deadline is not None and not self._prefill_fits(deadline):
                return
            t0 = time.perf_counter()
            try:
                done = prefill.job.run_chunk()
            except Exception as exc:
                del self._prefills[slot]
                self._fail_join(client, slot, exc)
                continue
            spent = time.perf_counter() - t0
            self._chunk_seconds.append(spent)
            prefill.seconds += spent
            prefill.waited_ticks = 0
            if not done:
                continue
            del self._prefills[slot]
            self.metrics.prefill_seconds.observe(prefill.seconds)
            self.metrics.cache_misses.inc()
            prepared = client._prepared
            if self.cache.enabled and prepared is not None:
                try:
                    snapshot = self.engine.snapshot(slot)
                except Exception:
                    log.exception("engine.snapshot(%d) failed; the persona is not cached", slot)
                    self.metrics.engine_errors.inc(label="snapshot")
                else:
                    self.metrics.cache_evictions.inc(self.cache.put(prepared.cache_key, snapshot))
                    self.metrics.cache_bytes.set(self.cache.nbytes)
                    self.metrics.cache_entries.set(len(self.cache))
            self._ready(client, slot, prefill.seconds, cache_hit=False)

    def _ready(self, client: SlotClient, slot: int, seconds: float, cache_hit: bool) -> None:
        client._joined(seconds, cache_hit)
        with self.cond:
            if client._state is not SlotState.JOINING or self.slots[slot] is not client:
                return  # closed meanwhile; its release is queued
            client._state = SlotState.RUNNING
            client._last_input = time.monotonic()
        client._became_ready()

    def _fail_join(self, client: SlotClient, slot: int, exc: BaseException) -> None:
        if isinstance(exc, PersonaError):
            self._close(client, "persona_error", exc)
            return
        log.error("engine failed to start slot %d: %s", slot, exc, exc_info=exc)
        self.metrics.engine_errors.inc(label="start")
        self._close(client, "engine_error", EngineError(f"the engine failed to start: {exc}"))

    # ---- limits and waits ---------------------------------------------------------------------

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
                if self.stopping or self._ops or self._prefills:
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

    # ---- the tick -----------------------------------------------------------------------------

    def _tick(self) -> None:
        """One batched step of every running client."""
        with self.cond:
            running = self._tickable()
        if not running:
            return
        pcm = self._pcm_in
        pcm.fill(0.0)
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
        if late:
            self.metrics.late_frames.inc(late)
        if trimmed:
            self.metrics.jitter_dropped_frames.inc(trimmed)
            self.metrics.dropped_input_samples.inc(trimmed * FRAME_SIZE)
        self._step_and_deliver(running, pcm)

    def _step_and_deliver(
        self, running: list[SlotClient], pcm: np.ndarray, catching_up: bool = False
    ) -> None:
        """One batched `engine.step` of `running` on `pcm`, each output frame to its client (of
        a catch-up step, only the frames worth delivering: `start_burst.worth_delivering`)."""
        t0 = time.perf_counter()
        results = self._step_isolating(running, pcm, first=True)
        step_s = time.perf_counter() - t0
        self.metrics.tick_seconds.observe(step_s)
        self.recent_steps.append(step_s)
        self.metrics.ticks.inc()
        dropped = skipped = 0
        for client, out in results:
            slot = client.slot
            if slot is None or self.slots[slot] is not client or client._state is not SlotState.RUNNING:
                continue  # closed during the step
            pcm_out = np.array(out.pcm[slot], dtype=np.float32)
            if catching_up and not worth_delivering(pcm_out, out.text[slot]):
                skipped += 1  # issue 16: the model's silence from time already past
                continue
            dropped += client._deliver(pcm_out, out.text[slot], _tokens_of(out, slot), self.output_frames)
        if skipped:
            self.metrics.catchup_silent_frames.inc(skipped)
        if dropped:
            self.metrics.dropped_output_frames.inc(dropped)
        self._enforce_limits()

    # ---- catch-up steps (issue 16) ------------------------------------------------------------

    def _catch_up(self, deadline: float | None) -> None:
        """Realtime: extra steps, between ticks, for sessions holding a start burst (input kept
        from before they ran, or a client's queue flushed after its handshake; see
        `start_burst.StartBurst`), while one more step fits before the next tick by the slowest
        recent step. Every session owed a frame goes in the same step, so a catch-up step costs
        one batched step whatever the number of sessions. When none fits (an engine whose steps
        fill the frame period), the burst stays queued: latency, never a lost word."""
        if not self.realtime or deadline is None:
            return
        while not self.stopping and self._step_fits(deadline):
            with self.cond:
                due = [c for c in self._running() if c._catchup_due()]
            pcm = self._pcm_in
            pcm.fill(0.0)
            stepped = []
            for client in due:
                frame = client._take_catchup_frame()
                if frame is not None:
                    pcm[client.slot] = frame
                    stepped.append(client)
            if not stepped:
                return
            self.metrics.catchup_frames.inc(len(stepped))
            t0 = time.perf_counter()
            self._step_and_deliver(stepped, pcm, catching_up=True)
            self._catchup_steps.append(time.perf_counter() - t0)

    def _step_fits(self, deadline: float) -> bool:
        """One more catch-up step ends before `deadline` with a tenth of the frame period to
        spare (the margin `late_wait` keeps too): as slow as the slowest recent catch-up step
        (an engine that steps only the active slots makes those cheaper than a full tick), or
        before any ran, as the slowest tick of the last 2 s."""
        slowest = max(self._catchup_steps or self.recent_steps, default=0.0)
        return time.monotonic() + slowest < deadline - 0.1 * self.frame_period_s

    def _step_isolating(
        self, clients: list[SlotClient], pcm: np.ndarray, first: bool = False
    ) -> list[tuple[SlotClient, StepOutput]]:
        """`engine.step` for `clients`; a failure ends only the clients it is pinned on.

        `SlotError` names the guilty slots before any state changed: they end, the rest is
        stepped again. Any other error is bisected: each half is stepped on its own until a
        failing client is alone (every healthy client is stepped exactly once)."""
        active = np.zeros(self.engine.num_slots, bool)
        for client in clients:
            active[client.slot] = True
        try:
            out = self.engine.step(pcm, active)
        except SlotError as exc:
            guilty = [c for c in clients if c.slot in exc.slots]
            if not guilty:  # it names no slot of this batch: treat it as unattributed
                return self._bisect(clients, pcm, exc, first)
            for client in guilty:
                self._fail_step(client, exc, first)
                first = False
            rest = [c for c in clients if c not in guilty]
            return self._step_isolating(rest, pcm) if rest else []
        except Exception as exc:
            return self._bisect(clients, pcm, exc, first)
        return [(c, out) for c in clients]

    def _bisect(
        self, clients: list[SlotClient], pcm: np.ndarray, exc: Exception, first: bool
    ) -> list[tuple[SlotClient, StepOutput]]:
        if len(clients) == 1:
            self._fail_step(clients[0], exc, first)
            return []
        if first:
            log.error(
                "engine.step failed for a batch of %d: %s; isolating the failing slot(s)",
                len(clients),
                exc,
                exc_info=exc,
            )
        half = len(clients) // 2
        return self._step_isolating(clients[:half], pcm) + self._step_isolating(clients[half:], pcm)

    def _fail_step(self, client: SlotClient, exc: BaseException, first: bool) -> None:
        if first:
            log.error("engine.step failed for slot %s: %s", client.slot, exc, exc_info=exc)
        else:
            log.error("engine.step failed for slot %s: %s", client.slot, exc)
        self.metrics.engine_errors.inc(label="step")
        self.metrics.slot_failures.inc()
        self._close(client, "engine_error", EngineError(f"the engine failed: {exc}"))


def _tokens_of(out: StepOutput, slot: int) -> np.ndarray | None:
    return None if out.tokens is None else np.array(out.tokens[slot], dtype=np.int64)
