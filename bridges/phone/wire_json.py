"""What carriers' stream wires share: reading a JSON text message, its sections and fields,
base64 payloads, DTMF keys, L16 in binary frames; and `JsonStreamWire`, the receiving half of the
Twilio-style JSON stream (`start` once, then `media`, `mark`, `dtmf`, `stop` of that stream)
that Twilio, Telnyx, Plivo and Exotel speak with their own key names. Each failure is a
ProtocolError with the close code to end the stream with. Plain data: no sockets, nothing of the
call."""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from typing import Any, ClassVar

from personaplex_voice import untrusted

from .carrier import (
    CLOSE_INVALID_DATA,
    CallerMedia,
    Digit,
    MarkPlayed,
    ProtocolError,
    StreamEvent,
    StreamStart,
    StreamStop,
)

DTMF_KEYS = frozenset("0123456789*#ABCD")
CALLER_TRACKS = ("inbound", "inbound_track")  # a stream may carry other tracks: only these are the caller
# A stream's JSON messages: the stream refuses one over its own byte limit first (1009,
# PERSONAPLEX_PHONE_MAX_MESSAGE_BYTES); depth and numbers are bounded here (1007).
MESSAGE_LIMITS = untrusted.JsonLimits(max_bytes=16 << 20)
COUNTER_DIGITS = 18  # a carrier's counter given as text (chunk, sequence number, rate)


def json_message(raw: Mapping[str, Any], event_key: str = "event") -> dict[str, Any]:
    """An ASGI websocket.receive message -> the JSON object it carries (with a str `event`)."""
    text = raw.get("text")
    if text is None:
        raise ProtocolError("binary frames are not part of this stream protocol", CLOSE_INVALID_DATA)
    return json_text(text, event_key)


def json_value(text: str) -> Any:
    """A stream's JSON text message, bounded (untrusted.loads), or a ProtocolError (1007)."""
    try:
        return untrusted.loads(text, MESSAGE_LIMITS)
    except untrusted.InputRefused as exc:
        raise ProtocolError(f"message refused: {exc}", CLOSE_INVALID_DATA) from None


def json_text(text: str, event_key: str = "event") -> dict[str, Any]:
    message = json_value(text)
    if not isinstance(message, dict) or not isinstance(message.get(event_key), str):
        raise ProtocolError(f"message is not a JSON object with an `{event_key}`", CLOSE_INVALID_DATA)
    return message


def section(message: Mapping[str, Any], key: str) -> dict[str, Any]:
    """The message's `key` object; a ProtocolError without one."""
    value = message.get(key)
    if not isinstance(value, dict):
        event = message.get("event", "message")
        raise ProtocolError(f"`{event}` message without a `{key}` object", CLOSE_INVALID_DATA)
    return value


def text_field(values: Mapping[str, Any], key: str, what: str) -> str:
    value = values.get(key)
    if not isinstance(value, str) or not value:
        raise ProtocolError(f"{what} without `{key}`", CLOSE_INVALID_DATA)
    return value


def number(value: Any) -> int | None:
    """A carrier's counter (a number, or a string of ASCII digits), or None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value  # a decoded message's: within 64 bits (untrusted.loads)
    if isinstance(value, str):
        return untrusted.ascii_int_or_none(value, COUNTER_DIGITS)
    return None


def b64_payload(values: Mapping[str, Any], key: str = "payload") -> bytes:
    payload = values.get(key)
    if not isinstance(payload, str):
        raise ProtocolError(f"media without a `{key}`", CLOSE_INVALID_DATA)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError("media payload is not valid base64", CLOSE_INVALID_DATA) from None


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def digit(value: Any) -> str:
    """One DTMF key, or a ProtocolError saying what came instead."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 9:
        value = str(value)
    if not isinstance(value, str) or len(value) != 1 or value not in DTMF_KEYS:
        given = "no digit" if value is None else f"{json.dumps(value)[:40]}"
        raise ProtocolError(f"a DTMF event needs one key (0-9 * # A-D), got {given}", CLOSE_INVALID_DATA)
    return value


