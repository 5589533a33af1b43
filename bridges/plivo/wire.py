"""Plivo's bidirectional audio stream: its WebSocket messages, both ways.

Plivo sends JSON text: `start` (`start.callId`, `start.streamId`, `start.mediaFormat`
{encoding, sampleRate}; `extra_headers`, our `extraHeaders` as a string of `key=value` pairs,
`;`-separated in Plivo's published example, `,` in its XML attribute), `media` (`media.payload` base64,
`track`, `chunk`, `timestamp`), `dtmf` (`dtmf.digit`), `playedStream` (the answer to one of our
`checkpoint`s: everything before it has played), `clearedAudio` (the answer to `clearAudio`).
The stream ends when the socket closes (some accounts also send `stop`). We send `playAudio`
(20 ms of audio, base64, with its content type and rate), `checkpoint` (named) and `clearAudio`.

Audio: `audio/x-l16` is 16-bit linear PCM, **little-endian**, at the stream's `sampleRate` (8000
or 16000); `audio/x-mulaw` is μ-law at 8 kHz. Both directions use the stream's content type.
"""

from __future__ import annotations

import base64
import binascii
import json
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
    StreamStop,
)

from personaplex_voice import untrusted


def audio_format(content_type: str, rate: int | None = None) -> AudioFormat:
    """`audio/x-l16;rate=16000` (or an encoding and a separate rate) as the call's format."""
    kind, given = j.content_type_rate(content_type)
    if rate is None:
        rate = given or 8000
    if kind == "audio/x-l16" and rate in (8000, 16000):
        return AudioFormat("l16", rate, big_endian=False)
    if kind == "audio/x-mulaw" and rate == 8000:
        return AudioFormat("pcmu", 8000)
    raise ProtocolError(f"Plivo audio {kind or '?'} at {rate} Hz is not supported here", CLOSE_INVALID_DATA)


def content_type_of(fmt: AudioFormat) -> str:
    return "audio/x-mulaw" if fmt.codec == "pcmu" else "audio/x-l16"


ENCODED_MARK = ("ppenc", "b32")  # our answer's first pair: the other pairs are base32 (plivoxml)


def from_alphanumeric(token: str) -> str:
    """A key or value of our `extraHeaders` (plivoxml.alphanumeric) back to its text."""
    try:
        return base64.b32decode(token.upper() + "=" * (-len(token) % 8)).decode("utf-8")
    except (binascii.Error, ValueError):
        return token  # not ours after all: as it came


def extra_headers(value: Any) -> dict[str, str]:
    """Our `extraHeaders` as Plivo hands them back in `start`: `key=value` pairs separated by `;`
    (Plivo's published example) or `,` (the attribute's own form); base32 when the first pair is
    our mark, else as they are (headers written by hand). A JSON object is read too."""
    if isinstance(value, dict):
        return j.string_map(value)
    if not isinstance(value, str) or not value.strip():
        return {}
    if value.lstrip().startswith("{"):
        try:
            return j.string_map(untrusted.loads(value))
        except untrusted.InputRefused:
            return {}
    pairs = [
        (k.strip(), v.strip())
        for k, sep, v in (i.partition("=") for i in value.replace(";", ",").split(","))
        if sep and k.strip()
    ]
    if pairs and pairs[0] == ENCODED_MARK:
        return {from_alphanumeric(k): from_alphanumeric(v) for k, v in pairs[1:]}
    return dict(pairs)


class PlivoWire(j.JsonStreamWire):
    stream_key = "streamId"
    hello = None  # Plivo starts with `start`

    def __init__(self) -> None:
        super().__init__()
        self.format = AudioFormat("l16", 16000)
        self._play_head = ""

    def event(self, event: str, message: dict[str, Any]) -> StreamEvent | None:
        if event == "media":
            return self.caller_media(j.section(message, "media"))
        if event == "playedStream":
            name = message.get("name")
            return MarkPlayed(name) if isinstance(name, str) else None
        if event == "dtmf":
            dtmf = message.get("dtmf")
            return Digit(j.digit(dtmf.get("digit") if isinstance(dtmf, dict) else message.get("digit")))
        if event == "stop":
            return StreamStop()
        return None  # clearedAudio and anything new

    def start(self, message: dict[str, Any]) -> StreamStart:
        start = j.section(message, "start")
        stream_id, call_id = start.get("streamId"), start.get("callId")
        if not isinstance(stream_id, str) or not stream_id or not isinstance(call_id, str) or not call_id:
            raise ProtocolError("`start` without streamId/callId", CLOSE_INVALID_DATA)
        media_format = start.get("mediaFormat") or {}
        if not isinstance(media_format, dict):
            raise ProtocolError("`mediaFormat` must be an object", CLOSE_INVALID_DATA)
        self.format = audio_format(
            str(media_format.get("encoding", "audio/x-l16")), j.number(media_format.get("sampleRate", 8000))
        )
        self.stream_id = stream_id
        self._play_head = (
            '{"event":"playAudio","streamId":'
            + json.dumps(stream_id)
            + ',"media":{"contentType":"'
            + content_type_of(self.format)
            + f'","sampleRate":{self.format.rate},"payload":"'
        )
        params = extra_headers(message.get("extra_headers", start.get("extra_headers")))
        return StreamStart(stream_id, call_id, self.format, self.format, params=params)

    def media(self, payload: bytes) -> str:
        return self._play_head + j.b64(payload) + '"}}'

    def mark(self, name: str) -> str:
        return j.dumps({"event": "checkpoint", "streamId": self.stream_id, "name": name})

    def clear(self) -> str:
        return j.dumps({"event": "clearAudio", "streamId": self.stream_id})
