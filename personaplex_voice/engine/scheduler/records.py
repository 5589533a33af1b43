"""A session's state and the scheduler's other records: the one module that writes them.

`SessionRecord` is a session's state (queued, joining, running, closed; slot, queue position,
close reason); its transitions are the `mark_*` methods, which each host calls from the one
place that owns its sessions: the `Scheduler` for an embedded session, a cluster front-end for
its own. `ScheduledSession` adds what the inference thread needs (the prepared persona and the
session's `SlotStream`). Tickets and the `WaitingQueue` both hosts queue with live here too.
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import numpy as np

from personaplex_voice.engine.base import CapacityError, Persona, PreparedPersona


class SessionState(enum.Enum):
    """A session's life. Embedded sessions go QUEUED -> JOINING -> RUNNING -> CLOSED (any step may
    jump to CLOSED); a cluster front-end's sessions pass through PLACING while a worker answers."""

    QUEUED = "queued"  # waiting for a free slot
    PLACING = "placing"  # (cluster front-end) asked an engine worker for a slot, no answer yet
    JOINING = "joining"  # holds a slot; its prefill or restore is pending or running
    RUNNING = "running"  # prompt in: stepped every tick (realtime: from its first input frame)
    CLOSED = "closed"


class TicketError(CapacityError):
    """A reservation ticket that is unknown, expired or already used: the caller gets no slot."""


@dataclass(frozen=True)
class Ticket:
    """A slot set aside by `reserve` for one later open that presents `id`.

    `id` is unguessable (it is the only thing a redeemer presents) and works once; `expires_at`
    is on the scheduler's clock; `persona` is the one the open uses when given none (so whoever
    reserved can decide who the agent is, e.g. a phone call's answer webhook).
    """

    id: str
    expires_at: float
    persona: Persona | None = None


def new_ticket_id() -> str:
    return secrets.token_urlsafe(18)


class SlotStream(Protocol):
    """A session's audio buffers as the inference thread uses them (the session layer implements
    it with its own lock; every method is quick and never blocks on the engine)."""

    @property
    def had_input(self) -> bool:
        """A full input frame was taken at least once."""

    @property
    def input_ended(self) -> bool:
        """No more input will come."""

    @property
    def last_input(self) -> float:
        """When input last arrived, on the scheduler's clock (`Clock.now`)."""

    def has_frame(self) -> bool:
        """A full input frame is buffered."""

    def take_frame(self) -> np.ndarray | None:
        """The next input frame (float32 [FRAME_SIZE]), or None when short of one."""

    def count_silence(self, late: bool) -> None:
        """A tick fed silence: a late frame, or lead-in before the first full frame. Late ones
        count as silence put in the call once the caller's audio resumes (a caller who stopped
        talking because they hung up is not a slip of the clock)."""

    def trim_spare(self, slack_frames: int, settle_ticks: int | None) -> int:
        """The realtime jitter buffer after a tick; returns the whole frames dropped (a start
        burst's frames are exempt: catch-up steps take them)."""

    def catchup_due(self) -> bool:
        """Frames of a start burst are owed a catch-up step (`engine.start_burst.StartBurst`)."""

    def take_catchup_frame(self) -> np.ndarray | None:
        """The next input frame for a catch-up step, or None when none is owed."""

    def output_backlog(self) -> int:
        """Output frames not yet taken by the consumer."""

    def frames_out(self) -> int:
        """Output frames made so far."""

    def deliver(self, pcm: np.ndarray, text: str | None, tokens: np.ndarray | None, max_frames: int) -> int:
        """Hand one output frame to the consumer, dropping the oldest beyond `max_frames`;
        returns the frames dropped. Must not block."""

    def state_changed(self) -> None:
        """The record's state changed: wake whoever awaits the session."""

    def ended(self) -> None:
        """The session closed: drop buffered input, wake everybody."""