def string_map(value: Any) -> dict[str, str]:
    """A carrier's custom parameters as plain strings (anything else: none)."""
    if not isinstance(value, dict):
        return {}
    return {str(k): str(v) for k, v in value.items() if isinstance(v, str | int | float)}


def dumps(message: Mapping[str, Any]) -> str:
    return json.dumps(message, separators=(",", ":"))


def content_type_rate(value: str) -> tuple[str, int | None]:
    """`audio/l16;rate=16000` -> ("audio/l16", 16000); the rate None when not given as a number."""
    kind, _, rest = value.partition(";")
    return kind.strip().lower(), number(rest.strip().removeprefix("rate="))


def whole_samples(data: bytes, what: str = "L16 audio") -> bytes:
    """16-bit audio, refused (1007) unless it holds whole samples."""
    if len(data) % 2:
        raise ProtocolError(f"{what} must hold whole 2-byte samples", CLOSE_INVALID_DATA)
    return bytes(data)


def binary_l16(raw: Mapping[str, Any], started: bool, before: str) -> CallerMedia | None:
    """A binary frame of the caller's L16 audio (carriers that send audio raw: Vonage, jambonz);
    None when the message is text. `before` is the error for audio before the stream started."""
    data = raw.get("bytes")
    if raw.get("text") is not None or data is None:
        return None
    if not started:
        raise ProtocolError(before)
    return CallerMedia(whole_samples(data))


class JsonStreamWire:
    """The receiving half of a Twilio-style JSON stream: `start` once and first (a `connected`
    greeting aside), then only messages of that stream (`stream_key` names it), `media`, `mark`,
    `dtmf` and `stop` as the call's events. A carrier's wire names its keys, reads its own
    `start` (setting `stream_id`), formats what we send, and overrides `event` or
    `caller_media` where its protocol differs."""

    stream_key: ClassVar[str]  # the stream's id on each message ("streamSid", "stream_id", …)
    hello: ClassVar[str | None] = "connected"  # a greeting with nothing in it (None: the carrier sends none)
    stream_key_required: ClassVar[bool] = False  # True: a message that does not name the stream is refused

    def __init__(self) -> None:
        self.stream_id = ""

    def parse(self, raw: Mapping[str, Any]) -> StreamEvent | None:
        message = self.read(raw)
        event = message["event"]
        if event == self.hello:
            return None
        if event == "start":
            if self.stream_id:
                raise ProtocolError("a second `start` on one stream")
            return self.start(message)
        if not self.stream_id:
            if event == "stop":
                return StreamStop()  # the caller hung up while the stream was connecting
            raise ProtocolError(f"`{event}` before `start`")
        named = message.get(self.stream_key)
        if named != self.stream_id and (named is not None or self.stream_key_required):
            raise ProtocolError(f"`{event}` for another stream ({named!r})")
        return self.event(event, message)

    def read(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        return json_message(raw)

    def start(self, message: dict[str, Any]) -> StreamStart:
        """The `start` message as the call's StreamStart; sets `stream_id`."""
        raise NotImplementedError

    def event(self, event: str, message: dict[str, Any]) -> StreamEvent | None:
        if event == "media":
            return self.caller_media(section(message, "media"))
        if event == "mark":
            name = section(message, "mark").get("name")
            return MarkPlayed(name) if isinstance(name, str) else None
        if event == "dtmf":
            return Digit(self.dtmf_key(section(message, "dtmf")))
        if event == "stop":
            return StreamStop()
        return None  # anything new

    def caller_media(self, media: dict[str, Any]) -> CallerMedia | None:
        if media.get("track", "inbound") not in CALLER_TRACKS:
            return None  # only the caller's audio goes to the agent
        return CallerMedia(b64_payload(media), number(media.get("chunk")))

    def dtmf_key(self, dtmf: dict[str, Any]) -> str:
        return digit(dtmf.get("digit"))
