"""The `/api/chat` wire protocol, shared by the server and by clients (the Pipecat remote service).

Every WebSocket message is binary; its first byte is the kind, the rest the payload. The kinds
and their payloads are those of the PersonaPlex / Moshi web clients:

| kind | name      | payload                                | direction        |
| ---- | --------- | -------------------------------------- | ---------------- |
| 0x00 | handshake | version byte, model byte (both 0)      | server → client  |
| 0x01 | audio     | Ogg-Opus pages, 24 kHz mono            | both             |
| 0x02 | text      | UTF-8 text piece                       | server → client  |
| 0x03 | control   | one action byte (start, endTurn, ...)  | client → server  |
| 0x04 | metadata  | UTF-8 JSON object                      | server → client  |
| 0x05 | error     | UTF-8 message, sent before a close     | server → client  |
| 0x06 | ping      | empty                                  | both             |

Receivers ignore kinds they do not know. This module knows no sockets and no engine: it turns
bytes into `Message`s and query strings into `ChatParams`, and back.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Any
from urllib.parse import urlencode

from personaplex_voice.engine.base import Persona, PersonaError, Sampling

PROTOCOL_VERSION = 0
MODEL_ID = 0


class Kind(IntEnum):
    HANDSHAKE = 0x00
    AUDIO = 0x01
    TEXT = 0x02
    CONTROL = 0x03
    METADATA = 0x04
    ERROR = 0x05
    PING = 0x06


class Control(IntEnum):
    START = 0x00
    END_TURN = 0x01
    PAUSE = 0x02
    RESTART = 0x03


@dataclass(frozen=True)
class Message:
    kind: int  # a `Kind` value, or any other byte (to be ignored)
    payload: bytes

    @property
    def known(self) -> bool:
        return self.kind in Kind._value2member_map_

    def text(self) -> str:
        return self.payload.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.payload.decode("utf-8"))


def decode(data: bytes | bytearray | memoryview) -> Message | None:
    """Split a binary message into kind and payload; None for an empty message."""
    data = bytes(data)
    if not data:
        return None
    return Message(kind=data[0], payload=data[1:])


def encode(kind: int, payload: bytes = b"") -> bytes:
    return bytes((kind,)) + payload


def encode_handshake(version: int = PROTOCOL_VERSION, model: int = MODEL_ID) -> bytes:
    return bytes((Kind.HANDSHAKE, version, model))


def encode_audio(ogg_pages: bytes) -> bytes:
    return encode(Kind.AUDIO, ogg_pages)


def encode_text(piece: str) -> bytes:
    return encode(Kind.TEXT, piece.encode("utf-8"))


def encode_control(action: Control | int) -> bytes:
    return bytes((Kind.CONTROL, int(action)))


def encode_metadata(data: Mapping[str, Any]) -> bytes:
    return encode(Kind.METADATA, json.dumps(data, separators=(",", ":")).encode("utf-8"))


def encode_error(message: str) -> bytes:
    return encode(Kind.ERROR, message.encode("utf-8"))


def encode_ping() -> bytes:
    return bytes((Kind.PING,))


# ---------------------------------------------------------------------------------------------
# Query parameters


class QueryError(ValueError):
    """A query parameter of /api/chat has a value the server cannot use; the message says which."""


# A voice is a plain file name inside the server's voice directories: no separators, no `..`.
_VOICE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")
_SEED_MAX = 2**63 - 1


@dataclass(frozen=True)
class ChatParams:
    """What a client may choose per session through the /api/chat query string.

    Unknown parameters (the reference client also sends `pad_mult`, `text_seed`, ...) are ignored.
    `seed` -1 or absent means a random seed.
    """

    text_prompt: str = ""
    voice_prompt: str | None = None
    seed: int | None = None
    text_temperature: float | None = None
    text_topk: int | None = None
    audio_temperature: float | None = None
    audio_topk: int | None = None
    greedy: bool = False

    @classmethod
    def from_query(cls, query: Mapping[str, str], *, max_prompt_chars: int = 4000) -> ChatParams:
        text_prompt = query.get("text_prompt", "") or ""
        if len(text_prompt) > max_prompt_chars:
            raise QueryError(
                f"text_prompt is too long ({len(text_prompt)} characters, at most {max_prompt_chars})"
            )
        if "\x00" in text_prompt:
            raise QueryError("text_prompt must not contain NUL characters")
        voice = (query.get("voice_prompt") or "").strip() or None
        if voice is not None and (not _VOICE_NAME.match(voice) or ".." in voice):
            raise QueryError(f"voice_prompt must be a voice name from /api/voices, got {voice[:80]!r}")
        seed = _int(query, "seed", -1, _SEED_MAX)
        params = cls(
            text_prompt=text_prompt,
            voice_prompt=voice,
            seed=None if seed is None or seed == -1 else seed,
            text_temperature=_float(query, "text_temperature"),
            text_topk=_int(query, "text_topk", 1, 100_000),
            audio_temperature=_float(query, "audio_temperature"),
            audio_topk=_int(query, "audio_topk", 1, 100_000),
            greedy=_bool(query, "greedy"),
        )
        params.sampling()  # range checks live in Sampling; surface them as query errors
        return params

    def sampling(self) -> Sampling:
        defaults = Sampling()
        try:
            return Sampling(
                text_temperature=_pick(self.text_temperature, defaults.text_temperature),
                text_topk=_pick(self.text_topk, defaults.text_topk),
                audio_temperature=_pick(self.audio_temperature, defaults.audio_temperature),
                audio_topk=_pick(self.audio_topk, defaults.audio_topk),
                greedy=self.greedy,
            )
        except PersonaError as exc:
            raise QueryError(str(exc)) from None

    def persona(self) -> Persona:
        return Persona(
            text_prompt=self.text_prompt, voice=self.voice_prompt, sampling=self.sampling(), seed=self.seed
        )

    @classmethod
    def from_persona(cls, persona: Persona) -> ChatParams:
        """The inverse of `persona()`: what a remote client sends to get this persona."""
        sampling = persona.sampling
        return cls(
            text_prompt=persona.text_prompt,
            voice_prompt=persona.voice,
            seed=persona.seed,
            text_temperature=sampling.text_temperature,
            text_topk=sampling.text_topk,
            audio_temperature=sampling.audio_temperature,
            audio_topk=sampling.audio_topk,
            greedy=sampling.greedy,
        )

    def to_query(self) -> dict[str, str]:
        """The query parameters a client sends (only the ones that are set)."""
        out: dict[str, str] = {"text_prompt": self.text_prompt}
        if self.voice_prompt:
            out["voice_prompt"] = self.voice_prompt
        if self.seed is not None:
            out["seed"] = str(self.seed)
        for name in ("text_temperature", "text_topk", "audio_temperature", "audio_topk"):
            value = getattr(self, name)
            if value is not None:
                out[name] = str(value)
        if self.greedy:
            out["greedy"] = "1"
        return out

    def url(self, base: str, **extra: str) -> str:
        """`base` (ws://host:port/api/chat) with these parameters (and e.g. token=...) appended."""
        sep = "&" if "?" in base else "?"
        return base + sep + urlencode({**self.to_query(), **extra})


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


def _float(query: Mapping[str, str], name: str) -> float | None:
    raw = query.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        raise QueryError(f"{name} must be a number, got {raw[:40]!r}") from None
    if not math.isfinite(value):
        raise QueryError(f"{name} must be a finite number, got {raw[:40]!r}")
    return value


def _int(query: Mapping[str, str], name: str, low: int, high: int) -> int | None:
    raw = query.get(name)
    if raw is None or raw == "":
        return None
    try:
        # Browsers' Number.toString gives "25" but some clients send "25.0": accept whole floats.
        value = int(raw) if re.fullmatch(r"[+-]?\d{1,20}", raw) else _whole_float(raw)
    except ValueError:
        raise QueryError(f"{name} must be an integer, got {raw[:40]!r}") from None
    if not low <= value <= high:
        raise QueryError(f"{name} must be between {low} and {high}, got {value}")
    return value


def _whole_float(raw: str) -> int:
    value = float(raw)
    if not math.isfinite(value) or value != int(value):
        raise ValueError(raw)
    return int(value)


def _bool(query: Mapping[str, str], name: str) -> bool:
    raw = (query.get(name) or "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise QueryError(f"{name} must be true or false, got {raw[:40]!r}")
