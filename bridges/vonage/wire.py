"""Vonage's WebSocket endpoint: its messages, both ways.

Audio is **binary**: 16-bit linear PCM, **little-endian**, mono, at the rate of the endpoint's
`content-type` (`audio/l16;rate=16000`: 640 bytes per 20 ms message), in both directions; we
send exactly one 20 ms message at a time. Everything else is JSON text: Vonage sends
`websocket:connected` first (its `content-type` and the `headers` of our NCCO endpoint), then
`websocket:dtmf` (`digit`), `websocket:notify` (the `payload` of one of our `notify`s, once the
audio before it has played) and `websocket:cleared`; we send `{"action": "notify", "payload":
{...}}` and `{"action": "clear"}`. The stream ends when the socket closes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from personaplex_phone import wire_json as j
from personaplex_phone.carrier import (
    CLOSE_INVALID_DATA,
    AudioFormat,
    Digit,
    MarkPlayed,
    ProtocolError,
    StreamEvent,
    StreamStart,
)

CALL_ID_HEADER = "call_uuid"  # ours: the call's uuid, set in the NCCO endpoint's headers
_RESERVED = {"event", "content-type", "headers"}


def audio_format(content_type: str) -> AudioFormat:
    kind, rate = j.content_type_rate(content_type)
    if kind != "audio/l16" or rate not in (8000, 16000):
        raise ProtocolError(f"Vonage content-type {content_type!r} is not supported here", CLOSE_INVALID_DATA)
    return AudioFormat("l16", rate, big_endian=False)


class VonageWire:
    def __init__(self) -> None:
        self.started = False
        self.format = AudioFormat("l16", 16000)

    def parse(self, raw: Mapping[str, Any]) -> StreamEvent | None:
        media = j.binary_l16(raw, self.started, "audio before `websocket:connected`")
        if media is not None:
            return media
        message = j.json_message(raw)
        event = message["event"]
        if event == "websocket:connected":
            return self._start(message)
        if not self.started:
            raise ProtocolError(f"`{event}` before `websocket:connected`")
        if event == "websocket:dtmf":
            dtmf = message.get("dtmf")
            return Digit(j.digit(message.get("digit", dtmf.get("digit") if isinstance(dtmf, dict) else None)))
        if event == "websocket:notify":
            payload = message.get("payload")
            name = payload.get("name") if isinstance(payload, dict) else None
            return MarkPlayed(name) if isinstance(name, str) else None
        return None  # websocket:cleared, and anything new

    def _start(self, message: dict[str, Any]) -> StreamStart:
        if self.started:
            raise ProtocolError("a second `websocket:connected` on one stream")
        self.format = audio_format(str(message.get("content-type", "")))
        headers = message.get("headers") if isinstance(message.get("headers"), dict) else message
        params = {k: v for k, v in j.string_map(headers).items() if k not in _RESERVED}
        call_id = params.pop(CALL_ID_HEADER, "")
        if not call_id:
            raise ProtocolError(
                f"`websocket:connected` without our `{CALL_ID_HEADER}` header", CLOSE_INVALID_DATA
            )
        self.started = True
        return StreamStart("", call_id, self.format, self.format, params=params)

    def media(self, payload: bytes) -> bytes:
        return payload

    def mark(self, name: str) -> str:
        return j.dumps({"action": "notify", "payload": {"name": name}})

    def clear(self) -> str:
        return '{"action":"clear"}'
