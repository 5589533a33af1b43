"""Telnyx media streaming (bidirectional `rtp` mode): its WebSocket messages, both ways.

Telnyx sends JSON text: `connected`; `start` (top-level `stream_id`; `start.call_control_id`,
`start.media_format` {encoding, sample_rate, channels}, `start.custom_parameters` from our
`<Parameter>`s); `media` (`media.payload`: base64 of the RTP payload, no RTP header; `track`,
`chunk`, `timestamp`); `mark` (echo of ours, once the audio before it has played); `dtmf`
(`dtmf.digit`); `error`; `stop`. We send `media` (20 ms of RTP payload in the stream's
bidirectional codec), `mark` and `clear`.

Codecs: the caller's audio comes in the codec our `<Stream codec>` asked for (PCMU, or PCMA), as
`media_format` says; Telnyx falls back to the call's own codec where it cannot transcode (it
transcodes between PCMU and PCMA only), and L16 comes where a Call Control stream asked for it.
L16 here is RTP's: **big-endian** (network byte order, RFC 3551 §4.5.11), both ways. A stream
that still comes in G.722, Opus or AMR-WB (an HD leg Telnyx would not transcode) is refused with
a clear error: we have no decoder for them.
"""

from __future__ import annotations

import logging
from typing import Any

from personaplex_phone import wire_json as j
from personaplex_phone.carrier import (
    CLOSE_INVALID_DATA,
    AudioFormat,
    ProtocolError,
    StreamEvent,
    StreamStart,
)

log = logging.getLogger(__name__)

CALL_ID_PARAMETER = "call_id"  # ours: the TeXML CallSid our answer was for (see carrier.py)
_CODECS = {"PCMU": "pcmu", "PCMA": "pcma", "L16": "l16"}


def audio_format(codec: str, rate: int) -> AudioFormat:
    """A Telnyx codec name and rate as the call's audio format (L16 big-endian: RTP's)."""
    name = _CODECS.get(codec.upper())
    if name is None:
        raise ProtocolError(
            f"Telnyx streamed {codec!r}, which we cannot decode (PCMU, PCMA or L16): the call's "
            "leg is in a codec Telnyx does not transcode to the PCMU our <Stream codec> asked for",
            CLOSE_INVALID_DATA,
        )
    if name != "l16" and rate != 8000:
        raise ProtocolError(f"{codec} at {rate} Hz: G.711 is 8 kHz", CLOSE_INVALID_DATA)
    if rate not in (8000, 16000):
        raise ProtocolError(
            f"sample rate {rate} Hz is not supported here (8000 or 16000)", CLOSE_INVALID_DATA
        )
    return AudioFormat(name, rate, big_endian=name == "l16")  # type: ignore[arg-type]


class TelnyxWire(j.JsonStreamWire):
    stream_key = "stream_id"

    def __init__(self, outbound: AudioFormat):
        super().__init__()
        self.outbound = outbound

    def event(self, event: str, message: dict[str, Any]) -> StreamEvent | None:
        if event == "error":
            log.warning(
                "telnyx %s: the stream reports an error: %s",
                self.stream_id,
                str(message.get("payload"))[:300],
            )
            return None
        return super().event(event, message)

    def start(self, message: dict[str, Any]) -> StreamStart:
        start = j.section(message, "start")
        stream_id = message.get("stream_id") or start.get("stream_id")
        control_id = start.get("call_control_id")
        if (
            not isinstance(stream_id, str)
            or not stream_id
            or not isinstance(control_id, str)
            or not control_id
        ):
            raise ProtocolError("`start` without stream_id/call_control_id", CLOSE_INVALID_DATA)
        fmt = start.get("media_format") or {}
        if not isinstance(fmt, dict):
            raise ProtocolError("`media_format` must be an object", CLOSE_INVALID_DATA)
        rate = j.number(fmt.get("sample_rate", 8000))
        inbound = audio_format(str(fmt.get("encoding", "PCMU")), rate or 0)
        params = j.string_map(start.get("custom_parameters") or start.get("customParameters"))
        call_id = params.pop(CALL_ID_PARAMETER, "") or control_id
        self.stream_id = stream_id
        return StreamStart(stream_id, call_id, inbound, self.outbound, params=params, control_id=control_id)

    def media(self, payload: bytes) -> str:
        return '{"event":"media","media":{"payload":"' + j.b64(payload) + '"}}'

    def mark(self, name: str) -> str:
        return j.dumps({"event": "mark", "mark": {"name": name}})

    def clear(self) -> str:
        return '{"event":"clear"}'
