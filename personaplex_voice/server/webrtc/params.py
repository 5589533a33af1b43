"""A WebRTC call's persona, from the query string (both endpoints) or Pipecat's JSON `requestData`.

The names and checks are /api/chat's (`ChatParams`: text_prompt or prompt_id, voice_prompt, seed,
temperatures, top-k, greedy, token), so a call asks for the same persona the same way on either
transport. A JSON body may give the same names as JSON values (numbers and booleans included);
the query wins where both give one.

**Caller facts** fill `{name}` placeholders in the persona's prompt, as the phone call fills them
from a caller's data: `caller.NAME=value` in the query, or `"caller": {"NAME": "value"}` in the
JSON. At most 32 facts, names of letters, digits and `_`, values of at most 500 characters; a
placeholder without a fact stays as written, and the filled prompt must still fit the prompt limit.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from personaplex_voice.server.protocol import ChatParams, QueryError

__all__ = ["caller_facts", "fill_prompt", "merged_query"]

MAX_FACTS = 32
MAX_FACT_CHARS = 500
_FACT_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]{0,63})\}")
_CALLER_PREFIX = "caller."


def _as_text(name: str, value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int | float | str):
        return str(value)
    raise QueryError(f"{name} must be a string, a number or a boolean, got {type(value).__name__}")


def merged_query(query: Mapping[str, str], body: Mapping[str, Any] | None) -> dict[str, str]:
    """The query's values over the JSON body's (every value as the text a query would carry);
    the body's `caller` object stays out (see `caller_facts`)."""
    merged: dict[str, str] = {}
    for name, value in (body or {}).items():
        if name == "caller" or value is None:
            continue
        merged[str(name)] = _as_text(str(name), value)
    merged.update(query)
    return merged


def caller_facts(query: Mapping[str, str], body: Mapping[str, Any] | None) -> dict[str, str]:
    facts: dict[str, str] = {}
    raw = (body or {}).get("caller")
    if raw is not None:
        if not isinstance(raw, dict):
            raise QueryError('caller must be a JSON object of facts ({"name": "value"})')
        for name, value in raw.items():
            facts[str(name)] = _as_text(f"caller.{name}", value)
    for key, value in query.items():
        if key.startswith(_CALLER_PREFIX):
            facts[key[len(_CALLER_PREFIX) :]] = value
    if len(facts) > MAX_FACTS:
        raise QueryError(f"at most {MAX_FACTS} caller facts, got {len(facts)}")
    for name, value in facts.items():
        if not _FACT_NAME.match(name):
            raise QueryError(f"caller fact name {name[:70]!r}: letters, digits and _ only (at most 64)")
        if len(value) > MAX_FACT_CHARS or "\x00" in value:
            raise QueryError(f"caller fact {name!r} is over {MAX_FACT_CHARS} characters or holds a NUL")
    return facts


def fill_prompt(params: ChatParams, facts: Mapping[str, str], max_prompt_chars: int) -> ChatParams:
    if not facts:
        return params
    text = _PLACEHOLDER.sub(lambda m: facts.get(m.group(1), m.group(0)), params.text_prompt)
    if len(text) > max_prompt_chars:
        raise QueryError(
            f"text_prompt is too long once the caller facts are in ({len(text)} characters, "
            f"at most {max_prompt_chars})"
        )
    return dataclasses.replace(params, text_prompt=text)
