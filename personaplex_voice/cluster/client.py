"""The front-end's side of the split: `ClusterClient`, a `session_api.SessionHost` over engine workers.

A front-end process (no torch) holds one `WorkerLink` per engine worker: one connection
carrying all of this front-end's sessions there (`wire.py`), reconnecting with back-off while
the worker is down. Transports see the same declared API as in one process; nothing else
changes for them.

- `open(persona)` places the session (`placement.choose_worker`: a free slot, preferring a
  worker whose persona cache holds the persona), sends OPEN and returns once the worker took it
  (or raises its typed refusal: `PersonaError`, `CapacityError`). When no worker has a free slot
  and `max_queue` allows, the session waits here in the same `WaitingQueue` an embedded host
  uses, and is placed when a worker reports room. Positions count this front-end's queue.
- Audio is framed by each `RemoteSession` and sent as frames complete; output frames come back
  one message each, into a bounded queue per session.
- Capacity, occupancy, reservations and readiness are cluster-wide: they sum what every worker
  last reported (its STATUS, every 250 ms) and what this front-end has in flight.
- Saturation (engine/headroom.py): a worker that reports no real-time headroom is skipped by
  placement; this front-end measures its own (its loop's lag and load, the calls' media path)
  and refuses new calls (`SaturatedError`) before its loop lags, so the calls it carries keep
  their line. `/readyz` says `saturated` when either leaves no call room.
- A worker whose connection ends ends its sessions here at once with close reason
  "engine_lost"; new sessions go to the other workers; the link reconnects when it is back.
- `reserve(ttl_s)` mints the ticket id (`<worker>.<random>`) and the worker reserves under that
  same id, so any front-end can redeem it there.

Every method is called from the front-end's event loop (the one `start` ran on); a session's
`close_nowait` may be called from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from personaplex_voice.cluster import wire
from personaplex_voice.cluster.observe import worker_snapshots
from personaplex_voice.cluster.placement import Candidate, choose_worker, persona_fingerprint
from personaplex_voice.cluster.procs import HopSamples, host_identity
from personaplex_voice.cluster.remote_session import RemoteSession, RemoteSessionConfig
from personaplex_voice.cluster.worker_link import Endpoint, EndpointResolver, Identity, WorkerLink
from personaplex_voice.engine.arrivals import ArrivalConfig
from personaplex_voice.engine.base import (
    FRAME_SIZE,
    SAMPLE_RATE,
    CapacityError,
    EngineError,
    Persona,
    PersonaError,
    SaturatedError,
    VoiceInfo,
)
from personaplex_voice.engine.headroom import Headroom, HeadroomConfig
from personaplex_voice.engine.scheduler import (
    SessionState,
    Ticket,
    TicketError,
    WaitingQueue,
    default_max_input_s,
    new_ticket_id,
)
from personaplex_voice.metrics import (
    CLOSE_REASONS,
    DROP_REASONS,
    REJECT_REASONS,
    Counter,
    Gauge,
    InstrumentSet,
    LabelledSnapshot,
)
from personaplex_voice.session_api import SessionClosed, occupancy

log = logging.getLogger("personaplex_voice.cluster.client")

OPEN_TIMEOUT_S = 30.0  # a worker answers an OPEN after the persona's prepare (a voice file load)

Discovery = Callable[["ClusterClient"], Awaitable[None]]


@dataclass
class FrontendMetrics(InstrumentSet):
    """The front-end's own instruments (the workers' come from their STATUS, see observe.py)."""

    sessions_opened: Counter
    sessions_rejected: Counter
    sessions_closed: Counter
    audio_dropped: Counter
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
                "frontend_sessions_rejected_total",
                "Opens and reservations this front-end refused, by reason",
                label="reason",
                allowed=REJECT_REASONS,
            ),
            sessions_closed=Counter(
                "frontend_sessions_closed_total",
                "Sessions of this front-end ended, by reason",
                label="reason",
                allowed=CLOSE_REASONS,
            ),
            audio_dropped=Counter(
                "frontend_audio_dropped_seconds_total",
                "Call audio this front-end dropped (a slow consumer, input over its bound), by reason",
                label="reason",
                allowed=DROP_REASONS,
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


class ClusterClient:
    """The SessionHost of a front-end, over engine workers.

    Workers are added with `add_worker(worker_id, resolve)`: `resolve()` returns the worker's
    current `Endpoint` or None while it is unknown; it is called before each connection attempt
    (Ray discovery answers with the actor's new address after a restart). `add_discovery(fn)`
    runs `fn(client)` as a task from `start` (it adds and removes workers as it finds them).
    `realtime` must match the workers' mode (it sets the default input bound, as a manager's).
    `headroom`: this front-end's saturation policy (None: the defaults; realtime only);
    `arrivals`: how call set-up is paced on its event loop (engine/arrivals.py).
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
        headroom: HeadroomConfig | None = None,
        arrivals: ArrivalConfig | None = None,
    ):
        if max_input_s is None:
            max_input_s = default_max_input_s(realtime)
        self.frontend_id = frontend_id
        self.retry_after_s = retry_after_s
        self.fallback_name = fallback_name
        self.session_config = RemoteSessionConfig(
            realtime=realtime,
            output_frames=output_frames,
            max_input_samples=max(FRAME_SIZE, round(max_input_s * SAMPLE_RATE)),
        )
        self.identity = Identity(frontend_id, host_identity(), peer_timeout_s)
        self.metrics = FrontendMetrics.create()
        self._headroom = Headroom(
            headroom if realtime else HeadroomConfig(enabled=False),
            active=lambda: len(self._sessions),
            metrics_prefix="frontend_",
            retry_after_s=retry_after_s,
            name=f"front-end {frontend_id}",
            arrivals=arrivals if realtime else ArrivalConfig(enabled=False),
        )
        self._headroom.on_change(self._saturation_changed)
        self.output_hops = HopSamples()
        self.draining = False
        self._links: dict[str, WorkerLink] = {}
        self._sessions: dict[str, RemoteSession] = {}
        self._queue: WaitingQueue[RemoteSession] = WaitingQueue(max_queue)
        self._admitting: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
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
            link = self._links[worker_id] = WorkerLink(self, self.identity, worker_id, resolve)
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

    # ---- what links tell us (`worker_link.LinkListener`) -------------------------------------------

    def link_changed(self, link: WorkerLink) -> None:
        self.metrics.workers_up.set(len(self.links_up()))
        waiters, self._link_waiters = self._link_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)
        self._kick_queue()

    def output_hop(self, seconds: float) -> None:
        self.output_hops.add(seconds)

    # ---- the SessionHost API ---------------------------------------------------------------------

    @property
    def realtime(self) -> bool:
        return self.session_config.realtime

    @property
    def model_name(self) -> str:
        names = sorted({str(link.info.get("engine")) for link in self.links_up()})
        return "+".join(names) if names else self.fallback_name

    @property
    def capacity(self) -> int:
        return sum(link.capacity for link in self.links_up())

    @property
    def active_count(self) -> int:
        return sum(int(link.status.get("active", 0)) for link in self.links_up())

    @property
    def queued_count(self) -> int:
        return len(self._queue) + sum(int(link.status.get("queued", 0)) for link in self.links_up())

    @property
    def reserved_count(self) -> int:
        return sum(link.reserved for link in self.links_up())

    @property
    def available(self) -> int:
        """Slots an unticketed open could take now, cluster-wide (0 while draining, or while
        this front-end has no real-time headroom; a saturated worker reports none itself)."""
        if self.draining or self._headroom.refusing:
            return 0
        return sum(max(0, link.free) for link in self.links_up() if not link.saturated)

    @property
    def headroom(self) -> Headroom:
        """This front-end's own headroom (its event loop, its calls' media path)."""
        return self._headroom

    @property
    def sessions(self) -> list[RemoteSession]:
        """This front-end's sessions not yet closed."""
        return list(self._sessions.values())

    def voices(self) -> list[VoiceInfo]:
        seen: dict[str, VoiceInfo] = {}
        for link in self.links_up():
            for voice in link.info.get("voices") or ():
                if isinstance(voice, dict) and voice.get("name") not in seen:
                    seen[voice["name"]] = VoiceInfo(
                        str(voice["name"]), str(voice["kind"]), str(voice["source"])
                    )
        return list(seen.values())

    async def start(self) -> None:
        if self._started:
            return
        self._loop = asyncio.get_running_loop()
        self._started = True
        self.draining = False
        for link in self._links.values():
            link.start()
        loop = asyncio.get_running_loop()
        self._discovery_tasks = [loop.create_task(discovery(self)) for discovery in self._discoveries]

    async def shutdown(self) -> None:
        for session in self.sessions:
            session.end("shutdown", None, tell_worker=True)
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
        for session in self._queue.clear():
            session.end("shutdown", SessionClosed("shutdown"), tell_worker=False)
        self.metrics.queued_sessions.set(0)

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
        if ticket is None:
            self._check_headroom()
        assert self._loop is not None
        session = RemoteSession(
            self.session_config, persona, loop=self._loop, on_end=self._session_ended, on_drop=self._dropped
        )
        if ticket is not None:
            await self._open_with_ticket(session, ticket)
        else:
            await self._open_anywhere(session)
            self._headroom.admitted()
        return session

    def reserve(self, ttl_s: float = 20.0, persona: Persona | None = None) -> Ticket:
        """Hold a slot on a worker for `ttl_s` seconds; `open(..., ticket=t.id)` redeems it, from
        any front-end (with `persona`, the one a persona-less `open` uses). Raises CapacityError
        when no worker has a free slot. The worker takes the reservation a moment later; should
        it find itself full meanwhile, redeeming the ticket raises TicketError."""
        if not 0.0 < ttl_s <= 3600.0:
            raise ValueError(f"ttl_s must be in (0, 3600], got {ttl_s}")
        self._check_headroom()
        link = self._choose(None) if not self.draining else None
        if link is None:
            reason, error = self._refusal()
            self.metrics.sessions_rejected.inc(label="reserve_full" if reason == "full" else reason)
            raise error
        ticket = Ticket(f"{link.worker_id}.{new_ticket_id()}", time.monotonic() + ttl_s, persona)
        self._headroom.admitted()
        link.reserve(
            {
                "ticket": ticket.id,
                "ttl_s": ttl_s,
                "persona": None if persona is None else wire.persona_to_json(persona),
            }
        )
        return ticket

    def cancel(self, ticket_id: str) -> bool:
        """Give a reserved slot back. True when the worker holding it was told (whether it was
        still outstanding there is the worker's to know); unknown tickets are ignored."""
        link = self._links.get(ticket_id.partition(".")[0])
        if link is None or not link.up:
            return False
        link.cancel(ticket_id)
        return True

    # ---- placement -----------------------------------------------------------------------------

    def _choose(
        self, persona: Persona | None, exclude: frozenset[str] | set[str] = frozenset()
    ) -> WorkerLink | None:
        fingerprint = persona_fingerprint(persona) if persona is not None else ""
        candidates = [
            Candidate(
                link.worker_id, link.free, bool(fingerprint) and link.holds(fingerprint), link.saturated
            )
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
        reason, error = self._refusal()
        if self._queue.full or reason == "saturated":  # never queue behind saturated workers
            self.metrics.sessions_rejected.inc(label=reason)
            raise error
        self._register(session)
        self._queue.append(session)
        self.metrics.queued_sessions.set(len(self._queue))
        self._kick_queue()

    async def _open_with_ticket(self, session: RemoteSession, ticket: str) -> None:
        link = self._links.get(ticket.partition(".")[0])
        if link is None or not link.up:
            self.metrics.sessions_rejected.inc(label="ticket")
            raise TicketError("the engine worker holding this ticket is not reachable", retry_after_s=None)
        await self._place(session, link, ticket)

    def _refusal(self) -> tuple[str, CapacityError]:
        """(the rejection label, the error) for an open that neither fits nor may wait."""
        links = self.links_up()
        if not links:
            message = "no engine worker is up; retry in a few seconds"
            return "full", CapacityError(message, retry_after_s=self.retry_after_s)
        saturated = [link for link in links if link.saturated]
        if saturated and all(link.free <= 0 for link in links if not link.saturated):
            message = (
                f"{len(saturated)} of {len(links)} engine worker(s) have no real-time headroom left and "
                f"the others no free slot; retry in {self.retry_after_s:g} s or elsewhere"
            )
            return "saturated", SaturatedError(message, retry_after_s=self.retry_after_s)
        return self._queue.refusal(self.capacity, self.retry_after_s, f" on {len(links)} engine worker(s)")

    def _check_headroom(self) -> None:
        try:
            self._headroom.check()
        except SaturatedError:
            self.metrics.sessions_rejected.inc(label="saturated")
            raise

    def _saturation_changed(self, saturated: bool, verdict: Any) -> None:
        """Saturated: the callers waiting here for a slot are told so now (as an embedded host
        does), not placed later from a front-end that cannot carry them."""
        if not saturated or self._loop is None:
            return
        self._loop.call_soon_threadsafe(self._shed_queue, verdict.why)

    def _shed_queue(self, why: str) -> None:
        for session in self._queue.clear():
            error = SaturatedError(
                f"this front-end ran out of real-time headroom ({why}) while the call waited",
                retry_after_s=self.retry_after_s,
            )
            session.end("saturated", error, tell_worker=False)
        self.metrics.queued_sessions.set(0)

    def _dropped(self, reason: str, seconds: float) -> None:
        self.metrics.audio_dropped.inc(seconds, label=reason)

    async def _place(self, session: RemoteSession, link: WorkerLink, ticket: str | None) -> None:
        """OPEN on `link`; returns once the worker holds the session. Raises its refusal."""
        request = {
            "persona": None if session.persona is None else wire.persona_to_json(session.persona),
            "ticket": ticket,
        }
        # A ticketed open takes the slot the worker already counts reserved.
        opened = session.placing(link.open(session, request, unticketed=ticket is None))
        try:
            await asyncio.wait_for(asyncio.shield(opened), OPEN_TIMEOUT_S)
        except TimeoutError:
            session.end("engine_error", EngineError("the engine worker did not answer"), tell_worker=True)
            raise EngineError(
                f"engine worker {link.worker_id} did not answer in {OPEN_TIMEOUT_S:.0f} s"
            ) from None
        except PersonaError:
            self.metrics.sessions_rejected.inc(label="persona")
            raise
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
            session = self._queue.first()
            assert session is not None
            link = self._choose(session.persona)
            if link is None:
                return
            self._queue.pop_first()
            self.metrics.queued_sessions.set(len(self._queue))
            try:
                await self._place(session, link, None)
            except CapacityError:
                if not session.closed:
                    self._queue.push_front(session)
                    self.metrics.queued_sessions.set(len(self._queue))
                return  # wait for the next report
            except EngineError as exc:  # PersonaError included: this session only
                if not session.closed:
                    reason = "persona_error" if isinstance(exc, PersonaError) else "engine_error"
                    session.end(reason, exc, tell_worker=False)

    def _session_ended(self, session: RemoteSession, previous: SessionState) -> None:
        if previous is SessionState.QUEUED and self._queue.remove(session):
            self.metrics.queued_sessions.set(len(self._queue))
        if self._sessions.pop(session.id, None) is not None:
            reason = session.close_reason or "closed"
            self.metrics.sessions_closed.inc(label=reason)
            if reason == "engine_lost":
                self.metrics.engine_lost_sessions.inc()
            self.metrics.local_sessions.set(len(self._sessions))

    # ---- what /readyz, /api/cluster and /metrics show -----------------------------------------------

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        headroom = self._headroom.describe()
        body = {**occupancy(self), "engine_workers": len(self.links_up()), "headroom": headroom}
        if self.draining:
            return False, {"status": "draining", **body}
        if not self.links_up():
            return False, {"status": "loading", "detail": "no engine worker is up yet", **body}
        if headroom["saturated"]:
            return False, {"status": "saturated", "where": "front-end", **body}
        if body["available"] <= 0:
            if self._refusal()[0] == "saturated":
                return False, {"status": "saturated", "where": "engine workers", **body}
            return False, {"status": "full", **body}
        return True, {"status": "ready", **body}

    def describe(self) -> dict[str, Any]:
        workers = [_describe_link(link) for link in self._links.values()]
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
                "headroom": self._headroom.describe(),
            },
            **occupancy(self),
            "workers": workers,
        }

    def metrics_snapshots(self) -> list[LabelledSnapshot]:
        own = {**self.metrics.snapshot(), **self._headroom.metrics.snapshot()}
        return [LabelledSnapshot({}, own), *worker_snapshots(self.links)]


def _describe_link(link: WorkerLink) -> dict[str, Any]:
    status, info, up = link.status, link.info, link.up
    capacity = link.capacity
    used = int(status.get("active", 0)) if up else 0
    reserved = int(status.get("reserved", 0)) if up else 0
    return {
        "id": link.worker_id,
        "up": up,
        "address": link.address,
        "pid": info.get("pid"),
        "node": info.get("node"),
        "device": info.get("device"),
        "engine": info.get("engine"),
        "generation": info.get("generation", 0),
        "restarts": max(0, link.connects - 1) if "generation" not in info else info.get("generation"),
        "slots": {
            "capacity": capacity,
            "used": used,
            "reserved": reserved,
            "free": max(0, capacity - used - reserved) if up else 0,
        },
        "cached_personas": list(status.get("cached") or []) if up else [],
        "sessions_by_frontend": (status.get("frontends") or {}) if up else {},
        "frontend_pids": (status.get("frontend_pids") or {}) if up else {},
        "input_hop": link.input_hop if up else None,
        "headroom": status.get("headroom") if up else None,
    }
