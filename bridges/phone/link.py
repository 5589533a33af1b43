"""The socket under a media stream, whatever it is: a WebSocket (most carriers) or a plain TCP
stream (Asterisk's AudioSocket). The phone call (stream.py, playout.py) only receives messages,
sends messages and closes; a `StreamLink` does that for one transport.

A received message is a mapping with `text` (str) or `bytes` (bytes), the shape of an ASGI
`websocket.receive` message, which is what every carrier's `StreamWire.parse` reads; a link over
another transport frames its bytes into such messages (it may add keys of its own for its wire).
A peer that went away raises `LinkClosed` from `receive` and from `send`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Protocol

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from .carrier import CLOSE_NORMAL, Outgoing


class LinkClosed(Exception):
    """The peer closed the link (or it broke); `code` is the close code where there is one."""

    def __init__(self, code: int = CLOSE_NORMAL):
        super().__init__(f"closed ({code})")
        self.code = code


class StreamLink(Protocol):
    async def receive(self) -> Mapping[str, Any]:
        """The next message; raises LinkClosed once the peer is gone."""
        ...

    async def send(self, message: Outgoing) -> None:
        """One message, whole; raises LinkClosed (or OSError) when the peer is gone."""
        ...

    @property
    def open(self) -> bool:
        """Still connected (worth a last message before closing)."""
        ...

    async def close(self, code: int, reason: str) -> None:
        """End the link (idempotent; never raises)."""
        ...


class WebSocketLink:
    """A Starlette WebSocket, already accepted (`accept` does both: accept, then wrap)."""

    def __init__(self, ws: WebSocket):
        self.ws = ws

    @classmethod
    async def accept(cls, ws: WebSocket, subprotocol: str | None = None) -> WebSocketLink:
        """Accept the upgrade and wrap it. `subprotocol`: the carrier's own (jambonz's
        `audio.jambonz.org`, chan_websocket's `media`), chosen when the client offers it; a
        client that offers none gets a plain WebSocket."""
        offered = ws.scope.get("subprotocols") or []
        await ws.accept(subprotocol=subprotocol if subprotocol and subprotocol in offered else None)
        return cls(ws)

    async def receive(self) -> Mapping[str, Any]:
        try:
            message = await self.ws.receive()
        except WebSocketDisconnect as exc:
            raise LinkClosed(exc.code) from None
        if message["type"] == "websocket.disconnect":
            raise LinkClosed(message.get("code", CLOSE_NORMAL))
        return message

    async def send(self, message: Outgoing) -> None:
        # uvicorn sends each message whole; one task writes at a time (see stream.py).
        try:
            if isinstance(message, bytes):
                await self.ws.send_bytes(message)
            else:
                await self.ws.send_text(message)
        except WebSocketDisconnect as exc:
            raise LinkClosed(exc.code) from None

    @property
    def open(self) -> bool:
        return self.ws.client_state == WebSocketState.CONNECTED

    async def close(self, code: int, reason: str) -> None:
        if not self.open:
            return
        with contextlib.suppress(Exception):  # already gone: nothing left to close
            await self.ws.close(code=code, reason=reason[:100])
