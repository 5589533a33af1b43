"""Exotel's Voicebot (bidirectional) stream: its WebSocket messages, both ways.

Exotel sends JSON text: `connected`; `start` (`stream_sid`; `start.call_sid`, `from`, `to`,
`custom_parameters` (the query of the stream URL), `media_format` {encoding `audio/x-raw`,
sample_rate, bit_rate 16}); `media` (`media.payload` base64, `chunk`, `timestamp`); `dtmf`
(`dtmf.digit`); `mark` (echo of ours, once the audio before it has played); `stop`. We send
`media` (base64, 20 ms: a multiple of 320 bytes, as Exotel asks), `mark` and `clear`, each with
the `stream_sid`.

Audio: raw 16-bit signed PCM, **little-endian** (`slin`), mono, at the stream's rate (8000 by
default; 16000 with `?sample-rate=16000` on the stream URL), both ways.
"""

from __future__ import annotations

import json
from typing import Any

from personaplex_phone import wire_json as j
from personaplex_phone.carrier import (
    CLOSE_INVALID_DATA,
    AudioFormat,
    CallerMedia,
    ProtocolError,
    StreamStart,
)

_RAW = {"audio/x-raw", "raw", "slin", "pcm", "audio/x-l16", "audio/l16", "linear16"}


def audio_format(encoding: str, rate: int | None) -> AudioFormat:
    if encoding.lower() not in _RAW or rate not in (8000, 16000):
        raise ProtocolError(
            f"Exotel audio {encoding!r} at {rate} Hz is not supported here", CLOSE_INVALID_DATA
        )
    return AudioFormat("l16", rate, big_endian=False)


class ExotelWire(j.JsonStreamWire):
    stream_key = "stream_sid"

    def __init__(self) -> None:
        super().__init__()
        self._sid = ""

    def caller_media(self, media: dict[str, Any]) -> CallerMedia:
        return CallerMedia(j.whole_samples(j.b64_payload(media), "PCM audio"), j.number(media.get("chunk")))

    def start(self, message: dict[str, Any]) -> StreamStart:
        start = j.section(message, "start")
        stream_sid = message.get("stream_sid") or start.get("stream_sid")
        call_sid = start.get("call_sid")
        if not isinstance(stream_sid, str) or not stream_sid or not isinstance(call_sid, str) or not call_sid:
            raise ProtocolError("`start` without stream_sid/call_sid", CLOSE_INVALID_DATA)
        media_format = start.get("media_format") or {}
        if not isinstance(media_format, dict):
            raise ProtocolError("`media_format` must be an object", CLOSE_INVALID_DATA)
        fmt = audio_format(
            str(media_format.get("encoding", "audio/x-raw")), j.number(media_format.get("sample_rate", 8000))
        )
        self.stream_id = stream_sid
        self._sid = json.dumps(stream_sid)
        params = j.string_map(start.get("custom_parameters"))
        return StreamStart(
            stream_sid, call_sid, fmt, fmt, params=params, account=str(start.get("account_sid") or "")
        )

    def media(self, payload: bytes) -> str:
        return '{"event":"media","stream_sid":' + self._sid + ',"media":{"payload":"' + j.b64(payload) + '"}}'

    def mark(self, name: str) -> str:
        return j.dumps({"event": "mark", "stream_sid": self.stream_id, "mark": {"name": name}})

    def clear(self) -> str:
        return '{"event":"clear","stream_sid":' + self._sid + "}"
