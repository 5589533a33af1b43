"""`WorkerLink`: a front-end's one connection to one engine worker, carrying all its sessions there.

It connects to the worker's `Endpoint` (resolved anew at every attempt: a Ray actor may move),
authenticates with the worker's secret, then multiplexes the sessions' channels over the session
protocol (`wire.py`), keeps the worker's last STATUS (slots, cached personas, tick phase) for
placement and readiness, and reconnects with back-off while the worker is down. A connection
that ends (the kernel closes it at once when the worker's process dies) or goes silent past the
peer timeout ends the link's sessions with close reason "engine_lost".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from personaplex_voice.cluster import wire
from personaplex_voice.cluster.remote_session import refusal_error
from personaplex_voice.cluster.wire import Kind, WireError
from personaplex_voice.sessions import OutFrame

if TYPE_CHECKING:
    from personaplex_voice.cluster.client import ClusterClient
    from personaplex_voice.cluster.remote_session import RemoteSession

log = logging.getLogger("personaplex_voice.cluster.worker_link")

WELCOME_TIMEOUT_S = 10.0
PING_INTERVAL_S = 0.25
RECONNECT_S = (0.2, 0.5, 1.0, 2.0)  # back-off between attempts to reach a worker that is down


@dataclass(frozen=True)
class Endpoint:
    """Where an engine worker listens (`unix:PATH` or `tcp:HOST:PORT`) and the secret it wants."""

    address: str
    secret: str


EndpointResolver = Callable[[], Awaitable[Endpoint | None]]
Discovery = Callable[["ClusterClient"], Awaitable[None]]


class _LinkProtocol(asyncio.Protocol):
    def __init__(self, link: WorkerLink):
        self.link = link
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.link._on_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)


class WorkerLink:
    """The connection to one engine worker, kept up while the client runs."""

    def __init__(self, client: ClusterClient, worker_id: str, resolve: EndpointResolver):
        self.client = client
        self.worker_id = worker_id
        self.resolve = resolve
        self.up = False
        self.address: str | None = None
        self.info: dict[str, Any] = {}
        self.status: dict[str, Any] = {}
        self.metrics_snapshot: dict[str, Any] = {}
        self.input_hop: dict[str, Any] | None = None  # the worker's view of our frames' hop
        self.pending_opens = 0
        self.unacked_reservations = 0
        self.freed_since_status = 0  # our sessions there that closed since its last report
        self.tick_due_at: float | None = None  # our monotonic estimate of its next tick
        self.channels: dict[int, RemoteSession] = {}
        self.same_host = False
        self.connects = 0
        self.last_seen = 0.0
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
        self.last_seen = time.monotonic()
        client = self.client
        self._send_now(
            wire.json_message(
                Kind.HELLO,
                0,
                {
                    "version": wire.PROTOCOL_VERSION,
                    "secret": endpoint.secret,
                    "frontend": client.frontend_id,
                    "pid": os.getpid(),
                    "host": client.host,
                },
            )
        )
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
            client._link_changed()
            while not protocol.lost.done():
                await asyncio.wait({protocol.lost}, timeout=PING_INTERVAL_S)
                now = time.monotonic()
                if now - self.last_seen > client.peer_timeout_s:
                    log.warning(
                        "engine worker %s silent for %.1f s: treated as lost",
                        self.worker_id,
                        now - self.last_seen,
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
        self.pending_opens = 0
        self.unacked_reservations = 0
        sessions = list(self.channels.values())
        self.channels.clear()
        for session in sessions:
            session._on_engine_lost()
        if was_up and not self._stopping:
            log.warning("engine worker %s lost (%d session(s) ended)", self.worker_id, len(sessions))
            self.client.metrics.engine_lost_sessions.inc(len(sessions))
            self.client._link_changed()

    # -- sending ---------------------------------------------------------------------------------

    def new_channel(self) -> int:
        channel = self._next_channel
        self._next_channel = channel + 1 if channel < 0xFFFFFFFF else 1
        return channel

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

    def _on_data(self, data: bytes) -> None:
        self.last_seen = time.monotonic()
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
            session = self.channels.get(channel)
            index, stamp, pcm, text, tokens = wire.parse_frame(body)
            if self.same_host:
                self.client.output_hops.add(time.monotonic() - stamp)
            if session is not None:
                session._on_frame(OutFrame(pcm=pcm, text=text, index=index, tokens=tokens))
        elif kind is Kind.STATUS:
            status = wire.parse_json(body)
            metrics = status.pop("metrics", None)
            if isinstance(metrics, dict):  # once a second, with the input hop
                self.metrics_snapshot = metrics
                self.input_hop = status.pop("input_hop", None)
            self.status = status
            self.freed_since_status = 0
            self._note_tick(status.get("tick_due_in_s"))
            self.client._link_changed()
        elif kind is Kind.OPENED:
            session = self.channels.get(channel)
            if session is not None:
                session._on_opened(wire.parse_json(body))
        elif kind is Kind.READY:
            session = self.channels.get(channel)
            answer = wire.parse_json(body)
            self._note_tick(answer.get("tick_due_in_s"))
            if session is not None:
                session._on_ready(answer)
        elif kind is Kind.CLOSED:
            session = self.channels.pop(channel, None)
            if session is not None:
                session._on_closed(wire.parse_json(body))
        elif kind is Kind.REFUSED:
            session = self.channels.get(channel)
            if session is not None:
                session._on_refused(refusal_error(wire.parse_json(body)))
        elif kind is Kind.RESERVED:
            answer = wire.parse_json(body)
            self.unacked_reservations = max(0, self.unacked_reservations - 1)
            if not answer.get("ok"):
                log.info("engine worker %s refused a reservation: %s", self.worker_id, answer.get("error"))
        elif kind is Kind.WELCOME:
            self.info = wire.parse_json(body)
            self.same_host = self.info.get("host") == self.client.host
            if self._welcome is not None and not self._welcome.done():
                self._welcome.set_result(None)
        else:
            raise WireError(f"{kind.name} is not sent to a front-end")

    def _note_tick(self, due_in: Any) -> None:
        self.tick_due_at = time.monotonic() + due_in if isinstance(due_in, int | float) else None

    def seconds_to_next_tick(self) -> float | None:
        due, period = self.tick_due_at, self.info.get("frame_period_s")
        if due is None or not isinstance(period, int | float) or period <= 0:
            return None
        now = time.monotonic()
        if due < now:
            due += period * (int((now - due) / period) + 1)
        return due - now

    # -- what placement sees ---------------------------------------------------------------------

    @property
    def free(self) -> int:
        if not self.up:
            return 0
        reported = int(self.status.get("available", 0)) + self.freed_since_status
        return (
            min(reported, int(self.status.get("capacity", 0)))
            - self.pending_opens
            - self.unacked_reservations
        )

    def holds(self, fingerprint: str) -> bool:
        return fingerprint in (self.status.get("cached") or ())
