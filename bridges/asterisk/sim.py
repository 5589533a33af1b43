"""Asterisk's chan_websocket side of a call, for the phone call's carrier simulator
(`personaplex_phone.simulator`: `personaplex-voice phone simulate --carrier asterisk`, the
carriers' shared tests and benchmark). AudioSocket, plain TCP, is simulate.py's alone.

The dialplan's `POST /asterisk/calls` carries the API key (`Authorization: Bearer`; the server's
`PERSONAPLEX_PHONE_API_TOKEN` or `--api-key`) and the call's facts; its answer's `media_url` is
the stream, opened offering the `media` subprotocol. Then `MEDIA_START` (plain text by default,
JSON on request), BINARY frames in the channel's format, `DTMF_END`; `MARK_MEDIA` answered with
`MEDIA_MARK_PROCESSED` once played, `FLUSH_MEDIA` dropping the queue and its marks unanswered.
The caller hangs up by closing the socket. Asterisk sends no status webhooks: its "status" is
the dialplan asking for its next step.

Sources: docs.asterisk.org ("WebSocket channel driver": media and control frames, both control
formats, the `media` subprotocol); the protocol itself is spoken through sim_wire.py, written
from those docs, never through the bridge's media_ws.py.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import time
import uuid
from urllib.parse import parse_qsl

from personaplex_phone.carrier import AudioFormat
from personaplex_phone.sim_sides import SideDefaults
from personaplex_phone.simulator import HttpRequest, Ours, StreamOffer

from . import sim_wire as wire

_CALLS = itertools.count(1)


class AsteriskSide(SideDefaults):
    name = "asterisk"
    marks_on_clear = False  # FLUSH_MEDIA drops queued marks: they are never answered

    def __init__(self, api_key: str, fmt: str = "slin16", control: str = wire.PLAIN):
        codec, rate = wire.FORMATS[fmt]
        self.api_key = api_key
        self.format_name = fmt
        self.audio = AudioFormat(codec, rate)  # type: ignore[arg-type]
        self.control = control

    @staticmethod
    def new_call_id() -> str:
        return (
            f"{time.time():.0f}.{next(_CALLS)}{secrets.randbelow(10**6):06d}"  # like Asterisk's ${UNIQUEID}
        )

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def answer_request(
        self, public_url: str, call_id: str, to: str, from_: str, query: str = ""
    ) -> HttpRequest:
        body = {"call_id": call_id, "from": from_, "to": to, "variables": dict(parse_qsl(query))}
        headers = {**self._auth(), "Content-Type": "application/json"}
        return HttpRequest("POST", "/asterisk/calls", headers, json.dumps(body).encode())

    def parse_answer(self, call_id: str, status: int, body: bytes) -> StreamOffer | None:
        if status != 200:
            return None
        answer = json.loads(body)
        if not answer.get("uuid"):
            return None
        return StreamOffer(call_id, answer["media_url"], {}, self.audio, self.audio)

    def upgrade(self, offer: StreamOffer, public_url: str) -> tuple[str, dict[str, str]]:
        return offer.url, {"Sec-WebSocket-Protocol": wire.SUBPROTOCOL}

    def opening(self, offer: StreamOffer, stream_id: str) -> list[str | bytes]:
        frame = self.audio.chunk_bytes
        start = wire.event(
            "MEDIA_START",
            self.control,
            connection_id=str(uuid.uuid4()),
            channel=f"WebSocket/{stream_id}/0x1",
            channel_id=stream_id,
            format=self.format_name,
            optimal_frame_size=frame,
            ptime=self.chunk_ms,
        )
        return [start]

    def dtmf(self, offer: StreamOffer, stream_id: str, digit: str) -> str:
        return wire.event("DTMF_END", self.control, digit=digit, channel_id=stream_id)

    def read_text(self, message: str) -> Ours:
        name, ident = wire.read_command(message, self.control)
        if name == "MARK_MEDIA":
            return Ours("mark", name=ident)
        if name == "FLUSH_MEDIA":
            return Ours("clear")
        return Ours("other", name=name)

    def mark_played(self, offer: StreamOffer, stream_id: str, name: str) -> str:
        return wire.event("MEDIA_MARK_PROCESSED", self.control, channel_id=stream_id, correlation_id=name)

    def status_request(self, public_url: str, call_id: str, status: str) -> HttpRequest:
        return HttpRequest("GET", f"/asterisk/calls/{call_id}/next", self._auth())


def side(api_key: str | None = None, fmt: str = "slin16", control: str = wire.PLAIN) -> AsteriskSide:
    key = api_key or next(
        (
            os.environ[k]
            for k in ("PERSONAPLEX_PHONE_API_TOKEN", "PERSONAPLEX_TWILIO_API_TOKEN", "PERSONAPLEX_API_KEY")
            if os.environ.get(k)
        ),
        "",
    )
    if not key:
        raise ValueError(
            "the Asterisk simulator asks with the API key: set PERSONAPLEX_PHONE_API_TOKEN (the server's)"
        )
    return AsteriskSide(key, fmt, control)
