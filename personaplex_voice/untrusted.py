"""Reading what a peer sent: JSON bounded in size, depth and numbers, and integers from text in
ASCII digits only. Every parser of input from outside (webhook bodies, media-stream messages,
signature headers and their times, JWT claims, control messages) goes through these, so that no
input can cost more than its size, recurse without bound, or carry a number that breaks the
arithmetic done with it later.

    value = loads(text)                      # InputRefused (a ValueError) for anything out of bounds
    message = loads_object(text, what="a media message")
    when = ascii_int(header, max_digits=12)  # "1700000000"; never "²", " 1", "+1", "1_0", "1" + 400 "0"

Why each bound:

- **size**: the parse is linear in its input; the limit is the caller's (a message, a body).
- **depth**: Python's JSON decoder recurses once per nested `[`/`{`; 50,000 of them raise a
  RecursionError (or, with a raised recursion limit, exhaust the C stack). Containers nest at
  most `max_depth` deep, checked before decoding at the cost of two `str.count` calls for any
  document with fewer brackets than that, and of one regular-expression pass otherwise.
- **numbers**: `NaN`, `Infinity` and `-Infinity` are not JSON (Python's decoder takes them), a
  float that overflows to infinity (`1e999`) breaks `int()`, and an integer of 400 digits breaks
  the first subtraction from a float (OverflowError). Integers are refused beyond signed 64 bits
  (their text is checked before it is converted), floats unless finite.

Everything refused raises `InputRefused` with a short reason meant for one log line: the
transport maps it to its refusal (HTTP 400, WebSocket close 1007).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "DEFAULT",
    "InputRefused",
    "JsonLimits",
    "ascii_int",
    "ascii_int_or_none",
    "finite_number",
    "loads",
    "loads_object",
    "nesting_depth",
]

INT64_MAX = 2**63 - 1


class InputRefused(ValueError):
    """Input from a peer that is malformed or out of bounds; the message says why (one line)."""


@dataclass(frozen=True)
class JsonLimits:
    max_bytes: int = 64 * 1024  # of the text (UTF-8 bytes when given bytes, characters when text)
    max_depth: int = 32  # containers inside containers
    max_number_chars: int = 40  # a number's text; integers also fit in signed 64 bits


DEFAULT = JsonLimits()

# A JSON string, its closing quote optional so that an unterminated one is consumed in one
# linear pass (a required quote makes the engine retry from every later quote: quadratic).
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_OPEN_ARRAY, _OPEN_OBJECT, _CLOSE_ARRAY, _CLOSE_OBJECT = (ord(c) for c in "[{]}")


def nesting_depth(text: str) -> int:
    """How deep containers nest in `text`, brackets inside strings not counted (an upper bound
    for malformed text, which the decoder refuses anyway)."""
    outside = _STRING.sub("", text).encode("utf-8", "replace")
    if not outside:
        return 0
    # The running count of open containers, vectorized: 64 KiB in well under 1 ms.
    codes = np.frombuffer(outside, np.uint8)
    opens = (codes == _OPEN_ARRAY) | (codes == _OPEN_OBJECT)
    closes = (codes == _CLOSE_ARRAY) | (codes == _CLOSE_OBJECT)
    return max(0, int(np.cumsum(opens.astype(np.int32) - closes).max()))


class _Decoder(json.JSONDecoder):
    """The standard decoder (its C scanner), with every number checked as it is read."""

    def __init__(self, limits: JsonLimits):
        self.limits = limits
        super().__init__(parse_int=self._int, parse_float=self._float, parse_constant=self._constant)

    def _int(self, text: str) -> int:
        if len(text) > self.limits.max_number_chars:
            raise InputRefused(f"a number of {len(text)} characters")
        value = int(text)
        if not -INT64_MAX - 1 <= value <= INT64_MAX:
            raise InputRefused("an integer beyond 64 bits")
        return value

    def _float(self, text: str) -> float:
        if len(text) > self.limits.max_number_chars:
            raise InputRefused(f"a number of {len(text)} characters")
        value = float(text)
        if not math.isfinite(value):
            raise InputRefused(f"a number out of range ({text[:20]})")
        return value

    @staticmethod
    def _constant(name: str) -> Any:
        raise InputRefused(f"{name} is not a JSON number")


_decoders: dict[JsonLimits, _Decoder] = {}


def _decoder(limits: JsonLimits) -> _Decoder:
    found = _decoders.get(limits)
    if found is None:
        found = _decoders[limits] = _Decoder(limits)
    return found


def loads(data: str | bytes | bytearray | memoryview, limits: JsonLimits = DEFAULT) -> Any:
    """The JSON value in `data` (bytes must be UTF-8), within `limits`; InputRefused otherwise."""
    if isinstance(data, str):
        if len(data) > limits.max_bytes:
            raise InputRefused(f"JSON of {len(data)} characters (at most {limits.max_bytes})")
        text = data
    else:
        if len(data) > limits.max_bytes:
            raise InputRefused(f"JSON of {len(data)} bytes (at most {limits.max_bytes})")
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError:
            raise InputRefused("JSON that is not UTF-8") from None
    if text.count("[") + text.count("{") > limits.max_depth:
        depth = nesting_depth(text)
        if depth > limits.max_depth:
            raise InputRefused(f"JSON nested {depth} deep (at most {limits.max_depth})")
    try:
        return _decoder(limits).decode(text)
    except InputRefused:
        raise
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise InputRefused(f"not valid JSON ({str(exc)[:80]})") from None


def loads_object(
    data: str | bytes | bytearray | memoryview, limits: JsonLimits = DEFAULT, what: str = "the body"
) -> dict[str, Any]:
    """`loads`, and the value must be a JSON object."""
    value = loads(data, limits)
    if not isinstance(value, dict):
        raise InputRefused(f"{what} is not a JSON object")
    return value


def ascii_int(text: str, max_digits: int = 18) -> int:
    """A non-negative integer written in 1 to `max_digits` ASCII digits, nothing else (no sign,
    space, underscore, or the other Unicode digits `str.isdigit` accepts); InputRefused otherwise."""
    if not 0 < len(text) <= max_digits or not (text.isascii() and text.isdigit()):
        shown = text if len(text) <= 24 else text[:24] + "…"
        raise InputRefused(f"{shown!r} is not a number of at most {max_digits} digits")
    return int(text)


def ascii_int_or_none(text: str, max_digits: int = 18) -> int | None:
    """`ascii_int`, or None where it refuses (an optional counter, a query parameter)."""
    try:
        return ascii_int(text, max_digits)
    except InputRefused:
        return None


def finite_number(value: Any, low: float, high: float) -> float | None:
    """`value` as a float when it is a JSON number (not a bool) within [low, high], else None
    (a decoded claim, a field of a message: checked before any arithmetic uses it)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, int) and not low <= value <= high:  # before float(): may be huge
        return None
    number = float(value)
    return number if math.isfinite(number) and low <= number <= high else None
