"""The session protocol between front-ends and engine workers: message kinds, framing, codecs.

One stream connection (a Unix socket on one host, TCP across hosts; the same bytes on both)
carries every session a front-end holds on one engine worker. Each message is a 9-byte header,
then its body:

    <I body length> <B kind> <I channel>   (little endian)

`channel` numbers a session on the connection (chosen by the front-end; 0 for messages about the
connection itself). Bodies are JSON for the rare control messages and packed binary for audio,
which is float32 both ways so a run through the split is bit-identical to one in process.

Front-end → worker: HELLO (secret and who it is), OPEN (persona, optional ticket), AUDIO (one
80 ms frame), PIECES (the samples of the pieces its input comes in: `Session.expect_input_pieces`),
END_INPUT, CLOSE (reason), CREDIT (lossless flow control), RESERVE / CANCEL (tickets), PING.
Worker → front-end: WELCOME (what the worker is), STATUS (occupancy, saturation, cache, metrics;
also the heartbeat), OPENED, REFUSED (typed: capacity, saturated, persona, ticket, engine),
READY, FRAME, CLOSED (reason and error), RESERVED.

Nothing here knows asyncio, sockets or engines: `encode_*` build bytes, `MessageReader` splits
a byte stream into `(kind, channel, body)` and refuses oversize or unknown garbage.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import asdict
from typing import Any

import numpy as np

from personaplex_voice import untrusted
from personaplex_voice.engine.base import (
    FRAME_SIZE,
    CapacityError,
    EngineError,
    Persona,
    PersonaError,
    Sampling,
    SaturatedError,
)
from personaplex_voice.engine.scheduler import TicketError

PROTOCOL_VERSION = 2  # 2: PIECES
HEADER = struct.Struct("<IBI")
MAX_BODY = 4 << 20  # far above any real message (a frame is ~8 KiB, a persona a few KiB)
CONTROL_LIMITS = untrusted.JsonLimits(max_bytes=MAX_BODY)
FRAME_BYTES = FRAME_SIZE * 4  # float32 samples

_STAMPED_AUDIO = struct.Struct("<d")  # the sender's time.monotonic(), then float32 samples
# index, stamp (worker's time.monotonic() when it took the frame), tokens count (-1: none), text bytes
_FRAME_HEAD = struct.Struct("<IdhH")
_U32 = struct.Struct("<I")


class Kind(enum.IntEnum):
    # front-end -> worker
    HELLO = 1
    OPEN = 2
    AUDIO = 3
    END_INPUT = 4
    CLOSE = 5
    CREDIT = 6
    RESERVE = 7
    CANCEL = 8
    PING = 9
    PIECES = 10
    # worker -> front-end
    WELCOME = 32
    STATUS = 33
    OPENED = 34
    REFUSED = 35
    READY = 36
    FRAME = 37
    CLOSED = 38
    RESERVED = 39


class WireError(Exception):
    """The peer sent bytes that are not this protocol: the connection is closed."""


def message(kind: Kind, channel: int = 0, body: bytes = b"") -> bytes:
    return HEADER.pack(len(body), kind, channel) + body


def json_message(kind: Kind, channel: int, payload: dict[str, Any]) -> bytes:
    return message(kind, channel, json.dumps(payload, separators=(",", ":")).encode())


def parse_json(body: bytes) -> dict[str, Any]:
    # The bounded reader: a HELLO is read before its secret is checked.
    try:
        value = untrusted.loads(body, CONTROL_LIMITS)
    except untrusted.InputRefused as exc:
        raise WireError(f"a control message is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise WireError("a control message is not a JSON object")
    return value


# -- audio ------------------------------------------------------------------------------------


def audio_message(channel: int, pcm: np.ndarray, sent_at: float) -> bytes:
    """One input frame (float32 [FRAME_SIZE]) stamped with the sender's monotonic clock."""
    data = np.ascontiguousarray(pcm, dtype=np.float32)
    body = _STAMPED_AUDIO.pack(sent_at) + data.tobytes()
    return HEADER.pack(len(body), Kind.AUDIO, channel) + body


def parse_audio(body: bytes) -> tuple[np.ndarray, float]:
    if len(body) != _STAMPED_AUDIO.size + FRAME_BYTES:
        raise WireError(f"an audio message holds {len(body)} bytes, not one frame")
    (sent_at,) = _STAMPED_AUDIO.unpack_from(body)
    # A read-only view into `body` (a bytes object of its own): the session copies it on push.
    pcm = np.frombuffer(body, np.float32, count=FRAME_SIZE, offset=_STAMPED_AUDIO.size)
    return pcm, sent_at


def frame_message(
    channel: int, index: int, pcm: np.ndarray, text: str | None, tokens: np.ndarray | None, stamp: float
) -> bytes:
    """One output frame. `text` None and "" are both sent as no text (the engine's None)."""
    text_bytes = text.encode() if text else b""
    token_bytes = b"" if tokens is None else np.ascontiguousarray(tokens, np.int64).tobytes()
    n_tokens = -1 if tokens is None else len(token_bytes) // 8
    head = _FRAME_HEAD.pack(index, stamp, n_tokens, len(text_bytes))
    pcm_bytes = np.ascontiguousarray(pcm, np.float32).tobytes()
    body_len = len(head) + len(token_bytes) + len(text_bytes) + len(pcm_bytes)
    return b"".join((HEADER.pack(body_len, Kind.FRAME, channel), head, token_bytes, text_bytes, pcm_bytes))


