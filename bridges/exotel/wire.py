"""Exotel's Voicebot (bidirectional) stream: its WebSocket messages, both ways.

Exotel sends JSON text: `connected`; `start` (`stream_sid` at the top and in `start`;
`start.call_sid`, `from`, `to`, `custom_parameters` (the query of the stream URL), `media_format`
{encoding, sample_rate, bit_rate}); `media` (`media.payload` base64, `chunk`, `timestamp`);
`dtmf` (`dtmf.digit`); `mark` (echo of ours, once the audio before it has played); `stop`. We
send `media`, `mark` and `clear`, each with the `stream_sid`.

Exotel's published examples do not agree on spellings, and Exotel's own sample server reads
`start` leniently, so this wire does too: the stream id is `stream_sid` or `streamSid`, at the top
or in `start`, or absent (Exotel's AgentStream protocol notes show a `start` without one: our
messages then carry none); the call is `call_sid` or `callSid`; the encoding is whatever names
16-bit linear PCM (`raw`, `audio/x-raw`, `slin`, `linear16`, `audio/L16`, and `base64`, which
names the transport, not the audio); μ-law spellings give μ-law 8 kHz (the Beta extension's
`audio/x-mulaw`); the rate is `sample_rate` as a number or a string, else the rate our URL
asked for. Only an encoding we cannot decode is refused.

Audio: raw 16-bit signed PCM, **little-endian** (`slin`), mono, at the stream's rate (8000 by
default; 16000 or 24000 with `?sample-rate=` on the stream URL), both ways.

Our media messages follow Exotel's chunk rule (developer.exotel.com/docs/agentstream/
stream-voicebot-applet, "Chunk Size Requirements"): at least 3.2 KB, at most 100 KB, a multiple of
320 bytes (smaller ones risk distortion, others leave gaps): `message_ms(rate)` is the shortest
message that fits it, 200 ms at 8 kHz, 100 ms at 16 kHz, 80 ms at 24 kHz.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from personaplex_phone import wire_json as j
from personaplex_phone.carrier import (
    CLOSE_INVALID_DATA,
    AudioFormat,
    CallerMedia,
    ProtocolError,
    StreamStart,
)

log = logging.getLogger(__name__)

RATES = (8000, 16000, 24000)
MIN_CHUNK_BYTES = 3200
CHUNK_MULTIPLE_BYTES = 320
MAX_CHUNK_BYTES = 100_000
_LINEAR = {"raw", "audio/x-raw", "slin", "slin16", "pcm", "linear16", "audio/l16", "audio/x-l16", "l16"}
_LINEAR |= {"base64", "raw/slin", "pcm16", "s16le"}
_MULAW = {"audio/x-mulaw", "audio/mulaw", "mulaw", "ulaw", "pcmu", "audio/pcmu"}
_UNDECODABLE = {"opus", "audio/opus", "g722", "audio/g722", "amr-wb", "mp3", "audio/mpeg"}


def message_ms(rate: int) -> int:
    """The shortest whole-ms message of 16-bit audio at `rate` that Exotel's chunk rule takes."""
    ms = 1
    while True:
        samples = rate * ms / 1000
        size = int(samples) * 2
        if samples.is_integer() and size >= MIN_CHUNK_BYTES and size % CHUNK_MULTIPLE_BYTES == 0:
            return ms
        ms += 1


def audio_format(encoding: str, rate: int | None, default_rate: int = 8000) -> AudioFormat:
    """The caller's audio as `media_format` names it (see the module docstring)."""
    name = encoding.strip().lower()
    kind = name.partition(";")[0].strip()
    if kind in _MULAW:
        return AudioFormat("pcmu", 8000)
    if kind in _UNDECODABLE:
        raise ProtocolError(f"Exotel audio {encoding!r} cannot be decoded here", CLOSE_INVALID_DATA)
    if kind and kind not in _LINEAR:
        log.warning("exotel: media_format encoding %r taken for 16-bit PCM, as Exotel streams", encoding[:40])
    rate = rate if rate is not None else default_rate
    if rate not in RATES:
        raise ProtocolError(
            f"Exotel audio at {rate} Hz is not supported here (8000, 16000, 24000)", CLOSE_INVALID_DATA
        )
    return AudioFormat("l16", rate, big_endian=False, message_ms=message_ms(rate))


def _first_text(*values: Any) -> str:
    return next((v for v in values if isinstance(v, str) and v), "")


class ExotelWire(j.JsonStreamWire):
    stream_key = "stream_sid"

    def __init__(self, default_rate: int = 8000) -> None:
        super().__init__()
        self.default_rate = default_rate  # the rate our stream URL asked for
        self._sid = ""  # the stream id as our messages carry it (JSON), "" when Exotel gave none

    def read(self, raw: Any) -> dict[str, Any]:
        message = super().read(raw)
        if "stream_sid" not in message and isinstance(message.get("streamSid"), str):
            message["stream_sid"] = message["streamSid"]  # the camel-case spelling
        if self.stream_id and not self._sid:
            message.pop("stream_sid", None)  # a stream that started without an id: nothing to match
        return message

    def caller_media(self, media: dict[str, Any]) -> CallerMedia | None:
        if media.get("track", "inbound") not in j.CALLER_TRACKS:
            return None  # the Beta extension's `both` tracks: only the caller's goes to the agent
        return CallerMedia(j.whole_samples(j.b64_payload(media), "PCM audio"), j.number(media.get("chunk")))

    def start(self, message: dict[str, Any]) -> StreamStart:
        start = j.section(message, "start")
        stream_sid = _first_text(
            message.get("stream_sid"),
            start.get("stream_sid"),
            message.get("streamSid"),
            start.get("streamSid"),
        )
        call_sid = _first_text(start.get("call_sid"), start.get("callSid"), message.get("call_sid"))
        if not call_sid:
            raise ProtocolError("`start` without call_sid", CLOSE_INVALID_DATA)
        media_format = start.get("media_format") or start.get("mediaFormat") or {}
        if not isinstance(media_format, dict):
            raise ProtocolError("`media_format` must be an object", CLOSE_INVALID_DATA)
        given_rate = media_format.get("sample_rate", media_format.get("sampleRate"))
        rate = j.number(given_rate)
        if given_rate is not None and rate is None:
            # Absent: the rate our stream URL asked for. Present but unreadable: not Exotel's.
            raise ProtocolError(f"`sample_rate` {str(given_rate)[:20]!r} is not a rate", CLOSE_INVALID_DATA)
        inbound = audio_format(str(media_format.get("encoding", "raw")), rate, self.default_rate)
        outbound = audio_format("raw", inbound.rate)  # we answer in linear PCM at the same rate
        # Messages of a stream without an id are that stream's too (nothing names another).
        self.stream_id = stream_sid or call_sid
        self._sid = json.dumps(stream_sid) if stream_sid else ""
        params = j.string_map(start.get("custom_parameters") or start.get("customParameters"))
        account = _first_text(start.get("account_sid"), start.get("accountSid"))
        return StreamStart(self.stream_id, call_sid, inbound, outbound, params=params, account=account)

    def _head(self, event: str) -> str:
        return '{"event":"' + event + '"' + (',"stream_sid":' + self._sid if self._sid else "")

    def media(self, payload: bytes) -> str:
        return self._head("media") + ',"media":{"payload":"' + j.b64(payload) + '"}}'

    def mark(self, name: str) -> str:
        return self._head("mark") + ',"mark":' + j.dumps({"name": name}) + "}"

    def clear(self) -> str:
        return self._head("clear") + "}"
