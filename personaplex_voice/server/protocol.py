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

from personaplex_voice import untrusted
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
        """The payload as JSON (a peer's: bounded, untrusted.loads; InputRefused is a ValueError)."""
        return untrusted.loads(self.payload)


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
_HALF_SEED_MAX = 2**31 - 1  # text_seed and audio_seed each fill one half of the seed
_INTEGER = re.compile(r"[+-]?\d{1,4000}")  # int() refuses more digits than 4300


@dataclass(frozen=True)
class ChatParams:
    """What a client may choose per session through the /api/chat query string.

    Unknown parameters (the reference client also sends `pad_mult`, `repetition_penalty`, ...)
    are ignored. `seed` -1 or absent means a random seed. The reference client sends no `seed`
    but a `text_seed` and an `audio_seed`; our engine has one seed per session, so without `seed`
    they become `text_seed * 2**32 + audio_seed` (each 0..2**31-1; -1 or absent counts as 0, and
    both -1 or absent means random): the same pair always gives the same session.
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
    def from_query(
        cls, query: Mapping[str, str], *, max_prompt_chars: int = 4000, text_prompt: str | None = None
    ) -> ChatParams:
        """`text_prompt`, when given, replaces the query's (a prompt the client stored with
        POST /api/prompts and named by `prompt_id`)."""
        if text_prompt is None:
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
        params = cls(
            text_prompt=text_prompt,
            voice_prompt=voice,
            seed=_seed(query),
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
        raise QueryError(f"{name} must be a number, got {_shown(raw)}") from None
    if not math.isfinite(value):
        raise QueryError(f"{name} must be a finite number, got {_shown(raw)}")
    return value


def _int(query: Mapping[str, str], name: str, low: int, high: int) -> int | None:
    raw = query.get(name)
    if raw is None or raw == "":
        return None
    shown = _shown(raw)
    try:
        # Browsers' Number.toString gives "25" but some clients send "25.0": accept whole floats.
        value = int(raw) if _INTEGER.fullmatch(raw) else _whole_float(raw)
    except ValueError:
        raise QueryError(f"{name} must be an integer, got {shown}") from None
    if not low <= value <= high:
        # The client's own text, not `value`: "1e30" or 30 nines must come back as written.
        raise QueryError(f"{name} must be between {low} and {high}, got {shown}")
    return value


def _seed(query: Mapping[str, str]) -> int | None:
    """`seed`, else the reference client's `text_seed` / `audio_seed` pair (see ChatParams)."""
    if query.get("seed") not in (None, ""):
        seed = _int(query, "seed", -1, _SEED_MAX)
        return None if seed == -1 else seed
    halves = [_int(query, name, -1, _HALF_SEED_MAX) for name in ("text_seed", "audio_seed")]
    if all(h is None or h == -1 for h in halves):
        return None
    text_seed, audio_seed = (0 if h is None or h == -1 else h for h in halves)
    return text_seed << 32 | audio_seed


def _shown(raw: str, limit: int = 60) -> str:
    """A client's value for an error message: exact, or cut with a note when very long."""
    return raw if len(raw) <= limit else f"{raw[:limit]}... ({len(raw)} characters)"


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
    raise QueryError(f"{name} must be true or false, got {_shown(raw)}")
