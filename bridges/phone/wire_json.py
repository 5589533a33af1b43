"""Helpers for carriers whose stream messages are JSON text (Twilio-like protocols): reading one
message, its sections and fields, base64 payloads; each failure a ProtocolError with the close
code to end the stream with. Plain functions over dicts: no sockets, nothing of the call."""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from typing import Any

from .carrier import CLOSE_INVALID_DATA, ProtocolError

DTMF_KEYS = frozenset("0123456789*#ABCD")


def json_message(raw: Mapping[str, Any], event_key: str = "event") -> dict[str, Any]:
    """An ASGI websocket.receive message -> the JSON object it carries (with a str `event`)."""
    text = raw.get("text")
    if text is None:
        raise ProtocolError("binary frames are not part of this stream protocol", CLOSE_INVALID_DATA)
    return json_text(text, event_key)


def json_text(text: str, event_key: str = "event") -> dict[str, Any]:
    try:
        message = json.loads(text)
    except ValueError:
        raise ProtocolError("message is not valid JSON", CLOSE_INVALID_DATA) from None
    if not isinstance(message, dict) or not isinstance(message.get(event_key), str):
        raise ProtocolError(f"message is not a JSON object with an `{event_key}`", CLOSE_INVALID_DATA)
    return message


def section(message: Mapping[str, Any], key: str) -> dict[str, Any]:
    """The message's `key` object; a ProtocolError without one."""
    value = message.get(key)
    if not isinstance(value, dict):
        event = message.get("event", "message")
        raise ProtocolError(f"`{event}` message without a `{key}` object", CLOSE_INVALID_DATA)
    return value


def text_field(values: Mapping[str, Any], key: str, what: str) -> str:
    value = values.get(key)
    if not isinstance(value, str) or not value:
        raise ProtocolError(f"{what} without `{key}`", CLOSE_INVALID_DATA)
    return value


def number(value: Any) -> int | None:
    """A carrier's counter (a number, or a string of digits), or None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def b64_payload(values: Mapping[str, Any], key: str = "payload") -> bytes:
    payload = values.get(key)
    if not isinstance(payload, str):
        raise ProtocolError(f"media without a `{key}`", CLOSE_INVALID_DATA)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError("media payload is not valid base64", CLOSE_INVALID_DATA) from None


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def digit(value: Any) -> str:
    """One DTMF key, or a ProtocolError saying what came instead."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 9:
        value = str(value)
    if not isinstance(value, str) or len(value) != 1 or value not in DTMF_KEYS:
        given = "no digit" if value is None else f"{json.dumps(value)[:40]}"
        raise ProtocolError(f"a DTMF event needs one key (0-9 * # A-D), got {given}", CLOSE_INVALID_DATA)
    return value


def string_map(value: Any) -> dict[str, str]:
    """A carrier's custom parameters as plain strings (anything else: none)."""
    if not isinstance(value, dict):
        return {}
    return {str(k): str(v) for k, v in value.items() if isinstance(v, str | int | float)}


def dumps(message: Mapping[str, Any]) -> str:
    return json.dumps(message, separators=(",", ":"))
