"""The engine worker: one engine and its `SessionManager`, served over the session protocol.

A worker owns one device (a GPU, or the CPU), the engine on it and the manager around that
engine, which is the one owner of the slot table, the persona cache and the reservations. Front-
ends connect (a Unix socket on the same host, TCP from elsewhere; `wire.py`), authenticate with
the cluster secret and then carry any number of sessions on that one connection:

- OPEN -> `manager.open(persona, ticket)` -> OPENED, or REFUSED (capacity / persona / ticket /
  engine); then READY once the prompt is in, FRAME per 80 ms, CLOSED with the reason.
- AUDIO frames go straight into the session (`Session.push`), stamped so the hop is measured.
- STATUS goes to every front-end every `status_interval_s`: occupancy, saturation (the worker's
  real-time headroom: its engine clock and its protocol loop, engine/headroom.py; a saturated
  worker reports no slot available and refuses opens, so placement skips it), cached personas
  (as fingerprints), per-front-end session counts and, every second, the manager's metrics. It
  is also the heartbeat: a front-end that hears nothing for a while treats the worker as lost.
- A front-end whose connection ends (process died: the kernel closes its sockets at once; or
  silent past `peer_timeout_s`) has all its sessions closed ("frontend_lost"), so its slots are
  free within a tick.

`python -m personaplex_voice.cluster.worker --settings FILE --listen unix:PATH|tcp:HOST:PORT`
runs one as a process (the supervisor does this); `cluster/ray_actors.py` runs the same class
inside a Ray actor.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging
import os
import signal
import sys
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from personaplex_voice.cluster import wire
from personaplex_voice.cluster.placement import persona_fingerprint
from personaplex_voice.cluster.procs import HopSamples, die_with_parent, host_identity
from personaplex_voice.cluster.wire import Kind, WireError
from personaplex_voice.engine.base import SAMPLE_RATE, EngineError, Persona, PersonaError
from personaplex_voice.engine.scheduler import TicketError
from personaplex_voice.process.loop_monitor import LoopMonitor
from personaplex_voice.process.settings import ServerSettings, settings_from_file
from personaplex_voice.sessions import Session, SessionManager

log = logging.getLogger("personaplex_voice.cluster.worker")

HELLO_TIMEOUT_S = 5.0
MAX_CHANNELS = 4096  # per connection; far above any engine's slots
MAX_WRITE_BUFFER = 32 << 20  # a front-end that stops reading this long is cut off (~4 min of one call)
TICKET_WAIT_S = 1.0  # a ticket minted by another front-end may reach us just after its redemption
ENGINE_LOST = "engine_lost"
FRONTEND_LOST = "frontend_lost"


@dataclass(frozen=True)
class WorkerInfo:
    """Who a worker is, as it tells front-ends in WELCOME (and /api/cluster shows)."""

    worker_id: str
    device: str
    node: str
    generation: int = 0  # how many times it was restarted
    pid: int = 0
    host: str = ""  # host_identity(): same value = same monotonic clock


class CachedPersonas:
    """The personas (fingerprints) whose prefilled state the manager's cache most likely holds.

    The cache is an LRU touched once per join, in join order, on the one inference thread; this
    mirrors it from the joins we see (a session turning ready) and reports the newest entries,
    as many as the cache holds. Placement only prefers a worker on it, so an approximation
    (a join closed mid-prefill is missed) costs at most one prefill.
    """

    def __init__(self, limit: int = 4096):
        self._order: OrderedDict[str, None] = OrderedDict()
        self._limit = limit

    def touch(self, fingerprint: str) -> None:
        self._order.pop(fingerprint, None)
        self._order[fingerprint] = None
        while len(self._order) > self._limit:
            self._order.popitem(last=False)

    def newest(self, count: int) -> list[str]:
        if count <= 0:
            return []
        return list(self._order)[-count:]


class _Channel:
    """One session on one connection, as the worker side holds it."""

    def __init__(self, lossless: bool, credit: int):
        self.session: Session | None = None
        self.closing: str | None = None  # CLOSE arrived while the open was under way
        self.lossless = lossless
        self.credit = credit
        self.credit_event = asyncio.Event()
        self.task: asyncio.Task[None] | None = None


class _Connection(asyncio.Protocol):
    """One front-end's connection: parses its messages, runs its sessions' pumps, batches writes."""

    def __init__(self, worker: EngineWorker):
        self.worker = worker
        self.loop = asyncio.get_running_loop()
        self.reader = wire.MessageReader()
        self.transport: asyncio.Transport | None = None
        self.channels: dict[int, _Channel] = {}
        self.frontend: dict[str, Any] = {}
        self.authenticated = False
        self.last_seen = time.monotonic()
        self.same_host = False
        self._out: list[bytes] = []
        self._flush_handle: asyncio.Handle | None = None
        self._hello_timer: asyncio.TimerHandle | None = None
        self.closed = False

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport
        self._hello_timer = self.loop.call_later(HELLO_TIMEOUT_S, self._no_hello)

    def data_received(self, data: bytes) -> None:
        self.last_seen = time.monotonic()
        try:
            for kind, channel, body in self.reader.feed(data):
                self._dispatch(kind, channel, body)
        except WireError as exc:
            log.warning("front-end %s broke the protocol: %s", self.name, exc)
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        self.worker.connection_ended(self)
        for channel in list(self.channels.values()):
            if channel.session is not None:
                channel.session.close_nowait(FRONTEND_LOST)
            else:
                channel.closing = FRONTEND_LOST
        self.channels.clear()

    # -- sending -------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return str(self.frontend.get("frontend") or "(unauthenticated)")

    def send(self, data: bytes) -> None:
        """Queue bytes; everything queued in one loop iteration goes out in one write."""
        if self.closed:
            return
        self._out.append(data)
        if self._flush_handle is None:
            self._flush_handle = self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_handle = None
        if self.closed or self.transport is None or not self._out:
            return
        data = b"".join(self._out) if len(self._out) > 1 else self._out[0]
        self._out.clear()
        self.transport.write(data)
        if self.transport.get_write_buffer_size() > MAX_WRITE_BUFFER:
            log.warning("front-end %s stopped reading: disconnecting it", self.name)
            self.abort()

    def abort(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.abort()

    def _no_hello(self) -> None:
        if not self.authenticated:
            log.warning("a connection sent no valid HELLO in %.0f s: closed", HELLO_TIMEOUT_S)
            self.abort()

    # -- receiving -----------------------------------------------------------------------------

    def _dispatch(self, kind: Kind, channel: int, body: bytes) -> None:
        if not self.authenticated:
            if kind is not Kind.HELLO:
                raise WireError(f"{kind.name} before HELLO")
            self._hello(wire.parse_json(body))
            return
        if kind is Kind.AUDIO:
            state = self.channels.get(channel)
            pcm, sent_at = wire.parse_audio(body)
            if state is not None and state.session is not None:
                if self.same_host:
                    self.worker.input_hops.add(time.monotonic() - sent_at)
                state.session.push(pcm)
        elif kind is Kind.PIECES:
            state = self.channels.get(channel)
            if state is not None and state.session is not None:
                state.session.expect_input_pieces(wire.parse_pieces(body) / SAMPLE_RATE)
        elif kind is Kind.PING:
            pass
        elif kind is Kind.CREDIT:
            state = self.channels.get(channel)
            if state is not None:
                state.credit += wire.parse_credit(body)
                state.credit_event.set()
        elif kind is Kind.END_INPUT:
            state = self.channels.get(channel)
            if state is not None and state.session is not None:
                state.session.end_input()
        elif kind is Kind.CLOSE:
            reason = body.decode("utf-8", "replace")[:80] or "client"
            state = self.channels.get(channel)
            if state is not None:
                if state.session is not None:
                    state.session.close_nowait(reason)
                else:
                    state.closing = reason
        elif kind is Kind.OPEN:
            self._open(channel, wire.parse_json(body))
        elif kind is Kind.RESERVE:
            self.send(wire.json_message(Kind.RESERVED, channel, self.worker.reserve(wire.parse_json(body))))
        elif kind is Kind.CANCEL:
            self.worker.cancel(body.decode("utf-8", "replace"))
        else:
            raise WireError(f"{kind.name} is not sent to an engine worker")

    def _hello(self, hello: dict[str, Any]) -> None:
        secret = str(hello.get("secret") or "")
        if hello.get("version") != wire.PROTOCOL_VERSION:
            raise WireError(
                f"protocol version {hello.get('version')!r}, this worker speaks {wire.PROTOCOL_VERSION}"
            )
        if not hmac.compare_digest(secret.encode(), self.worker.secret.encode()):
            raise WireError("wrong cluster secret")
        self.authenticated = True
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        self.frontend = {
            "frontend": str(hello.get("frontend") or "?")[:64],
            "pid": hello.get("pid") if isinstance(hello.get("pid"), int) else None,
        }
        self.same_host = hello.get("host") == self.worker.info.host
        self.worker.connection_authenticated(self)
        self.send(wire.json_message(Kind.WELCOME, 0, self.worker.welcome()))
        self.send(wire.json_message(Kind.STATUS, 0, self.worker.status(with_metrics=True)))

    def _open(self, channel: int, request: dict[str, Any]) -> None:
        if channel in self.channels or channel == 0:
            self._refuse(channel, "engine", f"channel {channel} is in use")
            return
        if len(self.channels) >= MAX_CHANNELS:
            self._refuse(channel, "capacity", "too many sessions on one connection", retry_after_s=1.0)
            return
        config = self.worker.manager.config
        state = _Channel(lossless=config.lossless, credit=config.output_frames)
        self.channels[channel] = state
        state.task = self.loop.create_task(self._run_session(channel, state, request))

    def _refuse(self, channel: int, kind: str, message: str, retry_after_s: float | None = None) -> None:
        self.send(wire.json_message(Kind.REFUSED, channel, wire.refusal(kind, message, retry_after_s)))

    async def _run_session(self, channel: int, state: _Channel, request: dict[str, Any]) -> None:
        try:
            await self._session_life(channel, state, request)
        except asyncio.CancelledError:
            if state.session is not None:
                state.session.close_nowait(FRONTEND_LOST)
            raise
        except Exception:
            log.exception("session on channel %d of %s failed", channel, self.name)
            if state.session is not None:
                state.session.close_nowait("engine_error")
                self._send_closed(
                    channel, state.session.close_reason or "engine_error", "engine", "worker error"
                )
            else:
                self._refuse(channel, "engine", "the engine worker failed to open the session")
        finally:
            self.channels.pop(channel, None)

    async def _session_life(self, channel: int, state: _Channel, request: dict[str, Any]) -> None:
        worker = self.worker
        try:
            ticket = request.get("ticket")
            ticket = ticket if isinstance(ticket, str) else None
            raw = request.get("persona")
            persona = None if raw is None and ticket is not None else wire.persona_from_json(raw)
            session = await worker.open_session(persona, ticket)
        except EngineError as exc:  # PersonaError, CapacityError, TicketError...
            self.send(wire.json_message(Kind.REFUSED, channel, wire.refusal_of(exc)))
            return
        state.session = session
        worker.occupancy_changed()
        if state.closing is not None or self.closed:
            session.close_nowait(state.closing or FRONTEND_LOST)
        self.send(
            wire.json_message(
                Kind.OPENED,
                channel,
                {
                    "session_id": session.id,
                    "queue_position": session.queue_position,
                    "persona": wire.persona_to_json(session.persona),
                },
            )
        )
        try:
            await session.ready()
        except PersonaError as exc:
            self._send_closed(channel, session.close_reason or "persona_error", "persona", str(exc))
            return
        except EngineError as exc:
            reason = session.close_reason or "engine_error"
            self._send_closed(channel, reason, "closed", str(exc))
            return
        stats = session.stats
        worker.cached.touch(persona_fingerprint(session.persona))
        self.send(
            wire.json_message(
                Kind.READY,
                channel,
                {
                    **{k: stats.get(k) for k in ("cache_hit", "prefill_ms", "queue_wait_ms")},
                    "tick_due_in_s": session.seconds_to_next_tick(),
                },
            )
        )
        lossless = state.lossless
        async for out in session.frames():
            if lossless:
                while state.credit <= 0 and not self.closed:
                    state.credit_event.clear()
                    await state.credit_event.wait()
                state.credit -= 1
            self.send(wire.frame_message(channel, out.index, out.pcm, out.text, out.tokens, time.monotonic()))
        self._send_closed(channel, session.close_reason or "closed", None, None)

    def _send_closed(self, channel: int, reason: str, error: str | None, message: str | None) -> None:
        self.worker.occupancy_changed()
        session = self.channels.get(channel)
        stats = session.session.stats if session is not None and session.session is not None else None
        self.send(
            wire.json_message(
                Kind.CLOSED, channel, {"reason": reason, "error": error, "message": message, "stats": stats}
            )
        )


class EngineWorker:
    """One engine behind the session protocol. Create, `await start()`, `await listen(addr)`
    (as many addresses as wanted), and finally `await stop()`."""

    def __init__(
        self,
        manager: SessionManager,
        info: WorkerInfo,
        secret: str,
        *,
        status_interval_s: float = 0.25,
        peer_timeout_s: float = 3.0,
    ):
        if not secret:
            raise ValueError("an engine worker needs a cluster secret")
        self.manager = manager
        self.info = info
        self.secret = secret
        self.status_interval_s = status_interval_s
        self.peer_timeout_s = peer_timeout_s
        self.cached = CachedPersonas()
        self.input_hops = HopSamples()
        self.connections: set[_Connection] = set()
        self.addresses: list[str] = []
        self._servers: list[asyncio.AbstractServer] = []
        self._status_task: asyncio.Task[None] | None = None
        self._status_soon: asyncio.Handle | None = None
        # Opens presenting a ticket whose RESERVE has not reached us yet (another front-end
        # minted it): each waits on a future the RESERVE resolves.
        self._awaited_tickets: dict[str, asyncio.Future[None]] = {}
        self.started_at = time.time()
        manager.headroom.name = f"engine worker {info.worker_id}"
        self.loop_monitor = LoopMonitor(manager.headroom)
        manager.headroom.on_change(lambda saturated, verdict: self.occupancy_changed())

    # -- life ------------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.manager.start()
        self.loop_monitor.start()
        if self._status_task is None:
            self._status_task = asyncio.get_running_loop().create_task(self._status_loop())

    async def listen(self, address: str) -> str:
        """Serve on `unix:PATH` or `tcp:HOST:PORT` (port 0 = any); returns the address bound."""
        loop = asyncio.get_running_loop()
        kind, _, rest = address.partition(":")
        if kind == "unix":
            path = Path(rest)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # left by a previous run of this worker
            server = await loop.create_unix_server(lambda: _Connection(self), str(path))
            os.chmod(path, 0o600)
            bound = f"unix:{path}"
        elif kind == "tcp":
            host, _, port = rest.rpartition(":")
            server = await loop.create_server(lambda: _Connection(self), host or "127.0.0.1", int(port))
            sock_host, sock_port = server.sockets[0].getsockname()[:2]
            bound = f"tcp:{sock_host}:{sock_port}"
        else:
            raise ValueError(f"address {address!r}: use unix:PATH or tcp:HOST:PORT")
        self._servers.append(server)
        self.addresses.append(bound)
        log.info("engine worker %s serving on %s", self.info.worker_id, bound)
        return bound

    async def stop(self) -> None:
        """Close every session ("shutdown", sent to its front-end), then the connections."""
        for server in self._servers:
            server.close()
        if self._status_task is not None:
            self._status_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._status_task
        await self.loop_monitor.stop()
        await self.manager.shutdown()
        await asyncio.sleep(0.1)  # the pumps send their CLOSED messages
        for connection in list(self.connections):
            if connection.transport is not None:
                connection.transport.close()

    # -- what front-ends are told --------------------------------------------------------------

    def welcome(self) -> dict[str, Any]:
        manager, config = self.manager, self.manager.config
        return {
            **asdict(self.info),
            "engine": manager.model_name,
            "num_slots": manager.capacity,
            "voices": [asdict(v) for v in manager.voices()],
            "realtime": config.realtime,
            "lossless": config.lossless,
            "output_frames": config.output_frames,
            "frame_period_s": config.frame_period_s,
            "started_at": self.started_at,
        }

    def status(self, with_metrics: bool = False) -> dict[str, Any]:
        manager = self.manager
        capacity = manager.capacity
        reserved, available = manager.reserved_count, manager.available
        active, queued = manager.active_count, manager.queued_count
        per_frontend: dict[str, int] = {}
        pids: dict[str, Any] = {}
        for connection in self.connections:
            if connection.authenticated:
                name = connection.name
                pids[name] = connection.frontend.get("pid")
                per_frontend[name] = per_frontend.get(name, 0) + sum(
                    c.session is not None and not c.session.closed for c in connection.channels.values()
                )
        headroom = manager.headroom.describe()
        status: dict[str, Any] = {
            "capacity": capacity,
            "active": active,
            "queued": queued,
            "reserved": reserved,
            "available": int(available),
            "saturated": headroom["saturated"],
            "headroom": headroom,
            "cached": self.cached.newest(len(manager.cache)),
            "frontends": per_frontend,
            "frontend_pids": pids,
            "tick_due_in_s": self.tick_due_in_s(),
        }
        if with_metrics:
            status["metrics"] = {**manager.metrics.snapshot(), **manager.headroom.metrics.snapshot()}
            status["input_hop"] = self.input_hops.summary_ms()
        return status

    def tick_due_in_s(self) -> float | None:
        """When the engine's next tick takes input (None while its clock is idle), so front-ends
        can phase paced input against it (`Session.seconds_to_next_tick`)."""
        return self.manager.scheduler.seconds_to_next_tick()

    def occupancy_changed(self) -> None:
        """A session came or went: every front-end hears it now, not at the next beat (so
        placement and /readyz elsewhere see the slot at once)."""
        if self._status_soon is None:
            self._status_soon = asyncio.get_running_loop().call_soon(self._broadcast_status)

    def _broadcast_status(self, with_metrics: bool = False) -> None:
        self._status_soon = None
        live = [c for c in self.connections if c.authenticated and not c.closed]
        if live:
            message = wire.json_message(Kind.STATUS, 0, self.status(with_metrics=with_metrics))
            for connection in live:
                connection.send(message)

    async def _status_loop(self) -> None:
        beat = 0
        while True:
            await asyncio.sleep(self.status_interval_s)
            beat += 1
            with_metrics = beat % max(1, round(1.0 / self.status_interval_s)) == 0
            now = time.monotonic()
            live = [c for c in self.connections if c.authenticated and not c.closed]
            for connection in live:
                if now - connection.last_seen > self.peer_timeout_s:
                    log.warning(
                        "front-end %s silent for %.1f s: disconnecting it",
                        connection.name,
                        self.peer_timeout_s,
                    )
                    connection.abort()
            self._broadcast_status(with_metrics)

    def connection_authenticated(self, connection: _Connection) -> None:
        self.connections.add(connection)
        log.info("front-end %s (pid %s) connected", connection.name, connection.frontend.get("pid"))

    def connection_ended(self, connection: _Connection) -> None:
        if connection in self.connections:
            self.connections.discard(connection)
            log.info("front-end %s disconnected", connection.name)

    # -- sessions and tickets ------------------------------------------------------------------

    async def open_session(self, persona: Persona | None, ticket: str | None) -> Session:
        """`manager.open`. A ticket is the id its front-end minted, which the manager reserved
        under; one this worker has not heard of yet may be on its way from another front-end:
        the open waits for its RESERVE (a future, at most `TICKET_WAIT_S`) and tries once more."""
        if ticket is None:
            return await self.manager.open(persona)
        try:
            return await self.manager.open(persona, ticket=ticket)
        except TicketError:
            arrival = self._awaited_tickets.setdefault(ticket, asyncio.get_running_loop().create_future())
            try:
                await asyncio.wait_for(asyncio.shield(arrival), TICKET_WAIT_S)
            except TimeoutError:
                raise TicketError("unknown, expired or already used reservation ticket") from None
            finally:
                self._awaited_tickets.pop(ticket, None)
        return await self.manager.open(persona, ticket=ticket)

    def reserve(self, request: dict[str, Any]) -> dict[str, Any]:
        """A front-end's RESERVE: the manager reserves under the front-end's ticket id. Returns
        the RESERVED answer."""
        ticket = str(request.get("ticket") or "")[:200]
        ttl = request.get("ttl_s")
        ttl_s = float(ttl) if isinstance(ttl, int | float) else 0.0
        answer: dict[str, Any] = {"ticket": ticket}
        try:
            if not ticket or not (0.0 < ttl_s <= 3600.0):
                raise EngineError("bad reservation request")
            raw = request.get("persona")
            persona = None if raw is None else wire.persona_from_json(raw)
            self.manager.reserve(ttl_s, persona=persona, ticket_id=ticket)
        except EngineError as exc:  # CapacityError, PersonaError, shutting down
            answer.update(error=str(exc), retry_after_s=getattr(exc, "retry_after_s", None))
        else:
            answer.update(ok=True)
        arrival = self._awaited_tickets.get(ticket)
        if arrival is not None and not arrival.done():
            arrival.set_result(None)
        self.occupancy_changed()
        return answer

    def cancel(self, ticket: str) -> None:
        if self.manager.cancel(ticket):
            self.occupancy_changed()


# -- running one as a process -----------------------------------------------------------------------


def build_manager(settings: ServerSettings, *, realtime: bool = True) -> SessionManager:
    """The engine the settings ask for, warmed, inside a SessionManager that refuses when full
    (front-ends queue). Imports torch for the real model, never for the echo engine."""
    from personaplex_voice.process.engine_loader import load_engine, warm_engine

    engine = load_engine(settings, lambda detail: log.info("%s", detail))
    warm_engine(engine)
    options = {**settings.manager_options(), "max_queue": 0}
    return SessionManager(engine, realtime=realtime, **options)


def engine_device(engine: Any, settings: ServerSettings) -> str:
    """The device the engine runs on, as a string ("cpu" for the echo engine)."""
    if settings.engine != "model":
        return "cpu"
    device = getattr(engine, "device", None)
    return str(device) if device is not None else str(settings.device)


async def _serve(worker: EngineWorker, listen: list[str]) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await worker.start()
    for address in listen:
        await worker.listen(address)
    await stop.wait()
    log.info("engine worker %s stopping", worker.info.worker_id)
    await worker.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="personaplex-voice engine worker (started by the supervisor)"
    )
    parser.add_argument("--settings", required=True, help="JSON file of ServerSettings values")
    parser.add_argument("--listen", action="append", required=True, help="unix:PATH or tcp:HOST:PORT")
    parser.add_argument("--id", default="w0", help="worker id (no dots)")
    parser.add_argument("--generation", type=int, default=0, help="restarts so far")
    parser.add_argument("--device", default=None, help="overrides the settings' device")
    parser.add_argument("--no-realtime", action="store_true", help="tick when every session has input")
    args = parser.parse_args(argv)
    die_with_parent()
    secret = os.environ.get("PERSONAPLEX_CLUSTER_SECRET", "")
    overrides = {"device": args.device} if args.device else {}
    settings = settings_from_file(args.settings, **overrides)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format=f"%(asctime)s %(levelname)s engine-worker[{args.id}] %(name)s: %(message)s",
    )
    try:
        manager = build_manager(settings, realtime=not args.no_realtime)
    except Exception as exc:
        log.error("engine worker %s could not load its engine: %s", args.id, exc)
        return 2
    if settings.tune_runtime:
        from personaplex_voice.process import runtime

        runtime.tune_for_realtime()
    info = WorkerInfo(
        worker_id=args.id,
        device=engine_device(manager.engine, settings),
        node=os.uname().nodename,
        generation=args.generation,
        pid=os.getpid(),
        host=host_identity(),
    )
    worker = EngineWorker(manager, info, secret)
    run_event_loop(_serve(worker, args.listen))
    return 0


def run_event_loop(main: Any) -> None:
    """uvloop when installed (it comes with uvicorn[standard]): cheaper per socket event."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


if __name__ == "__main__":
    sys.exit(main())
