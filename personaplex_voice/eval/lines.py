"""Lines: the audio path between a scenario's caller and the engine, one entry per codec.

A line turns the caller's 80 ms frames (24 kHz) into what crosses it and what the engine then
gets (`uplink`), and the agent's frames into what the caller hears (`downlink`), each with its
own streaming state, exactly as a transport does. What crosses the line is what a call's
recording holds and what the measures listen to. Adding a carrier's codec is one `register`
call with a factory for its `LineCodec`.

| line       | rate   | path                                                                       |
| ---------- | ------ | -------------------------------------------------------------------------- |
| `wideband` | 24 kHz | none: the engine's own audio (an in-process pipeline, the reference)        |
| `browser`  | 24 kHz | Ogg-Opus both ways, the `/api/chat` codec of the browser client            |
| phone      | 8-24 kHz | the phone call's own audio path, in a carrier's formats                  |

The phone lines (`PHONE_LINES` below) are named by carrier (`twilio`, `telnyx`, `plivo`,
`vonage`, `exotel`, `asterisk`, `jambonz`, `genesys`: its default formats) and by codec
(`pcmu-8k`, `pcma-8k`, `l16-8k`, `l16-16k`, `l16-24k`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from personaplex_voice.audio.resample import BlockResampler
from personaplex_voice.engine.base import FRAME_SIZE, SAMPLE_RATE

from . import phone


class LineCodec(Protocol):
    def uplink(self, caller: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One caller frame (24 kHz float32) -> (on the line at the line's rate, what the engine
        gets: exactly FRAME_SIZE samples at 24 kHz)."""

    def downlink(self, agent: np.ndarray) -> np.ndarray:
        """One agent frame (24 kHz) -> what the caller hears, one frame's worth at the line's rate."""


@dataclass(frozen=True)
class Line:
    name: str
    rate: int  # Hz of what crosses the line (recordings and measures use it)
    summary: str
    open: Callable[[], LineCodec]  # a fresh codec (fresh streaming state) per call


LINES: dict[str, Line] = {}


def register(line: Line) -> None:
    """Add a line (a carrier's codec) under its name; a second registration replaces the first."""
    LINES[line.name] = line


def get_line(name: str) -> Line:
    try:
        return LINES[name]
    except KeyError:
        raise ValueError(f"unknown line {name!r}; lines: {', '.join(LINES)}") from None


