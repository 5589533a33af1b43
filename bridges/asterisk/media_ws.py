"""The chan_websocket media protocol (Asterisk 20.16, 21.11, 22.6, 23.0 and later), as Asterisk
documents it. Imports nothing of the phone call's (only the bounded JSON reader every peer's
input goes through): strings in, strings out.

Media travels in BINARY frames, raw in the channel's format (no headers). Control travels in
TEXT frames, events from Asterisk and commands to it, in one of two formats chosen in Asterisk's
configuration (`control_message_format` in chan_websocket.conf, or the dial string's `f(...)`):

- plain text, the original and still the default: `MEDIA_START connection_id:… channel:…
  channel_id:… format:slin16 optimal_frame_size:640 ptime:20`, `DTMF_END digit:5 channel_id:…`,
  `MEDIA_XOFF`, `MEDIA_MARK_PROCESSED 12`; commands `FLUSH_MEDIA`, `MARK_MEDIA 12`, `HANGUP`;
- JSON (20.18, 22.8, 23.2 and later): `{"event": "MEDIA_START", "connection_id": …, "format":
  "slin16", "optimal_frame_size": 640, "ptime": 20, "channel_variables": {…}}`; commands
  `{"command": "MARK_MEDIA", "correlation_id": "12"}`.

Asterisk reads our commands in its configured format only, so we answer in the format its
MEDIA_START came in. The events we use: MEDIA_START, DTMF_END, MEDIA_MARK_PROCESSED (a mark of
ours reached the front of its queue: what was before it is being heard), MEDIA_XOFF / MEDIA_XON
(its queue is nearly full: stop sending / go on), ERROR; the commands: MARK_MEDIA, FLUSH_MEDIA
(drop what is queued, marks included: their MEDIA_MARK_PROCESSED never comes), HANGUP.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from personaplex_voice import untrusted

PLAIN = "plain-text"
JSON = "json"
SUBPROTOCOL = "media"
MAX_TEXT = 8192  # an event is a line or a small object; MEDIA_START's channel variables the most
EVENT_LIMITS = untrusted.JsonLimits(max_bytes=MAX_TEXT, max_depth=8)
MAX_FRAME_SIZE = 1 << 16  # bytes: `optimal_frame_size` beyond this is no frame size at all

# Asterisk format names -> (codec, rate) as the phone call names them. Opus and the other
# codecs chan_websocket can only pass through (framed by the sender) are not taken.
FORMATS: dict[str, tuple[str, int]] = {
    "ulaw": ("pcmu", 8000),
    "alaw": ("pcma", 8000),
    "slin": ("l16", 8000),
    "slin12": ("l16", 12000),
    "slin16": ("l16", 16000),
    "slin24": ("l16", 24000),
    "slin32": ("l16", 32000),
    "slin44": ("l16", 44100),
    "slin48": ("l16", 48000),
}


class MessageError(ValueError):
    """A TEXT frame that is not a chan_websocket event."""


@dataclass(frozen=True)
class Event:
    name: str
    fields: dict[str, Any] = field(default_factory=dict)
    format: str = PLAIN
    argument: str = ""  # plain text: a bare word after the name (MEDIA_MARK_PROCESSED's id)


def parse_event(text: str) -> Event:
    """One TEXT frame from Asterisk, in either format."""
    if len(text) > MAX_TEXT:
        raise MessageError(f"an event of {len(text)} characters")
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            data = untrusted.loads(stripped, EVENT_LIMITS)
        except untrusted.InputRefused as exc:
            raise MessageError(f"an event refused: {exc}") from None
        name = data.get("event") if isinstance(data, dict) else None
        if not isinstance(name, str) or not name:
            raise MessageError("a JSON event without an `event` name")
        return Event(name, {k: v for k, v in data.items() if k != "event"}, JSON)
    words = stripped.split()
    if not words:
        raise MessageError("an empty event")
    fields: dict[str, Any] = {}
    bare: list[str] = []
    for word in words[1:]:
        key, sep, value = word.partition(":")
        if sep and key:
            fields[key] = value
        else:
            bare.append(word)
    return Event(words[0], fields, PLAIN, " ".join(bare))


def correlation_id(event: Event) -> str:
    """The id a MEDIA_MARK_PROCESSED (or MEDIA_BUFFERING_COMPLETED) carries, in either format."""
    value = event.fields.get("correlation_id", event.argument)
    return value if isinstance(value, str) else str(value)


def command(name: str, fmt: str, correlation: str | None = None) -> str:
    """A command in the format Asterisk expects (`fmt` as its MEDIA_START came)."""
    if fmt == JSON:
        body: dict[str, str] = {"command": name}
        if correlation is not None:
            body["correlation_id"] = correlation
        return json.dumps(body, separators=(",", ":"))
    return name if correlation is None else f"{name} {correlation}"


def event_text(name: str, fmt: str, **fields: Any) -> str:
    """An event as Asterisk writes it (for simulators and tests)."""
    if fmt == JSON:
        return json.dumps({"event": name, **fields}, separators=(",", ":"))
    if name == "MEDIA_MARK_PROCESSED":
        ident = fields.get("correlation_id", "")
        return f"{name} {ident}" if ident else name
    return " ".join([name, *(f"{k}:{v}" for k, v in fields.items() if not isinstance(v, dict))])


def parse_command(text: str, fmt: str) -> tuple[str, str]:
    """(name, correlation id) of one of our commands as Asterisk reads it (for simulators)."""
    if fmt == JSON:
        data = json.loads(text)
        return str(data.get("command", "")), str(data.get("correlation_id") or "")
    name, _, rest = text.strip().partition(" ")
    return name, rest


def optimal_frame_size(event: Event) -> int:
    """MEDIA_START's `optimal_frame_size` in bytes (a JSON integer or plain-text digits), 0 when
    absent or not a size (a float, a sign, other Unicode digits, beyond MAX_FRAME_SIZE)."""
    value = event.fields.get("optimal_frame_size", 0)
    if isinstance(value, str):
        try:
            value = untrusted.ascii_int(value, 6)
        except untrusted.InputRefused:
            return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_FRAME_SIZE:
        return 0
    return value
