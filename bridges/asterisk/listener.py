"""The AudioSocket listener (`serve --audiosocket HOST:PORT`): Asterisk connects here over plain
TCP, one connection per call, and the phone call runs on it like on any carrier's WebSocket.

A connection must start with the UUID message, within a few seconds, and the UUID must be one
`POST /asterisk/calls` handed out and no stream has used: anything else gets AudioSocket's
hang-up and is closed (AudioSocket has no authentication of its own, so the UUID is the only
credential; keep the port on the network between Asterisk and this server).

`AudioSocketLink` is the phone call's `StreamLink` over that TCP stream: one received message
per AudioSocket message (`{"kind": k, "bytes": payload}`), ours written whole; closing it sends
the hang-up message first, so `AudioSocket()` returns and the dialplan goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from personaplex_phone.link import LinkClosed

from . import audiosocket as asock

log = logging.getLogger(__name__)

OnConnection = Callable[["AudioSocketLink", str, str], Awaitable[None]]  # (link, uuid, peer)


async def read_message(reader: asyncio.StreamReader) -> asock.Message:
    """One whole AudioSocket message; LinkClosed when the peer is gone (even mid-message)."""
    try:
        kind, length = asock.header(await reader.readexactly(asock.HEADER.size))
        payload = await reader.readexactly(length) if length else b""
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise LinkClosed() from exc
    return asock.Message(kind, payload)


class AudioSocketLink:
    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, first: asock.Message | None
    ):
        self.reader = reader
        self.writer = writer
        self._first = first  # the UUID message the listener has read already
        self._closed = False

    async def receive(self) -> Mapping[str, Any]:
        if self._first is not None:
            message, self._first = self._first, None
        else:
            message = await read_message(self.reader)
        return {"kind": message.kind, "bytes": message.payload}

    async def send(self, message: str | bytes) -> None:
        if self._closed or self.writer.is_closing():
            raise LinkClosed()
        data = message if isinstance(message, bytes) else message.encode()
        try:
            self.writer.write(data)
            await self.writer.drain()
        except ConnectionError as exc:
            raise LinkClosed() from exc

    @property
    def open(self) -> bool:
        return not self._closed and not self.writer.is_closing()

    async def close(self, code: int = 1000, reason: str = "") -> None:
        if self._closed:
            return
        with contextlib.suppress(Exception):
            if not self.writer.is_closing():
                self.writer.write(asock.HANGUP)
                await asyncio.wait_for(self.writer.drain(), 1.0)
        self._closed = True
        self.writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.writer.wait_closed(), 1.0)


class AudioSocketListener:
    def __init__(self, host: str, port: int, uuid_timeout_s: float, on_connection: OnConnection):
        self.host = host
        self.port = port
        self.uuid_timeout_s = uuid_timeout_s
        self.on_connection = on_connection
        self.server: asyncio.Server | None = None
        self._socket: socket.socket | None = None
        self._connections: set[asyncio.Task[Any]] = set()
        self.refused = 0

    @property
    def address(self) -> tuple[str, int]:
        """Where it listens (the port the OS chose, for port 0)."""
        if self.server is None or not self.server.sockets:
            return self.host, self.port
        name = self.server.sockets[0].getsockname()
        return name[0], name[1]

    def bind(self) -> None:
        """Take the port now, while the server starts (a port in use is a one-line error then,
        not a failed startup later); `start` serves it."""
        from personaplex_voice.errors import UserError

        try:
            family = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0][0]
            self._socket = socket.create_server((self.host, self.port), family=family, backlog=256)
        except OSError as exc:
            raise UserError(f"--audiosocket {self.host}:{self.port}: {exc.strerror or exc}") from None
        self._socket.setblocking(False)

    async def start(self) -> None:
        if self._socket is None:
            self.bind()
        self.server = await asyncio.start_server(self._accept, sock=self._socket)
        log.info("asterisk: AudioSocket listening on %s:%d", *self.address)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self._connections):
            task.cancel()
        for task in list(self._connections):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 2.0)
        elif self._socket is not None:
            self._socket.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
        peer = str(writer.get_extra_info("peername"))
        try:
            first = await self._first_message(reader, peer)
            link = AudioSocketLink(reader, writer, first)
            if first is None:
                self.refused += 1
                await link.close()
                return
            await self.on_connection(link, asock.parse_uuid(first.payload), peer)
        finally:
            if task is not None:
                self._connections.discard(task)
            if not writer.is_closing():
                writer.close()

    async def _first_message(self, reader: asyncio.StreamReader, peer: str) -> asock.Message | None:
        """The UUID message, or None (logged) for a connection that does not start with one."""
        try:
            first = await asyncio.wait_for(read_message(reader), self.uuid_timeout_s)
        except (TimeoutError, LinkClosed, asock.FrameError):
            log.warning("asterisk: AudioSocket connection from %s sent no UUID message", peer)
            return None
        if first.kind != asock.KIND_UUID or len(first.payload) != 16:
            log.warning("asterisk: AudioSocket connection from %s did not start with its UUID", peer)
            return None
        return first
