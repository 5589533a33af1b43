"""The Twilio Media Streams wire format: parsing what Twilio sends, formatting what we send.

Twilio sends JSON text messages: `connected`, `start` (once), `media` (20 ms of base64 μ-law at
8 kHz), `mark` (echo of ours, once the audio before it has played), `dtmf`, `stop`. We send
`media`, `mark` and `clear`. Anything that breaks the format raises `ProtocolError` carrying the
WebSocket close code (RFC 6455) the call should be closed with.

This module knows nothing of the bridge, sessions or audio processing: only the messages.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any

from personaplex_voice import untrusted

# WebSocket close codes (RFC 6455)
CLOSE_NORMAL = 1000
CLOSE_INVALID_DATA = 1007
CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009
CLOSE_ERROR = 1011

MULAW = "audio/x-mulaw"


class ProtocolError(Exception):
    """The peer broke the Media Streams protocol; `code` is the WebSocket close code to use."""

    def __init__(self, message: str, code: int = CLOSE_POLICY):
        super().__init__(message)
        self.code = code


def parse_message(raw: dict[str, Any], max_bytes: int) -> dict[str, Any]:
    """An ASGI websocket.receive message -> the JSON object Twilio sent (with a str `event`)."""
    text = raw.get("text")
    if text is None:
        data = raw.get("bytes") or b""
        if len(data) > max_bytes:
            raise ProtocolError(f"message of {len(data)} bytes exceeds {max_bytes}", CLOSE_TOO_BIG)
        raise ProtocolError("binary frames are not part of Media Streams", CLOSE_INVALID_DATA)
    if len(text) > max_bytes:
        raise ProtocolError(f"message of {len(text)} bytes exceeds {max_bytes}", CLOSE_TOO_BIG)
    try:
        message = untrusted.loads(text, untrusted.JsonLimits(max_bytes=max_bytes))
    except untrusted.InputRefused as exc:
        raise ProtocolError(f"message refused: {exc}", CLOSE_INVALID_DATA) from None
    if not isinstance(message, dict) or not isinstance(message.get("event"), str):
        raise ProtocolError("message is not a JSON object with an `event`", CLOSE_INVALID_DATA)
    return message


def section(message: dict[str, Any], key: str) -> dict[str, Any]:
    """The message's `key` object (`start`, `media`, `mark`, `dtmf`); a ProtocolError without one."""
    value = message.get(key)
    if not isinstance(value, dict):
        raise ProtocolError(f"`{message['event']}` message without a `{key}` object", CLOSE_INVALID_DATA)
    return value


@dataclass(frozen=True)
class StreamStart:
    """What a `start` message tells about the stream."""

    stream_sid: str
    call_sid: str
    custom_parameters: dict[str, str]


def parse_start(message: dict[str, Any]) -> StreamStart:
    start = section(message, "start")
    stream_sid = start.get("streamSid") or message.get("streamSid")
    call_sid = start.get("callSid")
    if not isinstance(stream_sid, str) or not stream_sid or not isinstance(call_sid, str):
        raise ProtocolError("`start` without streamSid/callSid", CLOSE_INVALID_DATA)
    media_format = start.get("mediaFormat") or {}
    if isinstance(media_format, dict) and media_format.get("encoding", MULAW) != MULAW:
        raise ProtocolError(f"unsupported media format {media_format!r}", CLOSE_INVALID_DATA)
    params = start.get("customParameters") or {}
    if not isinstance(params, dict):
        raise ProtocolError("customParameters must be an object", CLOSE_INVALID_DATA)
    return StreamStart(stream_sid, call_sid, {str(k): str(v) for k, v in params.items()})


def is_caller_track(media: dict[str, Any]) -> bool:
    """Only the caller's audio goes to the agent (a stream may carry other tracks)."""
    return media.get("track", "inbound") in ("inbound", "inbound_track")


def media_payload(media: dict[str, Any]) -> bytes:
    """The μ-law bytes of a `media` section."""
    payload = media.get("payload")
    if not isinstance(payload, str):
        raise ProtocolError("`media` without a payload", CLOSE_INVALID_DATA)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError("`media` payload is not valid base64", CLOSE_INVALID_DATA) from None


def media_chunk(media: dict[str, Any]) -> int | None:
    """Twilio's running chunk number of a `media` section (a string of digits), if present."""
    chunk = media.get("chunk")
    return untrusted.ascii_int_or_none(chunk) if isinstance(chunk, str) else None


def dtmf_digit(dtmf: dict[str, Any]) -> str:
    digit = dtmf.get("digit")
    if not isinstance(digit, str) or len(digit) != 1:
        given = "no `digit`" if digit is None else f"`digit` {json.dumps(digit)[:40]}"
        raise ProtocolError(f"`dtmf` needs one digit, got {given}", CLOSE_INVALID_DATA)
    return digit


def mark_name(mark: dict[str, Any]) -> str | None:
    name = mark.get("name")
    return name if isinstance(name, str) else None


class OutboundMessages:
    """Our `media`, `mark` and `clear` messages for one stream, formatted from templates: the same
    JSON as `json.dumps` of the dicts, at a fraction of the cost (with hundreds of calls, building
    and encoding a dict per 20 ms message was a visible share of the server's CPU)."""

    def __init__(self, stream_sid: str):
        sid = json.dumps(stream_sid)
        self._media_head = '{"event":"media","streamSid":' + sid + ',"media":{"payload":"'
        self._mark_head = '{"event":"mark","streamSid":' + sid + ',"mark":{"name":'
        self._clear = '{"event":"clear","streamSid":' + sid + "}"

    def media(self, ulaw: bytes) -> str:
        # base64 text never needs JSON escaping
        return self._media_head + base64.b64encode(ulaw).decode("ascii") + '"}}'

    def mark(self, name: str) -> str:
        return self._mark_head + json.dumps(name) + "}}"

    def clear(self) -> str:
        return self._clear
