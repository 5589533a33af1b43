"""Asterisk's two media streams as the phone call's events: AudioSocket and chan_websocket.

Each wire is built for one stream by the carrier once it knows which of our calls the stream
belongs to (its UUID), so the events carry our call id, not Asterisk's ids for the media leg.
The byte formats themselves are audiosocket.py and media_ws.py.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from personaplex_phone import carrier as phone
from personaplex_phone.carrier import (
    CLOSE_INVALID_DATA,
    AudioFormat,
    CallerMedia,
    Digit,
    FlowControl,
    MarkPlayed,
    ProtocolError,
    StreamStart,
    StreamStop,
)

from . import audiosocket as asock
from . import media_ws
from .tickets import AsteriskTicket

log = logging.getLogger(__name__)


def _start(entry: AsteriskTicket, stream_id: str, fmt: AudioFormat) -> StreamStart:
    params = {"persona": entry.persona} if entry.persona else {}
    return StreamStart(stream_id, entry.call_id, fmt, fmt, params=params)


class AudioSocketWire:
    """One AudioSocket connection. Its messages come from the link as `{"kind": k, "bytes": payload}`;
    ours go out as whole AudioSocket messages (bytes).

    The stream starts at the first audio message: only that says the rate (Asterisk's
    application sends 8 kHz, the channel driver the rate of its `c(...)` codec). Our audio goes
    back in the same kind, at the same rate. Asterisk plays what we send the moment it arrives (it
    has no jitter buffer), so there is nothing to clear and no mark: the playout sends each 20 ms
    at its time and a barge-in stops sending."""

    plays_on_arrival = True

    def __init__(self, entry: AsteriskTicket, rate_0x11: int | None = None):
        self.entry = entry
        self.rate_0x11 = rate_0x11
        self.uuid = ""
        self.kind = 0
        self.format: AudioFormat | None = None
        self.numbering = ""
        self.error = ""  # Asterisk's error message, when it sent one

    def parse(self, message: Mapping[str, Any]) -> phone.StreamEvent | None:
        kind = message.get("kind")
        payload = message.get("bytes") or b""
        try:
            return self._parse(kind, payload)
        except asock.FrameError as exc:
            raise ProtocolError(str(exc), CLOSE_INVALID_DATA) from None

    def _parse(self, kind: Any, payload: bytes) -> phone.StreamEvent | None:
        if kind == asock.KIND_UUID:
            if self.uuid:
                raise ProtocolError("a second UUID on one AudioSocket connection")
            self.uuid = asock.parse_uuid(payload)
            return None
        if not self.uuid:
            raise ProtocolError("AudioSocket messages before the UUID")
        if kind == asock.KIND_HANGUP:
            return StreamStop()
        if kind == asock.KIND_ERROR:
            self.error = asock.describe_error(payload)
            # 0x01 is the caller hanging up: the end of a call, not a fault.
            level = logging.INFO if payload[:1] == b"\x01" else logging.WARNING
            log.log(level, "asterisk audiosocket %s: Asterisk reports %s", self.uuid, self.error)
            return StreamStop()
        if kind == asock.KIND_DTMF:
            digit = asock.parse_dtmf(payload)
            return Digit(digit) if self.format is not None else None
        if not isinstance(kind, int) or not asock.is_audio(kind):
            raise ProtocolError(f"unknown AudioSocket message kind {kind!r}")
        if not payload or len(payload) % 2:
            raise ProtocolError(f"AudioSocket audio of {len(payload)} bytes (whole 16-bit samples only)")
        if self.format is None:
            rate, self.numbering = asock.audio_rate(kind, len(payload), self.rate_0x11)
            if rate > 48000:
                raise ProtocolError(f"AudioSocket audio at {rate} Hz: use 8 to 48 kHz (e.g. c(slin16))")
            self.kind, self.format = kind, AudioFormat("l16", rate)
            log.info(
                "asterisk audiosocket %s: audio kind 0x%02x = %d Hz (numbering: %s)",
                self.uuid,
                kind,
                rate,
                self.numbering,
            )
            return _start(self.entry, self.uuid, self.format)
        if kind != self.kind:
            raise ProtocolError(f"AudioSocket audio kind changed from 0x{self.kind:02x} to 0x{kind:02x}")
        return CallerMedia(payload)

    def media(self, payload: bytes) -> bytes:
        return asock.encode(self.kind, payload)

    def mark(self, name: str) -> None:
        return None

    def clear(self) -> None:
        return None


class MediaWebSocketWire:
    """One chan_websocket media WebSocket: TEXT events (plain text or JSON, answered in kind),
    BINARY media in the channel's format."""

    def __init__(self, entry: AsteriskTicket):
        self.entry = entry
        self.format = media_ws.PLAIN  # the control format, as MEDIA_START came
        self.audio: AudioFormat | None = None
        self.optimal_frame_size = 0
        self.stream_id = ""

    def parse(self, message: Mapping[str, Any]) -> phone.StreamEvent | None:
        text = message.get("text")
        if text is None:
            if self.audio is None:
                raise ProtocolError("media before MEDIA_START")
            data = message.get("bytes") or b""
            return CallerMedia(data) if data else None
        try:
            event = media_ws.parse_event(text)
        except media_ws.MessageError as exc:
            raise ProtocolError(str(exc), CLOSE_INVALID_DATA) from None
        name = event.name
        if name == "MEDIA_START":
            return self._start(event)
        if name == "DTMF_END":
            digit = str(event.fields.get("digit", ""))
            if len(digit) != 1 or digit not in "0123456789*#ABCD":
                raise ProtocolError(f"DTMF_END with digit {digit[:8]!r}", CLOSE_INVALID_DATA)
            return Digit(digit)
        if name == "MEDIA_MARK_PROCESSED":
            mark = media_ws.correlation_id(event)
            return MarkPlayed(mark) if mark else None
        if name in ("MEDIA_XOFF", "MEDIA_XON"):
            return FlowControl(paused=name == "MEDIA_XOFF")
        if name in ("HANGUP", "MEDIA_END"):
            return StreamStop()
        if name == "ERROR":
            log.warning(
                "asterisk media %s: Asterisk reports %s", self.stream_id, event.fields or event.argument
            )
        return None  # STATUS, QUEUE_DRAINED, MEDIA_BUFFERING_COMPLETED, and events to come

    def _start(self, event: media_ws.Event) -> StreamStart:
        if self.audio is not None:
            raise ProtocolError("a second MEDIA_START on one stream")
        name = str(event.fields.get("format", ""))
        found = media_ws.FORMATS.get(name)
        if found is None:
            known = ", ".join(media_ws.FORMATS)
            raise ProtocolError(
                f"chan_websocket format {name!r} is not taken: dial with c(slin16) (or one of {known})",
                CLOSE_INVALID_DATA,
            )
        codec, rate = found
        self.format = event.format
        self.audio = AudioFormat(codec, rate)  # type: ignore[arg-type]
        self.optimal_frame_size = media_ws.optimal_frame_size(event)
        self.stream_id = str(event.fields.get("channel_id") or event.fields.get("connection_id") or "")
        if self.optimal_frame_size and self.audio.chunk_bytes % self.optimal_frame_size:
            log.warning(
                "asterisk media %s: our %d-byte messages are not whole frames of %d bytes",
                self.stream_id,
                self.audio.chunk_bytes,
                self.optimal_frame_size,
            )
        return _start(self.entry, self.stream_id or self.entry.uuid, self.audio)

    def media(self, payload: bytes) -> bytes:
        return payload

    def mark(self, name: str) -> str:
        return media_ws.command("MARK_MEDIA", self.format, name)

    def clear(self) -> str:
        return media_ws.command("FLUSH_MEDIA", self.format)

    def hangup(self) -> str:
        return media_ws.command("HANGUP", self.format)
