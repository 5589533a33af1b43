"""Lines: the audio path between a scenario's caller and the engine, one entry per codec.

A line turns the caller's 80 ms frames (24 kHz) into what crosses it and what the engine then
gets (`uplink`), and the agent's frames into what the caller hears (`downlink`), each with its
own streaming state, exactly as a transport does. What crosses the line is what a call's
recording holds and what the measures listen to. Adding a carrier's codec is one `register`
call with a factory for its `LineCodec`.

| line       | rate   | path                                                                       |
| ---------- | ------ | -------------------------------------------------------------------------- |
| `wideband` | 24 kHz | none: the engine's own audio (an in-process pipeline, the reference)        |
| `twilio`   | 8 kHz  | μ-law both ways, the phone call's audio path (`InboundAudio`, `OutboundAudio`) |
| `browser`  | 24 kHz | Ogg-Opus both ways, the `/api/chat` codec of the browser client            |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from personaplex_voice.audio.mulaw import ulaw_decode, ulaw_encode
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


class TwilioCodec:
    """The caller's phone sends μ-law at 8 kHz; the bridge's `InboundAudio` turns it into the
    engine's 24 kHz, its `OutboundAudio` turns the agent into the 20 ms μ-law payloads Twilio
    plays, which the caller's phone decodes."""

    def __init__(self) -> None:
        self._phone_mic = BlockResampler(SAMPLE_RATE, phone.TWILIO_RATE)
        self._inbound = phone.InboundAudio()
        self._outbound = phone.OutboundAudio()
        self._to_engine = Reframer(FRAME_SIZE)
        self._heard = Reframer(FRAME_SIZE * phone.TWILIO_RATE // SAMPLE_RATE)

    def uplink(self, caller: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ulaw = ulaw_encode(self._phone_mic.process(np.asarray(caller, np.float32)))
        return ulaw_decode(ulaw), self._to_engine.take(self._inbound.convert(ulaw))

    def downlink(self, agent: np.ndarray) -> np.ndarray:
        payloads = self._outbound.convert(np.asarray(agent, np.float32))
        return self._heard.take(ulaw_decode(b"".join(payloads)))


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


register(Line("wideband", SAMPLE_RATE, "24 kHz, no codec (in-process)", WidebandCodec))
register(
    Line("twilio", phone.TWILIO_RATE, "μ-law 8 kHz both ways, the Twilio call's audio path", TwilioCodec)
)
register(
    Line("browser", SAMPLE_RATE, "Ogg-Opus 24 kHz both ways, the browser's /api/chat codec", BrowserCodec)
)
