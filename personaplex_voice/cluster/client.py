"""The front-end's side of the split: `ClusterClient`, the `SessionManager` API over engine workers.

A front-end process (no torch) holds one `WorkerLink` per engine worker: one connection
carrying all of this front-end's sessions there (`wire.py`), reconnecting with back-off while
the worker is down. Transports see a `ClusterClient` where they used to see a `SessionManager`
and `RemoteSession`s where they used to see `Session`s; nothing else changes for them.

- `open(persona)` places the session (`placement.choose_worker`: a free slot, preferring a
  worker whose persona cache holds the persona), sends OPEN and returns once the worker took it
  (or raises its typed refusal: `PersonaError`, `CapacityError`). When no worker has a free slot
  and `max_queue` allows, the session waits here, with its position, and is placed when a worker
  reports room. Positions count this front-end's queue.
- Audio is framed here (1920-sample frames, float32) and sent as it completes; output frames
  come back one message each, into a bounded queue per session (a slow consumer loses its own
  oldest frames, in real time; in lossless mode the worker waits for credit instead).
- Capacity, occupancy, reservations and readiness are cluster-wide: they sum what every worker
  last reported (its STATUS, every 250 ms) and what this front-end has in flight.
- A worker whose connection ends (its process died: the kernel closes the socket at once; or
  silent past `peer_timeout_s`) ends its sessions here at once with close reason "engine_lost";
  new sessions go to the other workers; the link reconnects when the worker is back.
- `reserve(ttl_s)` mints a ticket naming the worker that holds the slot (`<worker>.<random>`),
  so any front-end can redeem it there.

Every method is called from the front-end's event loop (the one `start` ran on), except
`close_nowait`, which may be called from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from personaplex_voice.cluster import wire
from personaplex_voice.cluster.placement import Candidate, choose_worker, persona_fingerprint
from personaplex_voice.cluster.procs import HopSamples, host_identity
from personaplex_voice.cluster.remote_session import PLACING, QUEUED, RemoteSession
from personaplex_voice.cluster.wire import Kind
from personaplex_voice.cluster.worker_link import Discovery, Endpoint, EndpointResolver, WorkerLink
from personaplex_voice.engine.base import (
    FRAME_SIZE,
    SAMPLE_RATE,
    CapacityError,
    EngineError,
    Persona,
    PersonaError,
    VoiceInfo,
)
from personaplex_voice.metrics import CLOSE_REASONS, Counter, Gauge
from personaplex_voice.sessions import SessionClosed, Ticket, TicketError

log = logging.getLogger("personaplex_voice.cluster.client")

OPEN_TIMEOUT_S = 30.0  # a worker answers an OPEN after the persona's prepare (a voice file load)


# -- the manager API --------------------------------------------------------------------------------


@dataclass
class FrontendMetrics:
    """The front-end's own instruments (the workers' come from their STATUS, see observe.py)."""

    sessions_opened: Counter
    sessions_rejected: Counter
    sessions_closed: Counter
    engine_lost_sessions: Counter
    queued_sessions: Gauge
    local_sessions: Gauge
    workers_up: Gauge

    @classmethod
    def create(cls) -> FrontendMetrics:
        return cls(
            sessions_opened=Counter(
                "frontend_sessions_opened_total", "Sessions this front-end placed or queued"
            ),
            sessions_rejected=Counter(
                "frontend_sessions_rejected_total", "Opens this front-end refused, by reason", label="reason"
            ),
            sessions_closed=Counter(
                "frontend_sessions_closed_total",
                "Sessions of this front-end ended, by reason",
                label="reason",
                allowed=CLOSE_REASONS,
            ),
            engine_lost_sessions=Counter(
                "frontend_engine_lost_sessions_total", "Sessions ended because their engine worker went away"
            ),
            queued_sessions=Gauge(
                "frontend_queued_sessions", "Sessions waiting in this front-end for a slot"
            ),
            local_sessions=Gauge("frontend_sessions", "Open sessions of this front-end"),
            workers_up=Gauge("frontend_engine_workers_up", "Engine workers this front-end is connected to"),
        )

    def instruments(self) -> Iterable[Counter | Gauge]:
        for value in vars(self).values():
            if isinstance(value, Counter | Gauge):
                yield value


class ClusterEngineView:
    """What transports read off `manager.engine`: a name, the slot count and the voices."""

    def __init__(self, client: ClusterClient):
        self._client = client

    @property
    def name(self) -> str:
        names = sorted({str(link.info.get("engine")) for link in self._client.links_up()})
        return "+".join(names) if names else self._client.fallback_name

    @property
    def num_slots(self) -> int:
        return self._client.capacity

    def voices(self) -> list[VoiceInfo]:
        seen: dict[str, VoiceInfo] = {}
        for link in self._client.links_up():
            for voice in link.info.get("voices") or ():
                if isinstance(voice, dict) and voice.get("name") not in seen:
                    seen[voice["name"]] = VoiceInfo(
                        str(voice["name"]), str(voice["kind"]), str(voice["source"])
                    )
        return list(seen.values())


class ClusterClient:
    """The SessionManager API of a front-end, over engine workers.

    Workers are added with `add_worker(worker_id, resolve)`: `resolve()` returns the worker's
    current `Endpoint` or None while it is unknown; it is called before each connection attempt
    (Ray discovery answers with the actor's new address after a restart). `add_discovery(fn)`
    runs `fn(client)` as a task from `start` (it adds and removes workers as it finds them).
    `realtime` must match the workers' mode (it sets the default input bound, as a manager's).
    """

    def __init__(
        self,
        *,
        frontend_id: str,
        max_queue: int = 0,
        realtime: bool = True,
        output_frames: int = 64,
        max_input_s: float | None = None,
        retry_after_s: float = 5.0,
        peer_timeout_s: float = 3.0,
        fallback_name: str = "cluster",
    ):
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.frontend_id = frontend_id
        self.max_queue = max_queue
        self.realtime = realtime
        self.output_frames = output_frames
        if max_input_s is None:
            max_input_s = 1.0 if realtime else 600.0
        self.max_input_samples = max(FRAME_SIZE, round(max_input_s * SAMPLE_RATE))
        self.retry_after_s = retry_after_s
        self.peer_timeout_s = peer_timeout_s
        self.fallback_name = fallback_name
        self.host = host_identity()
        self.metrics = FrontendMetrics.create()
        self.engine = ClusterEngineView(self)
        self.output_hops = HopSamples()
        self.draining = False
        self._links: dict[str, WorkerLink] = {}
        self._sessions: dict[str, RemoteSession] = {}
        self._queue: list[RemoteSession] = []
        self._admitting: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._turn = 0
        self._started = False
        self._link_waiters: list[asyncio.Future[None]] = []
        self._discoveries: list[Discovery] = []
        self._discovery_tasks: list[asyncio.Task[None]] = []

    # ---- workers -------------------------------------------------------------------------------

    def add_discovery(self, discovery: Discovery) -> None:
        self._discoveries.append(discovery)
        if self._started:
            self._discovery_tasks.append(asyncio.get_running_loop().create_task(discovery(self)))

    def add_static_worker(self, worker_id: str, address: str, secret: str) -> WorkerLink:
        endpoint = Endpoint(address, secret)

        async def resolve() -> Endpoint:
            return endpoint

        return self.add_worker(worker_id, resolve)

    def add_worker(self, worker_id: str, resolve: EndpointResolver) -> WorkerLink:
        if "." in worker_id or not worker_id:
            raise ValueError(f"worker id {worker_id!r}: must be non-empty, without dots")
        link = self._links.get(worker_id)
        if link is None:
            link = self._links[worker_id] = WorkerLink(self, worker_id, resolve)
            if self._started:
                link.start()
        return link

    async def remove_worker(self, worker_id: str) -> None:
        link = self._links.pop(worker_id, None)
        if link is not None:
            await link.stop()

    @property
    def links(self) -> list[WorkerLink]:
        return list(self._links.values())

    def links_up(self) -> list[WorkerLink]:
        return [link for link in self._links.values() if link.up]

    async def wait_for_workers(self, count: int = 1, timeout: float = 60.0) -> None:
        """Until `count` workers are connected (tests, benches)."""
        deadline = time.monotonic() + timeout
        while len(self.links_up()) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{len(self.links_up())} of {count} engine workers up after {timeout:.0f} s"
                )
            fut = asyncio.get_running_loop().create_future()
            self._link_waiters.append(fut)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(fut, max(0.01, deadline - time.monotonic()))

    # ---- the SessionManager API ------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return sum(
            int(link.status.get("capacity", link.info.get("num_slots", 0))) for link in self.links_up()
        )

    @property
    def active_count(self) -> int:
        return sum(int(link.status.get("active", 0)) for link in self.links_up())

    @property
    def queued_count(self) -> int:
        return len(self._queue) + sum(int(link.status.get("queued", 0)) for link in self.links_up())

    @property
    def reserved_count(self) -> int:
        return sum(
            int(link.status.get("reserved", 0)) + link.unacked_reservations for link in self.links_up()
        )

    @property
    def available(self) -> int:
        """Slots an unticketed open could take now, cluster-wide (0 while draining)."""
        if self.draining:
            return 0
        return sum(max(0, link.free) for link in self.links_up())

    @property
    def sessions(self) -> list[RemoteSession]:
        """This front-end's sessions not yet closed."""
        return list(self._sessions.values())

    async def start(self) -> None:
        if self._started:
            return
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._started = True
        self.draining = False
        for link in self._links.values():
            link.start()
        loop = asyncio.get_running_loop()
        self._discovery_tasks = [loop.create_task(discovery(self)) for discovery in self._discoveries]

    async def shutdown(self) -> None:
        for session in self.sessions:
            session._close("shutdown", None, tell_worker=True)
        await asyncio.sleep(0)  # the CLOSE messages go out
        for task in self._discovery_tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._discovery_tasks = []
        for link in list(self._links.values()):
            await link.stop()
        self._started = False

    def drain(self) -> None:
        """Admit nothing new (running sessions go on); `/readyz` says draining."""
        if not self.draining:
            log.info("draining: %d session(s) running, no new ones admitted", len(self._sessions))
        self.draining = True
        for session in list(self._queue):
            session._close("shutdown", SessionClosed("shutdown"), tell_worker=False)

    async def open(self, persona: Persona | None = None, *, ticket: str | None = None) -> RemoteSession:
        """Place a conversation on an engine worker; see the module docstring. With `ticket`
        (from `reserve`, on any front-end) it goes to the worker holding the slot, and `persona`
        may be None to use the ticket's."""
        if not self._started:
            await self.start()
        if self.draining:
            self.metrics.sessions_rejected.inc(label="draining")
            raise CapacityError("this server is draining for a restart; retry in 1 s", retry_after_s=1.0)
        if persona is None and ticket is None:
            raise PersonaError("no persona given (and no ticket carrying one)")
        session = RemoteSession(self, persona)
        if ticket is not None:
            await self._open_with_ticket(session, ticket)
        else:
            await self._open_anywhere(session)
        return session

    def reserve(self, ttl_s: float = 20.0, persona: Persona | None = None) -> Ticket:
        """Hold a slot on a worker for `ttl_s` seconds; `open(..., ticket=t.id)` redeems it, from
        any front-end (with `persona`, the one a persona-less `open` uses). Raises CapacityError
        when no worker has a free slot. The worker takes the reservation a moment later; should
        it find itself full meanwhile, redeeming the ticket raises TicketError."""
        if not 0.0 < ttl_s <= 3600.0:
            raise ValueError(f"ttl_s must be in (0, 3600], got {ttl_s}")
        link = self._choose(None) if not self.draining else None
        if link is None:
            self.metrics.sessions_rejected.inc(label="full")
            raise CapacityError(self._full_message(), retry_after_s=self.retry_after_s)
        ticket = Ticket(f"{link.worker_id}.{secrets.token_urlsafe(18)}", time.monotonic() + ttl_s, persona)
        link.unacked_reservations += 1
        request = {
            "ticket": ticket.id,
            "ttl_s": ttl_s,
            "persona": None if persona is None else wire.persona_to_json(persona),
        }
        link.send(wire.json_message(Kind.RESERVE, link.new_channel(), request))
        return ticket

    def cancel(self, ticket_id: str) -> bool:
        """Give a reserved slot back. True when the worker holding it was told (whether it was
        still outstanding there is the worker's to know); unknown tickets are ignored."""
        link = self._links.get(ticket_id.partition(".")[0])
        if link is None or not link.up:
            return False
        link.send(wire.message(Kind.CANCEL, 0, ticket_id.encode()))
        return True

    # ---- placement -----------------------------------------------------------------------------

    def _choose(
        self, persona: Persona | None, exclude: frozenset[str] | set[str] = frozenset()
    ) -> WorkerLink | None:
        fingerprint = persona_fingerprint(persona) if persona is not None else ""
        candidates = [
            Candidate(link.worker_id, link.free, bool(fingerprint) and link.holds(fingerprint))
            for link in self.links_up()
            if link.worker_id not in exclude
        ]
        self._turn += 1
        chosen = choose_worker(candidates, self._turn)
        return self._links.get(chosen) if chosen is not None else None

    async def _open_anywhere(self, session: RemoteSession) -> None:
        tried: set[str] = set()
        if not self._queue:
            while (link := self._choose(session.persona, tried)) is not None:
                tried.add(link.worker_id)
                try:
                    await self._place(session, link, None)
                    return
                except CapacityError:
                    continue  # its last report was stale: try the next worker
        if len(self._queue) < self.max_queue:
            self._register(session)
            self._queue.append(session)
            session.queue_position = len(self._queue)
            self.metrics.queued_sessions.set(len(self._queue))
            self._kick_queue()
            return
        reason = "full" if self.max_queue == 0 else "queue_full"
        self.metrics.sessions_rejected.inc(label=reason)
        raise CapacityError(self._full_message(), retry_after_s=self.retry_after_s)

    async def _open_with_ticket(self, session: RemoteSession, ticket: str) -> None:
        link = self._links.get(ticket.partition(".")[0])
        if link is None or not link.up:
            self.metrics.sessions_rejected.inc(label="ticket")
            raise TicketError("the engine worker holding this ticket is not reachable", retry_after_s=None)
        await self._place(session, link, ticket)

    def _full_message(self) -> str:
        workers = len(self.links_up())
        if not workers:
            return "no engine worker is up; retry in a few seconds"
        queue = f" and the queue of {self.max_queue} is full" if self.max_queue else ""
        return f"all {self.capacity} sessions on {workers} engine worker(s) are busy{queue}"

    async def _place(self, session: RemoteSession, link: WorkerLink, ticket: str | None) -> None:
        """OPEN on `link`; returns once the worker holds the session. Raises its refusal."""
        loop = asyncio.get_running_loop()
        channel = link.new_channel()
        session._link, session._channel, session.worker_id = link, channel, link.worker_id
        session._state = PLACING
        session._open_future = loop.create_future()
        link.channels[channel] = session
        pending = ticket is None  # a ticketed open takes the slot the worker already counts reserved
        link.pending_opens += pending
        link.send(
            wire.json_message(
                Kind.OPEN,
                channel,
                {
                    "persona": None if session.persona is None else wire.persona_to_json(session.persona),
                    "ticket": ticket,
                },
            )
        )
        try:
            await asyncio.wait_for(asyncio.shield(session._open_future), OPEN_TIMEOUT_S)
        except TimeoutError:
            session._close("engine_error", EngineError("the engine worker did not answer"), tell_worker=True)
            raise EngineError(
                f"engine worker {link.worker_id} did not answer in {OPEN_TIMEOUT_S:.0f} s"
            ) from None
        except PersonaError:
            self.metrics.sessions_rejected.inc(label="persona")
            raise
        finally:
            link.pending_opens = max(0, link.pending_opens - pending)
        self._register(session)

    def _register(self, session: RemoteSession) -> None:
        if session.id not in self._sessions:
            self._sessions[session.id] = session
            self.metrics.sessions_opened.inc()
            self.metrics.local_sessions.set(len(self._sessions))

    def _kick_queue(self) -> None:
        if self._queue and (self._admitting is None or self._admitting.done()) and self._loop is not None:
            self._admitting = self._loop.create_task(self._admit_queued())

    async def _admit_queued(self) -> None:
        while self._queue and not self.draining:
            session = self._queue[0]
            link = self._choose(session.persona)
            if link is None:
                return
            self._queue.pop(0)
            self._renumber()
            try:
                await self._place(session, link, None)
            except CapacityError:
                if not session.closed:
                    self._queue.insert(0, session)
                    self._renumber()
                return  # wait for the next report
            except EngineError as exc:  # PersonaError included: this session only
                if not session.closed:
                    reason = "persona_error" if isinstance(exc, PersonaError) else "engine_error"
                    session._close(reason, exc, tell_worker=False)
            else:
                session.queue_position = None
                session._wake()

    def _renumber(self) -> None:
        for i, waiting in enumerate(self._queue):
            waiting.queue_position = i + 1
        self.metrics.queued_sessions.set(len(self._queue))

    # ---- callbacks ---------------------------------------------------------------------------------

    def _link_changed(self) -> None:
        self.metrics.workers_up.set(len(self.links_up()))
        waiters, self._link_waiters = self._link_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)
        self._kick_queue()

    def _session_closed(self, session: RemoteSession, previous: str, reason: str) -> None:
        if previous == QUEUED and session in self._queue:
            self._queue.remove(session)
            self._renumber()
            session.queue_position = None
        if self._sessions.pop(session.id, None) is not None:
            self.metrics.sessions_closed.inc(label=reason)
            self.metrics.local_sessions.set(len(self._sessions))

    def _call_in_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._loop is None or threading.get_ident() == self._loop_thread:
            fn(*args)
        else:
            self._loop.call_soon_threadsafe(fn, *args)

    def prometheus_collector(self) -> Any:
        """The engine workers' series for the front-end's /metrics (server/app.py registers it)."""
        from personaplex_voice.cluster.observe import WorkerMetricsCollector

        return WorkerMetricsCollector(self)

    # ---- what /api/cluster and /readyz show ------------------------------------------------------

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """(a new unticketed session would start now, the body /readyz answers with)."""
        body = {
            "active": self.active_count,
            "queued": self.queued_count,
            "reserved": self.reserved_count,
            "capacity": self.capacity,
            "available": self.available,
            "engine_workers": len(self.links_up()),
        }
        if self.draining:
            return False, {"status": "draining", **body}
        if not self.links_up():
            return False, {"status": "loading", "detail": "no engine worker is up yet", **body}
        if body["available"] <= 0:
            return False, {"status": "full", **body}
        return True, {"status": "ready", **body}

    def cluster_status(self) -> dict[str, Any]:
        workers = []
        for link in self._links.values():
            status, info = link.status, link.info
            capacity = int(status.get("capacity", info.get("num_slots", 0))) if link.up else 0
            frontends = status.get("frontends") or {}
            workers.append(
                {
                    "id": link.worker_id,
                    "up": link.up,
                    "address": link.address,
                    "pid": info.get("pid"),
                    "node": info.get("node"),
                    "device": info.get("device"),
                    "engine": info.get("engine"),
                    "generation": info.get("generation", 0),
                    "restarts": max(0, link.connects - 1)
                    if "generation" not in info
                    else info.get("generation"),
                    "slots": {
                        "capacity": capacity,
                        "used": int(status.get("active", 0)) if link.up else 0,
                        "reserved": int(status.get("reserved", 0)) if link.up else 0,
                        "free": max(
                            0, capacity - int(status.get("active", 0)) - int(status.get("reserved", 0))
                        )
                        if link.up
                        else 0,
                    },
                    "cached_personas": list(status.get("cached") or []) if link.up else [],
                    "sessions_by_frontend": frontends if link.up else {},
                    "frontend_pids": (status.get("frontend_pids") or {}) if link.up else {},
                    "input_hop": link.input_hop if link.up else None,
                }
            )
        return {
            "mode": "cluster",
            "frontend": {
                "id": self.frontend_id,
                "pid": os.getpid(),
                "node": os.uname().nodename,
                "torch_loaded": "torch" in sys.modules,
                "sessions": len(self._sessions),
                "session_workers": {s.id: s.worker_id for s in self._sessions.values()},
                "queued": len(self._queue),
                "draining": self.draining,
                "output_hop": self.output_hops.summary_ms(),
            },
            "capacity": self.capacity,
            "active": self.active_count,
            "available": self.available,
            "reserved": self.reserved_count,
            "workers": workers,
        }
