"""`WorkerLink`: a front-end's one connection to one engine worker, carrying all its sessions there.

It connects to the worker's `Endpoint` (resolved anew at every attempt: a Ray actor may move),
authenticates with the worker's secret, then multiplexes sessions over the session protocol
(`wire.py`). It decodes what the worker says and hands it on: connection events and STATUS to
its `LinkListener` (the front-end's `ClusterClient`), a session's messages to the
`ChannelListener` on that session's channel (a `RemoteSession`), which sends through the
`WorkerChannel` it was given. It keeps the worker's last STATUS and its own count of what is in
flight (opens and reservations not yet answered, slots freed since the last STATUS), so
placement and readiness see the worker as it is now, and reconnects with back-off while the
worker is down. A connection that ends (the kernel closes it at once when the worker's process
dies) or goes silent past the peer timeout ends the link's sessions with "engine_lost".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from personaplex_voice.cluster import wire
from personaplex_voice.cluster.wire import Kind, WireError
from personaplex_voice.engine.base import EngineError
from personaplex_voice.session_api import OutFrame

log = logging.getLogger("personaplex_voice.cluster.worker_link")

WELCOME_TIMEOUT_S = 10.0
PING_INTERVAL_S = 0.25
RECONNECT_S = (0.2, 0.5, 1.0, 2.0)  # back-off between attempts to reach a worker that is down


@dataclass(frozen=True)
class Endpoint:
    """Where an engine worker listens (`unix:PATH` or `tcp:HOST:PORT`) and the secret it wants."""

    address: str
    secret: str


@dataclass(frozen=True)
class Identity:
    """Who this front-end is, as it introduces itself to workers in HELLO."""

    frontend_id: str
    host: str  # procs.host_identity(): equal on both ends = one monotonic clock
    peer_timeout_s: float = 3.0


EndpointResolver = Callable[[], Awaitable[Endpoint | None]]


class LinkListener(Protocol):
    """What a link tells its front-end."""

    def link_changed(self, link: WorkerLink) -> None:
        """The link came up or went down, or the worker reported its state (STATUS): placement,
        readiness and the waiting queue may see it differently now."""

    def output_hop(self, seconds: float) -> None:
        """A frame took this long from the worker's engine to here (same host only)."""


class ChannelListener(Protocol):
    """What a link tells the session on one of its channels (in the order the worker said it)."""

    def worker_opened(self, answer: dict[str, Any]) -> None: ...

    def worker_ready(self, answer: dict[str, Any]) -> None: ...

    def worker_frame(self, frame: OutFrame) -> None: ...

    def worker_closed(self, answer: dict[str, Any]) -> None: ...

    def worker_refused(self, error: EngineError) -> None:
        """The worker would not take the session; the channel is gone."""

    def worker_lost(self) -> None:
        """The connection to the worker ended; the channel is gone."""


class WorkerChannel:
    """One session's channel on a link: everything the session sends goes through here."""

    def __init__(self, link: WorkerLink, number: int):
        self._link = link
        self.number = number

    @property
    def worker_id(self) -> str:
        return self._link.worker_id

    @property
    def lossless(self) -> bool:
        """The worker waits for credit instead of dropping frames a consumer did not take."""
        return bool(self._link.info.get("lossless"))

    def send_audio(self, frame: np.ndarray, sent_at: float) -> None:
        self._link.send(wire.audio_message(self.number, frame, sent_at))

    def send_pieces(self, samples: int) -> None:
        self._link.send(wire.pieces_message(self.number, samples))

    def send_end_input(self) -> None:
        self._link.send(wire.message(Kind.END_INPUT, self.number))

    def send_credit(self, frames: int) -> None:
        self._link.send(wire.credit_message(self.number, frames))

    def close(self, reason: str) -> None:
        """Tell the worker the session ended here; its slot counts free from now."""
        self._link.close_channel(self.number, reason)

    def forget(self) -> None:
        """Stop routing the worker's messages to the session (it ended without telling the worker)."""
        self._link.drop_channel(self.number)

    def seconds_to_next_tick(self) -> float | None:
        return self._link.seconds_to_next_tick()


class _LinkProtocol(asyncio.Protocol):
    def __init__(self, link: WorkerLink):
        self.link = link
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.link.data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)