class SessionRecord:
    """A session's state: written only by the transitions below, which its host calls from the
    one place that owns its sessions (this module's `Scheduler` for an embedded session; a
    cluster front-end for its own); everything else reads it. `opened_at` is on the host's
    clock."""

    def __init__(self, session_id: str, opened_at: float):
        self.id = session_id
        self.opened_at = opened_at
        self._state = SessionState.QUEUED
        self._slot: int | None = None
        self._queue_position: int | None = None
        self._close_reason: str | None = None
        self._error: BaseException | None = None
        self._was_ready = False
        self._queue_wait_s: float | None = None
        self._prefill_s: float | None = None
        self._cache_hit: bool | None = None
        self._running_since: float | None = None

    @property
    def state(self) -> SessionState:
        return self._state

    @property
    def slot(self) -> int | None:
        return self._slot

    @property
    def queue_position(self) -> int | None:
        """1 for the first waiting session; None when not waiting."""
        return self._queue_position

    @property
    def close_reason(self) -> str | None:
        return self._close_reason

    @property
    def error(self) -> BaseException | None:
        """What ended the session, for `ready()` to raise (None: a plain close)."""
        return self._error

    @property
    def was_ready(self) -> bool:
        """It ran (RUNNING at some point); stays True after it closed."""
        return self._was_ready

    @property
    def closed(self) -> bool:
        return self._state is SessionState.CLOSED

    @property
    def queue_wait_s(self) -> float | None:
        return self._queue_wait_s

    @property
    def prefill_s(self) -> float | None:
        return self._prefill_s

    @property
    def cache_hit(self) -> bool | None:
        return self._cache_hit

    @property
    def running_since(self) -> float | None:
        """When it became RUNNING, on the owner's clock."""
        return self._running_since

    # The transitions. Each host (this module's Scheduler; a cluster front-end for its own
    # sessions) calls them from the one place that owns its sessions.

    def mark_queued(self, position: int | None) -> None:
        self._queue_position = position

    def mark_placing(self) -> None:
        """(cluster front-end) an engine worker was asked for a slot."""
        self._state = SessionState.PLACING

    def mark_unplaced(self) -> None:
        """(cluster front-end) the worker refused or went away before answering: queued again."""
        if self._state is SessionState.PLACING:
            self._state = SessionState.QUEUED

    def mark_joining(self, slot: int | None, waited_s: float | None) -> None:
        self._state = SessionState.JOINING
        self._slot = slot
        self._queue_position = None
        self._queue_wait_s = waited_s

    def mark_running(self, now: float, prefill_s: float | None, cache_hit: bool | None) -> None:
        self._state = SessionState.RUNNING
        self._running_since = now
        self._was_ready = True
        self._prefill_s = prefill_s
        self._cache_hit = cache_hit

    def mark_closed(self, reason: str, error: BaseException | None) -> bool:
        """False when it was closed already (the first reason sticks)."""
        if self._state is SessionState.CLOSED:
            return False
        self._state = SessionState.CLOSED
        self._close_reason = reason
        self._error = error
        self._queue_position = None
        return True

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} {self._state.value} slot={self._slot}>"


class RecordReadout:
    """What a session handle (embedded or remote) says of its state: read off the record its
    host owns, never kept beside it."""

    _record: SessionRecord

    @property
    def state(self) -> SessionState:
        return self._record.state

    @property
    def closed(self) -> bool:
        return self._record.closed

    @property
    def ready_now(self) -> bool:
        """True while the session is being stepped."""
        return self._record.state is SessionState.RUNNING

    @property
    def queue_position(self) -> int | None:
        return self._record.queue_position

    @property
    def close_reason(self) -> str | None:
        return self._record.close_reason


class ScheduledSession(SessionRecord):
    """An embedded session as the scheduler holds it: its state, its prepared persona (dropped
    once closed, so its tensors do not outlive the call) and its stream."""

    def __init__(self, session_id: str, prepared: PreparedPersona, stream: SlotStream, opened_at: float):
        super().__init__(session_id, opened_at)
        self.stream = stream
        self._prepared: PreparedPersona | None = prepared

    @property
    def prepared(self) -> PreparedPersona | None:
        return self._prepared

    def mark_closed(self, reason: str, error: BaseException | None) -> bool:
        if not super().mark_closed(reason, error):
            return False
        self._prepared = None
        return True


# -- the waiting queue --------------------------------------------------------------------------------


class QueueItem(Protocol):
    @property
    def record(self) -> SessionRecord: ...


Item = TypeVar("Item", bound=QueueItem)


class WaitingQueue(Generic[Item]):
    """Sessions waiting for a slot, in arrival order, each record's `queue_position` kept in step.
    The embedded scheduler and a cluster front-end both queue with it."""

    def __init__(self, limit: int):
        self.limit = limit
        self._items: list[Item] = []

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Item]:
        return iter(list(self._items))

    def __bool__(self) -> bool:
        return bool(self._items)

    @property
    def full(self) -> bool:
        return len(self._items) >= self.limit

    def refusal(self, capacity: int, retry_after_s: float, where: str = "") -> tuple[str, CapacityError]:
        """(the rejection reason label, the error) for an open that neither fits nor may wait."""
        reason = "full" if self.limit == 0 else "queue_full"
        queue = f" and the queue of {self.limit} is full" if self.limit else ""
        message = f"all {capacity} sessions{where} are busy{queue}; retry in {retry_after_s:g} s"
        return reason, CapacityError(message, retry_after_s=retry_after_s)

    def append(self, item: Item) -> None:
        self._items.append(item)
        item.record.mark_queued(len(self._items))

    def first(self) -> Item | None:
        return self._items[0] if self._items else None

    def pop_first(self) -> Item:
        item = self._items.pop(0)
        item.record.mark_queued(None)
        self._renumber()
        return item

    def push_front(self, item: Item) -> None:
        """Back to the head of the line (its placement failed for want of room)."""
        self._items.insert(0, item)
        self._renumber()

    def remove(self, item: Item) -> bool:
        try:
            self._items.remove(item)
        except ValueError:
            return False
        item.record.mark_queued(None)
        self._renumber()
        return True

    def clear(self) -> list[Item]:
        items, self._items = self._items, []
        for item in items:
            item.record.mark_queued(None)
        return items

    def _renumber(self) -> None:
        for i, item in enumerate(self._items):
            item.record.mark_queued(i + 1)
