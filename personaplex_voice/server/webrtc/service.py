"""The WebRTC transport of one server process: its calls by id, its settings and its instruments.

A call id is the capability that names a call in later requests (WHIP's session URL, Pipecat's
`pc_id`): 128 random bits after a tag of the process that holds the call. The tag matters in a
cluster, where several front-end processes share one port and the kernel hands each new TCP
connection to any of them: a follow-up request (DELETE, PATCH, a Pipecat renegotiation) that
lands on another process than the call's is answered `421 Misdirected Request`, which a client
retries on a new connection (the web page does), instead of a misleading 404. The call's media
never moves: its UDP sockets live in the process that answered its offer.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from personaplex_voice.metrics import LabelledSnapshot
from personaplex_voice.process.settings import ServerSettings
from personaplex_voice.server.webrtc.ice import IceServer, parse_ice_servers
from personaplex_voice.server.webrtc.metrics import WebRTCMetrics

__all__ = ["CallNotHere", "PipecatStart", "WebRTCService"]

MAX_STARTS = 256  # Pipecat /start bodies waiting for their offer
START_TTL_S = 120.0


class CallNotHere(Exception):
    """The id names a call of another process (`elsewhere`) or no live call at all."""

    def __init__(self, call_id: str, elsewhere: bool):
        super().__init__(call_id)
        self.elsewhere = elsewhere


@dataclass
class PipecatStart:
    """What a Pipecat client's `POST /start` gave, for the offer that follows."""

    body: dict[str, Any]
    query: dict[str, str]
    created: float = field(default_factory=time.monotonic)


class WebRTCService:
    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.ice_servers: tuple[IceServer, ...] = tuple(parse_ice_servers(settings.webrtc_ice_servers))
        self.tag = secrets.token_hex(3)
        self.metrics = WebRTCMetrics.create()
        self.calls: dict[str, Any] = {}  # id -> WebRTCCall (typed loosely: aiortc loads lazily)
        self.starts: OrderedDict[str, PipecatStart] = OrderedDict()
        self.available: bool | None = None  # aiortc importable (checked at startup)
        self.unavailable_reason = ""

    def new_id(self) -> str:
        return f"{self.tag}-{secrets.token_urlsafe(16)}"

    def find(self, call_id: str) -> Any:
        call = self.calls.get(call_id)
        if call is None:
            raise CallNotHere(call_id, elsewhere=call_id.partition("-")[0] != self.tag and "-" in call_id)
        return call

    def add(self, call: Any) -> None:
        self.calls[call.id] = call
        self.metrics.calls.inc()

    def forget(self, call: Any) -> None:
        if self.calls.get(call.id) is call:
            del self.calls[call.id]

    def snapshots(self) -> list[LabelledSnapshot]:
        return [LabelledSnapshot({}, self.metrics.snapshot())]

    # -- Pipecat's /start, then /sessions/{id}/api/offer -----------------------------------------

    def remember_start(self, body: dict[str, Any], query: dict[str, str]) -> str:
        self._expire_starts()
        while len(self.starts) >= MAX_STARTS:
            self.starts.popitem(last=False)
        start_id = secrets.token_urlsafe(16)
        self.starts[start_id] = PipecatStart(body, query)
        return start_id

    def start_for(self, start_id: str) -> PipecatStart | None:
        self._expire_starts()
        return self.starts.get(start_id)

    def _expire_starts(self) -> None:
        now = time.monotonic()
        while self.starts and now - next(iter(self.starts.values())).created > START_TTL_S:
            self.starts.popitem(last=False)

    async def close_all(self, reason: str = "shutdown") -> None:
        from personaplex_voice.server.webrtc.call import CallEnded

        calls = list(self.calls.values())
        await asyncio.gather(
            *(call.end(CallEnded("session_ended", "the server is shutting down", reason)) for call in calls),
            return_exceptions=True,
        )