def parse_frame(body: bytes) -> tuple[int, float, np.ndarray, str | None, np.ndarray | None]:
    """-> (index, stamp, pcm, text, tokens)."""
    if len(body) < _FRAME_HEAD.size:
        raise WireError("a frame message is too short")
    index, stamp, n_tokens, text_len = _FRAME_HEAD.unpack_from(body)
    has_tokens = n_tokens >= 0
    n_tokens = max(0, n_tokens)
    offset = _FRAME_HEAD.size
    if len(body) != offset + 8 * n_tokens + text_len + FRAME_BYTES:
        raise WireError("a frame message has the wrong length")
    tokens = np.frombuffer(body, np.int64, count=n_tokens, offset=offset).copy() if has_tokens else None
    offset += 8 * n_tokens
    text = body[offset : offset + text_len].decode("utf-8", "replace") if text_len else None
    offset += text_len
    pcm = np.frombuffer(body, np.float32, count=FRAME_SIZE, offset=offset).copy()
    return index, stamp, pcm, text, tokens


def pieces_message(channel: int, samples: int) -> bytes:
    return message(Kind.PIECES, channel, _U32.pack(max(0, min(samples, 0xFFFFFFFF))))


def parse_pieces(body: bytes) -> int:
    if len(body) != _U32.size:
        raise WireError("a pieces message is not 4 bytes")
    return _U32.unpack(body)[0]


def credit_message(channel: int, frames: int) -> bytes:
    return message(Kind.CREDIT, channel, _U32.pack(frames))


def parse_credit(body: bytes) -> int:
    if len(body) != _U32.size:
        raise WireError("a credit message is not 4 bytes")
    return _U32.unpack(body)[0]


# -- refusals ---------------------------------------------------------------------------------


def refusal(kind: str, message: str, retry_after_s: float | None = None) -> dict[str, Any]:
    """A REFUSED body: `kind` is capacity, saturated, persona, ticket or engine."""
    return {"kind": kind, "message": message, "retry_after_s": retry_after_s}


def refusal_of(error: EngineError) -> dict[str, Any]:
    """The REFUSED body for an error `open` raised (the inverse of `refusal_error`)."""
    retry = getattr(error, "retry_after_s", None)
    if isinstance(error, PersonaError):
        return refusal("persona", str(error))
    if isinstance(error, TicketError):
        return refusal("ticket", str(error), retry)
    if isinstance(error, SaturatedError):
        return refusal("saturated", str(error), retry)
    if isinstance(error, CapacityError):
        return refusal("capacity", str(error), retry)
    return refusal("engine", str(error))


def refusal_error(answer: dict[str, Any]) -> EngineError:
    """The typed error a REFUSED body stands for, as the embedded host would raise it."""
    kind, message = answer.get("kind"), str(answer.get("message") or "refused")
    retry = answer.get("retry_after_s")
    retry = float(retry) if isinstance(retry, int | float) else None
    if kind == "persona":
        return PersonaError(message)
    if kind == "ticket":
        return TicketError(message, retry_after_s=retry)
    if kind == "saturated":
        return SaturatedError(message, retry_after_s=retry)
    if kind == "capacity":
        return CapacityError(message, retry_after_s=retry)
    return EngineError(message)


# -- personas ---------------------------------------------------------------------------------

_SAMPLING_FIELDS = set(Sampling.__dataclass_fields__)


def persona_to_json(persona: Persona) -> dict[str, Any]:
    return {
        "text_prompt": persona.text_prompt,
        "voice": persona.voice,
        "seed": persona.seed,
        "sampling": asdict(persona.sampling),
    }


def persona_from_json(value: Any) -> Persona:
    """The inverse of `persona_to_json`; PersonaError for anything that is not a persona."""
    if not isinstance(value, dict):
        raise PersonaError("the persona is not an object")
    text_prompt, voice, seed = value.get("text_prompt", ""), value.get("voice"), value.get("seed")
    sampling = value.get("sampling") or {}
    if not isinstance(text_prompt, str) or not (voice is None or isinstance(voice, str)):
        raise PersonaError("text_prompt and voice must be strings")
    if not (seed is None or (isinstance(seed, int) and not isinstance(seed, bool))):
        raise PersonaError("seed must be an integer")
    if not isinstance(sampling, dict) or not set(sampling) <= _SAMPLING_FIELDS:
        raise PersonaError(f"sampling takes only {sorted(_SAMPLING_FIELDS)}")
    try:
        parsed = Sampling(**sampling)
    except TypeError as exc:
        raise PersonaError(f"bad sampling values: {exc}") from None
    return Persona(text_prompt=text_prompt, voice=voice, sampling=parsed, seed=seed)


# -- the byte stream --------------------------------------------------------------------------


class MessageReader:
    """Splits a stream into messages. `feed(data)` returns the complete ones as
    (kind, channel, body); a partial message waits for more bytes. Raises WireError for an
    oversize body or an unknown kind (the connection is not this protocol)."""

    def __init__(self, max_body: int = MAX_BODY):
        self._buffer = bytearray()
        self._max_body = max_body

    def feed(self, data: bytes) -> list[tuple[Kind, int, bytes]]:
        buffer = self._buffer
        buffer += data
        out: list[tuple[Kind, int, bytes]] = []
        start = 0
        size = HEADER.size
        while len(buffer) - start >= size:
            length, kind, channel = HEADER.unpack_from(buffer, start)
            if length > self._max_body:
                raise WireError(f"message of {length} bytes exceeds {self._max_body}")
            end = start + size + length
            if len(buffer) < end:
                break
            try:
                known = Kind(kind)
            except ValueError:
                raise WireError(f"unknown message kind {kind}") from None
            out.append((known, channel, bytes(buffer[start + size : end])))
            start = end
        if start:
            del buffer[:start]
        return out