class WorkerLink:
    """The connection to one engine worker, kept up while the front-end runs."""

    def __init__(self, listener: LinkListener, identity: Identity, worker_id: str, resolve: EndpointResolver):
        self.listener = listener
        self.identity = identity
        self.worker_id = worker_id
        self.resolve = resolve
        self.up = False
        self.address: str | None = None
        self.info: dict[str, Any] = {}  # the worker's WELCOME
        self.status: dict[str, Any] = {}  # its last STATUS, less the metrics
        self.metrics_snapshot: dict[str, Any] = {}  # its manager's metrics (metrics.Snapshot)
        self.input_hop: dict[str, Any] | None = None  # the worker's view of our frames' hop
        self.connects = 0
        self.same_host = False
        self._channels: dict[int, ChannelListener] = {}
        self._pending_opens: set[int] = set()  # unticketed OPENs not yet answered
        self._unacked_reservations: set[str] = set()  # RESERVEs not yet answered
        self._freed_since_status = 0  # our sessions there that closed since its last report
        self._tick_due_at: float | None = None  # our monotonic estimate of its next tick
        self._last_seen = 0.0
        self._next_channel = 1
        self._reader = wire.MessageReader()
        self._transport: asyncio.Transport | None = None
        self._welcome: asyncio.Future[None] | None = None
        self._out: list[bytes] = []
        self._flush_handle: asyncio.Handle | None = None
        self._last_sent = 0.0
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    # -- life ------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"link-{self.worker_id}")

    async def stop(self) -> None:
        self._stopping = True
        if self._transport is not None:
            self._transport.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        attempt = 0
        while not self._stopping:
            try:
                endpoint = await self.resolve()
                if endpoint is not None:
                    await self._connect_and_serve(endpoint)
                    attempt = 0 if self.connects else attempt
            except asyncio.CancelledError:
                raise
            except (TimeoutError, OSError, WireError) as exc:
                log.debug("engine worker %s unreachable: %s", self.worker_id, exc)
            except Exception:
                log.exception("link to engine worker %s failed", self.worker_id)
            finally:
                self._went_down()
            await asyncio.sleep(RECONNECT_S[min(attempt, len(RECONNECT_S) - 1)])
            attempt += 1

    async def _connect_and_serve(self, endpoint: Endpoint) -> None:
        loop = asyncio.get_running_loop()
        address = endpoint.address
        kind, _, rest = address.partition(":")
        protocol = _LinkProtocol(self)
        self._reader = wire.MessageReader()
        self._welcome = loop.create_future()
        if kind == "unix":
            transport, _ = await loop.create_unix_connection(lambda: protocol, rest)
        elif kind == "tcp":
            host, _, port = rest.rpartition(":")
            transport, _ = await loop.create_connection(lambda: protocol, host, int(port))
        else:
            raise WireError(f"bad worker address {address!r}")
        self._transport = transport  # type: ignore[assignment]
        self.address = address
        self._last_seen = time.monotonic()
        identity = self.identity
        hello = {
            "version": wire.PROTOCOL_VERSION,
            "secret": endpoint.secret,
            "frontend": identity.frontend_id,
            "pid": os.getpid(),
            "host": identity.host,
        }
        self._send_now(wire.json_message(Kind.HELLO, 0, hello))
        try:
            await asyncio.wait_for(asyncio.shield(self._welcome), WELCOME_TIMEOUT_S)
            self.up = True
            self.connects += 1
            log.info(
                "engine worker %s up at %s (pid %s, %s)",
                self.worker_id,
                address,
                self.info.get("pid"),
                self.info.get("engine"),
            )
            self.listener.link_changed(self)
            while not protocol.lost.done():
                await asyncio.wait({protocol.lost}, timeout=PING_INTERVAL_S)
                now = time.monotonic()
                if now - self._last_seen > identity.peer_timeout_s:
                    log.warning(
                        "engine worker %s silent for %.1f s: treated as lost",
                        self.worker_id,
                        now - self._last_seen,
                    )
                    transport.abort()
                    break
                if now - self._last_sent >= PING_INTERVAL_S:
                    self.send(wire.message(Kind.PING))
        finally:
            if not transport.is_closing():
                transport.abort()

    def _went_down(self) -> None:
        was_up = self.up
        self.up = False
        self._transport = None
        self._out.clear()
        self._pending_opens.clear()
        self._unacked_reservations.clear()
        sessions = list(self._channels.values())
        self._channels.clear()
        for session in sessions:
            session.worker_lost()
        if was_up and not self._stopping:
            log.warning("engine worker %s lost (%d session(s) ended)", self.worker_id, len(sessions))
            self.listener.link_changed(self)

    # -- what sessions and the front-end send ----------------------------------------------------

    def open(self, listener: ChannelListener, request: dict[str, Any], *, unticketed: bool) -> WorkerChannel:
        """OPEN a session on a new channel; the worker's answers go to `listener`. An
        `unticketed` open takes a free slot there, so it counts against `free` until answered."""
        number = self._next_channel
        self._next_channel = number + 1 if number < 0xFFFFFFFF else 1
        self._channels[number] = listener
        if unticketed:
            self._pending_opens.add(number)
        self.send(wire.json_message(Kind.OPEN, number, request))
        return WorkerChannel(self, number)

    def reserve(self, request: dict[str, Any]) -> None:
        """RESERVE a slot under the front-end's ticket id; counted taken until answered."""
        self._unacked_reservations.add(str(request["ticket"]))
        self.send(wire.json_message(Kind.RESERVE, 0, request))

    def cancel(self, ticket_id: str) -> None:
        self.send(wire.message(Kind.CANCEL, 0, ticket_id.encode()))

    def close_channel(self, number: int, reason: str) -> None:
        if self._channels.pop(number, None) is None:
            return
        self._pending_opens.discard(number)
        self.send(wire.message(Kind.CLOSE, number, reason[:80].encode()))
        self._freed_since_status += 1

    def drop_channel(self, number: int) -> None:
        self._channels.pop(number, None)
        self._pending_opens.discard(number)

    def send(self, data: bytes) -> None:
        if self._transport is None:
            return
        self._out.append(data)
        if self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_soon(self._flush)

    def _send_now(self, data: bytes) -> None:
        if self._transport is not None:
            self._transport.write(data)
            self._last_sent = time.monotonic()

    def _flush(self) -> None:
        self._flush_handle = None
        if self._transport is None or not self._out:
            self._out.clear()
            return
        data = b"".join(self._out) if len(self._out) > 1 else self._out[0]
        self._out.clear()
        self._send_now(data)

    # -- receiving -------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        self._last_seen = time.monotonic()
        try:
            messages = self._reader.feed(data)
            for kind, channel, body in messages:
                self._dispatch(kind, channel, body)
        except WireError as exc:
            log.warning("engine worker %s broke the protocol: %s", self.worker_id, exc)
            if self._transport is not None:
                self._transport.abort()

    def _dispatch(self, kind: Kind, channel: int, body: bytes) -> None:
        if kind is Kind.FRAME:
            session = self._channels.get(channel)
            index, stamp, pcm, text, tokens = wire.parse_frame(body)
            if self.same_host:
                self.listener.output_hop(time.monotonic() - stamp)
            if session is not None:
                session.worker_frame(OutFrame(pcm=pcm, text=text, index=index, tokens=tokens))
        elif kind is Kind.STATUS:
            status = wire.parse_json(body)
            metrics = status.pop("metrics", None)
            if isinstance(metrics, dict):  # once a second, with the input hop
                self.metrics_snapshot = metrics
                self.input_hop = status.pop("input_hop", None)
            self.status = status
            self._freed_since_status = 0
            self._note_tick(status.get("tick_due_in_s"))
            self.listener.link_changed(self)
        elif kind is Kind.OPENED:
            self._pending_opens.discard(channel)
            session = self._channels.get(channel)
            if session is not None:
                session.worker_opened(wire.parse_json(body))
        elif kind is Kind.READY:
            session = self._channels.get(channel)
            answer = wire.parse_json(body)
            self._note_tick(answer.get("tick_due_in_s"))
            if session is not None:
                session.worker_ready(answer)
        elif kind is Kind.CLOSED:
            self._pending_opens.discard(channel)
            session = self._channels.pop(channel, None)
            if session is not None:
                session.worker_closed(wire.parse_json(body))
        elif kind is Kind.REFUSED:
            self._pending_opens.discard(channel)
            session = self._channels.pop(channel, None)
            if session is not None:
                session.worker_refused(wire.refusal_error(wire.parse_json(body)))
        elif kind is Kind.RESERVED:
            answer = wire.parse_json(body)
            self._unacked_reservations.discard(str(answer.get("ticket")))
            if not answer.get("ok"):
                log.info("engine worker %s refused a reservation: %s", self.worker_id, answer.get("error"))
        elif kind is Kind.WELCOME:
            self.info = wire.parse_json(body)
            self.same_host = self.info.get("host") == self.identity.host
            if self._welcome is not None and not self._welcome.done():
                self._welcome.set_result(None)
        else:
            raise WireError(f"{kind.name} is not sent to a front-end")

    def _note_tick(self, due_in: Any) -> None:
        self._tick_due_at = time.monotonic() + due_in if isinstance(due_in, int | float) else None

    def seconds_to_next_tick(self) -> float | None:
        due, period = self._tick_due_at, self.info.get("frame_period_s")
        if due is None or not isinstance(period, int | float) or period <= 0:
            return None
        now = time.monotonic()
        if due < now:
            due += period * (int((now - due) / period) + 1)
        return due - now

    # -- what placement and /api/cluster see -------------------------------------------------------

    @property
    def capacity(self) -> int:
        if not self.up:
            return 0
        return int(self.status.get("capacity", self.info.get("num_slots", 0)))

    @property
    def free(self) -> int:
        """Slots an unticketed open could take there now: its last report, plus what closed here
        since, minus our opens and reservations it has not answered yet."""
        if not self.up:
            return 0
        reported = int(self.status.get("available", 0)) + self._freed_since_status
        in_flight = len(self._pending_opens) + len(self._unacked_reservations)
        return min(reported, int(self.status.get("capacity", 0))) - in_flight

    @property
    def reserved(self) -> int:
        """Slots held by tickets there, ours not yet answered included."""
        if not self.up:
            return 0
        return int(self.status.get("reserved", 0)) + len(self._unacked_reservations)

    @property
    def saturated(self) -> bool:
        """The worker said (its last STATUS) that it has no real-time headroom left."""
        return self.up and bool(self.status.get("saturated"))

    def holds(self, fingerprint: str) -> bool:
        return fingerprint in (self.status.get("cached") or ())
