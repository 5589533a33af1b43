"""The AudioSocket wire format (Asterisk's `AudioSocket()` application and `AudioSocket/` channel
driver), as Asterisk documents and ships it. Imports nothing of ours: bytes in, bytes out.

Every message is a 3-byte header, one byte of *kind* and a big-endian 16-bit payload length,
then the payload:

| kind        | payload                                                        | sent by            |
| ----------- | -------------------------------------------------------------- | ------------------ |
| `0x00`      | none: hang up (closing the socket does the same)               | either side        |
| `0x01`      | the call's UUID, 16 bytes                                      | Asterisk, first    |
| `0x03`      | one DTMF digit, ASCII                                          | Asterisk           |
| `0x10`      | signed linear 16-bit little-endian mono audio, 8 kHz           | both               |
| `0x11-0x18` | the same at the rate of the kind (below)                       | both (newer builds) |
| `0xff`      | an error; its optional payload is an error code                | Asterisk           |

The rate kinds came with Asterisk's "message types for all slin sample rates" change. Two
numberings of them have shipped: Asterisk's own (0x11 12 kHz, 0x12 16 kHz, 0x13 24 kHz, 0x14
32 kHz, 0x15 44.1 kHz, 0x16 48 kHz, 0x17 96 kHz, 0x18 192 kHz) and the first proposal's, where
0x11 is 16 kHz (the AudioSocket Go library and early builds). Only 0x11 differs: a 20 ms (or
10 ms) message is 480 (240) bytes at 12 kHz and 640 (320) at 16 kHz, so its length tells them
apart; `resolve_0x11` decides, and says which numbering that is.
"""

from __future__ import annotations

import struct
import uuid
from dataclasses import dataclass

KIND_HANGUP = 0x00
KIND_UUID = 0x01
KIND_DTMF = 0x03
KIND_SLIN = 0x10  # 8 kHz
KIND_ERROR = 0xFF
HEADER = struct.Struct(">BH")
MAX_PAYLOAD = 0xFFFF

# Asterisk's numbering of the rate kinds (what its res_audiosocket sends and accepts).
ASTERISK_RATES = {
    0x10: 8000,
    0x11: 12000,
    0x12: 16000,
    0x13: 24000,
    0x14: 32000,
    0x15: 44100,
    0x16: 48000,
    0x17: 96000,
    0x18: 192000,
}
FIRST_0X11_RATE = 16000  # the first proposal's 0x11
NUMBERING_ASTERISK = "asterisk (0x11 12 kHz, 0x12 16 kHz, 0x13 24 kHz, ...)"
NUMBERING_FIRST = "first proposal (0x11 16 kHz)"

# Asterisk's own error codes in an 0xff message's payload.
ERRORS = {0x01: "the calling party hung up", 0x02: "frame forwarding error", 0x04: "memory error"}
DTMF_DIGITS = frozenset(b"0123456789*#ABCD")


class FrameError(ValueError):
    """Bytes that are not an AudioSocket message."""


@dataclass(frozen=True)
class Message:
    kind: int
    payload: bytes


def encode(kind: int, payload: bytes = b"") -> bytes:
    if len(payload) > MAX_PAYLOAD:
        raise FrameError(f"payload of {len(payload)} bytes does not fit a 16-bit length")
    return HEADER.pack(kind, len(payload)) + payload


HANGUP = encode(KIND_HANGUP)


def header(data: bytes) -> tuple[int, int]:
    """(kind, payload length) of a 3-byte header."""
    if len(data) != HEADER.size:
        raise FrameError("an AudioSocket header is 3 bytes")
    return HEADER.unpack(data)


def decode_all(data: bytes) -> tuple[list[Message], bytes]:
    """Every whole message at the start of `data`, and the bytes left over (a partial one)."""
    messages, at = [], 0
    while len(data) - at >= HEADER.size:
        kind, length = HEADER.unpack_from(data, at)
        end = at + HEADER.size + length
        if end > len(data):
            break
        messages.append(Message(kind, bytes(data[at + HEADER.size : end])))
        at = end
    return messages, bytes(data[at:])


def uuid_message(value: str | uuid.UUID) -> bytes:
    return encode(KIND_UUID, uuid.UUID(str(value)).bytes)


def parse_uuid(payload: bytes) -> str:
    if len(payload) != 16:
        raise FrameError(f"a UUID message holds 16 bytes, not {len(payload)}")
    return str(uuid.UUID(bytes=payload))


def parse_dtmf(payload: bytes) -> str:
    if len(payload) != 1 or payload[0] not in DTMF_DIGITS:
        raise FrameError(f"a DTMF message holds one of 0-9 * # A-D, not {payload[:8]!r}")
    return chr(payload[0])


def describe_error(payload: bytes) -> str:
    if not payload:
        return "error (no code)"
    code = payload[0]
    return f"error 0x{code:02x} ({ERRORS.get(code, 'application-specific')})"


def is_audio(kind: int) -> bool:
    return kind in ASTERISK_RATES


def fits(length: int, rate: int) -> bool:
    """`length` bytes are a whole number of 10 ms at `rate` (how Asterisk frames audio)."""
    per_10ms = rate // 100 * 2
    return length > 0 and length % per_10ms == 0


def resolve_0x11(length: int) -> tuple[int, str]:
    """The rate of a 0x11 message of `length` bytes, and which numbering that means. A length
    that fits both (960 bytes: 30 ms at 16 kHz or 40 ms at 12 kHz) is read Asterisk's way."""
    if fits(length, FIRST_0X11_RATE) and not fits(length, ASTERISK_RATES[0x11]):
        return FIRST_0X11_RATE, NUMBERING_FIRST
    return ASTERISK_RATES[0x11], NUMBERING_ASTERISK


def audio_rate(kind: int, length: int, rate_0x11: int | None = None) -> tuple[int, str]:
    """(rate, numbering) of an audio kind; `rate_0x11` forces the reading of 0x11."""
    if kind == 0x11:
        if rate_0x11 is not None:
            numbering = NUMBERING_FIRST if rate_0x11 == FIRST_0X11_RATE else NUMBERING_ASTERISK
            return rate_0x11, numbering
        return resolve_0x11(length)
    if kind == KIND_SLIN:
        return ASTERISK_RATES[kind], "the original (0x10 8 kHz)"
    return ASTERISK_RATES[kind], NUMBERING_ASTERISK
