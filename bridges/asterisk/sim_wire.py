"""Asterisk's two media protocols as its side speaks them, for the simulators (sim.py,
simulate.py), written from Asterisk's documentation and not from the bridge's wire modules
(audiosocket.py, media_ws.py), which they test.

AudioSocket (docs.asterisk.org, "AudioSocket"; the protocol's README at
github.com/CyCoreSystems/audiosocket): every message is one byte of kind, a 16-bit big-endian
payload length, the payload. Kinds: 0x00 hangup, 0x01 the call's UUID (16 bytes, first), 0x03 a
DTMF key (one ASCII byte), 0x10 16-bit signed linear PCM, little-endian, mono, 8 kHz, and, in
Asterisk's numbering of its newer builds, 0x11 12 kHz, 0x12 16 kHz, 0x13 24 kHz, 0x14 32 kHz,
0x15 44.1 kHz, 0x16 48 kHz, 0x17 96 kHz, 0x18 192 kHz; 0xff an error (a code byte).

chan_websocket (docs.asterisk.org, "WebSocket channel driver"): media in binary frames, control
in text frames, plain text (`MEDIA_START connection_id:… format:slin16 …`, `DTMF_END digit:5`,
`MEDIA_MARK_PROCESSED 12`; commands `MARK_MEDIA 12`, `FLUSH_MEDIA`, `HANGUP`) or JSON
(`{"event": "MEDIA_START", …}`; commands `{"command": "MARK_MEDIA", "correlation_id": "12"}`),
the subprotocol `media`, format names `ulaw`, `alaw`, `slin`, `slin12` … `slin48`.
"""

from __future__ import annotations

import json
import struct
import uuid
from typing import Any

# --- AudioSocket ---------------------------------------------------------------------------------

KIND_HANGUP, KIND_UUID, KIND_DTMF, KIND_SLIN, KIND_ERROR = 0x00, 0x01, 0x03, 0x10, 0xFF
RATE_KINDS = {
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
HEADER = struct.Struct(">BH")


class FrameError(ValueError):
    """Bytes that are not an AudioSocket message."""


def frame(kind: int, payload: bytes = b"") -> bytes:
    if len(payload) > 0xFFFF:
        raise FrameError(f"a payload of {len(payload)} bytes does not fit the 16-bit length")
    return HEADER.pack(kind, len(payload)) + payload


HANGUP = frame(KIND_HANGUP)


def uuid_frame(value: str) -> bytes:
    return frame(KIND_UUID, uuid.UUID(value).bytes)


def is_audio(kind: int) -> bool:
    return kind in RATE_KINDS


# --- chan_websocket ----------------------------------------------------------------------------------

PLAIN, JSON = "plain-text", "json"
SUBPROTOCOL = "media"
FORMATS = {
    "ulaw": ("pcmu", 8000),
    "alaw": ("pcma", 8000),
    "slin": ("l16", 8000),
    "slin12": ("l16", 12000),
    "slin16": ("l16", 16000),
    "slin24": ("l16", 24000),
    "slin32": ("l16", 32000),
    "slin44": ("l16", 44100),
    "slin48": ("l16", 48000),
}


def event(name: str, control: str, **fields: Any) -> str:
    """An event as Asterisk writes it in the configured control format."""
    if control == JSON:
        return json.dumps({"event": name, **fields})
    if name == "MEDIA_MARK_PROCESSED":  # plain text: the mark's id is a bare word
        return f"{name} {fields.get('correlation_id', '')}".strip()
    return " ".join(
        [name, *(f"{key}:{value}" for key, value in fields.items() if not isinstance(value, dict))]
    )


def read_command(text: str, control: str) -> tuple[str, str]:
    """(command, its mark id) of a command sent to Asterisk."""
    if control == JSON:
        data = json.loads(text)
        return str(data.get("command", "")), str(data.get("correlation_id") or "")
    name, _, rest = text.strip().partition(" ")
    return name, rest.strip()