class Reframer:
    """Hands on exactly `size` samples per call from a stream whose pieces may come short at
    first (a codec's start-up delay) or unevenly: the missing start is silence, so the codec's
    delay shows as delay, never as lost audio."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._held = np.zeros(0, np.float32)

    def take(self, pcm: np.ndarray) -> np.ndarray:
        held = np.concatenate([self._held, np.asarray(pcm, np.float32)])
        if len(held) < self.size:
            held = np.concatenate([np.zeros(self.size - len(held), np.float32), held])
        self._held = held[self.size :]
        return held[: self.size]


class WidebandCodec:
    def uplink(self, caller: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        frame = np.asarray(caller, np.float32).copy()
        return frame, frame

    def downlink(self, agent: np.ndarray) -> np.ndarray:
        return np.asarray(agent, np.float32).copy()


class PhoneCodec:
    """A phone line: the caller's phone encodes its audio in the carrier's inbound format; the
    phone call's `InboundAudio` turns it into the engine's 24 kHz and its `OutboundAudio` turns
    the agent into the carrier's payloads in the outbound format, which the caller's phone
    decodes. The same code a call runs, in the same formats.

    The line's rate is the caller's (inbound) one. Where the carrier takes our audio at another
    rate (Telnyx: L16 16 kHz out, the caller on a PCMU 8 kHz leg), the caller still hears it at
    the line's rate: what crosses the line, recordings and measures all share one rate."""

    def __init__(self, inbound: phone.AudioFormat, outbound: phone.AudioFormat) -> None:
        self._phone_mic = BlockResampler(SAMPLE_RATE, inbound.rate) if inbound.rate != SAMPLE_RATE else None
        self._mic_codec = phone.codec_for(inbound)
        self._ear_codec = phone.codec_for(outbound)
        self._inbound = phone.InboundAudio(inbound)
        self._outbound = phone.OutboundAudio(outbound)
        self._to_engine = Reframer(FRAME_SIZE)
        self._to_line = BlockResampler(outbound.rate, inbound.rate) if outbound.rate != inbound.rate else None
        self._heard = Reframer(FRAME_SIZE * inbound.rate // SAMPLE_RATE)

    def uplink(self, caller: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        pcm = np.asarray(caller, np.float32)
        at_rate = self._phone_mic.process(pcm) if self._phone_mic is not None else pcm
        payload = self._mic_codec.encode(at_rate)
        return self._mic_codec.decode(payload), self._to_engine.take(self._inbound.convert(payload))

    def downlink(self, agent: np.ndarray) -> np.ndarray:
        payloads = self._outbound.convert(np.asarray(agent, np.float32))
        heard = self._ear_codec.decode(b"".join(payloads))
        if self._to_line is not None:
            heard = self._to_line.process(heard)
        return self._heard.take(heard)


class BrowserCodec:
    """Ogg-Opus at 24 kHz both ways, 20 ms packets, as the browser client and /api/chat use."""

    def __init__(self) -> None:
        from personaplex_voice.audio.opus import OggOpusReader, OggOpusWriter

        self._up = (OggOpusWriter(SAMPLE_RATE, frame_ms=20), OggOpusReader(SAMPLE_RATE))
        self._down = (OggOpusWriter(SAMPLE_RATE, frame_ms=20), OggOpusReader(SAMPLE_RATE))
        self._to_engine = Reframer(FRAME_SIZE)
        self._heard = Reframer(FRAME_SIZE)

    @staticmethod
    def _cross(ends: tuple, pcm: np.ndarray) -> np.ndarray:
        writer, reader = ends
        pieces = reader.feed(writer.write(np.asarray(pcm, np.float32)))
        return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)

    def uplink(self, caller: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        frame = self._to_engine.take(self._cross(self._up, caller))
        return frame, frame

    def downlink(self, agent: np.ndarray) -> np.ndarray:
        return self._heard.take(self._cross(self._down, agent))


def _phone_line(name: str, inbound: phone.AudioFormat, outbound: phone.AudioFormat, what: str) -> Line:
    summary = f"{inbound.describe()} in, {outbound.describe()} out: {what}"
    return Line(name, inbound.rate, summary, lambda: PhoneCodec(inbound, outbound))


_PCMU_8K = phone.AudioFormat("pcmu", 8000)
_PCMA_8K = phone.AudioFormat("pcma", 8000)
_L16_8K = phone.AudioFormat("l16", 8000)
_L16_16K = phone.AudioFormat("l16", 16000)
_L16_16K_BE = phone.AudioFormat("l16", 16000, big_endian=True)
_L16_24K = phone.AudioFormat("l16", 24000)

# name -> (caller's format, agent's format, what carries it); the carriers' defaults (docs/phone.md).
PHONE_LINES = {
    "twilio": (_PCMU_8K, _PCMU_8K, "a Twilio call"),
    "telnyx": (_PCMU_8K, _L16_16K_BE, "a Telnyx call on the phone network, our audio wideband"),
    "plivo": (_L16_16K, _L16_16K, "a Plivo wideband stream"),
    "vonage": (_L16_16K, _L16_16K, "a Vonage WebSocket call"),
    "exotel": (_L16_8K, _L16_8K, "an Exotel voicebot stream"),
    "asterisk": (_L16_16K, _L16_16K, "Asterisk AudioSocket or chan_websocket at slin16"),
    "jambonz": (_L16_24K, _L16_24K, "a jambonz listen at 24 kHz"),
    "genesys": (_PCMU_8K, _PCMU_8K, "a Genesys Audio Connector session"),
    "pcmu-8k": (_PCMU_8K, _PCMU_8K, "μ-law both ways"),
    "pcma-8k": (_PCMA_8K, _PCMA_8K, "A-law both ways"),
    "l16-8k": (_L16_8K, _L16_8K, "narrowband linear both ways"),
    "l16-16k": (_L16_16K, _L16_16K, "wideband linear both ways"),
    "l16-24k": (_L16_24K, _L16_24K, "linear at the model's own rate"),
}

register(Line("wideband", SAMPLE_RATE, "24 kHz, no codec (in-process)", WidebandCodec))
register(
    Line("browser", SAMPLE_RATE, "Ogg-Opus 24 kHz both ways, the browser's /api/chat codec", BrowserCodec)
)
for _name, (_inbound, _outbound, _what) in PHONE_LINES.items():
    register(_phone_line(_name, _inbound, _outbound, _what))
