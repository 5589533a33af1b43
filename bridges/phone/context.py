"""Per-call context: a persona's prompt template and the values each call fills it with.

A `text_prompt` may hold `{name}` fields. `{{` and `}}` are a literal brace. Every field is either
one of the call's own facts, always known (`{From}`, `{To}`, `{CallSid}`: Twilio's names, used
for every carrier; `{CallSid}` is the carrier's call id), or declared under the persona's
`variables:` with its default; anything else is refused when the personas file loads, so no
caller ever hears a raw `{customer_name}`.

Values for a call, later sources winning (only declared variables are taken from any of them):
1. the declared defaults;
2. the query parameters of the answer webhook URL (the user's own flow or `<Redirect>` adds
   them; the carrier signs the whole URL, so they are as trusted as the call);
3. the persona's `context_url`, when it has one: a POST of the call's facts, a JSON object back
   within `context_timeout_s`; on any failure the values so far are used and the failure logged.
"""

from __future__ import annotations

import json
import logging
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass

from .http_out import HttpOut

log = logging.getLogger(__name__)

CALL_FACTS = ("From", "To", "CallSid")  # always defined, never overridden
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
MAX_VALUE_CHARS = 400  # one value in a prompt; the engine bounds the whole prompt
_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")


class TemplateError(ValueError):
    """A prompt template that cannot be used (bad syntax, undeclared or malformed fields)."""


@dataclass(frozen=True)
class PromptTemplate:
    """A parsed prompt: literal text and field names in order (None = literal piece)."""

    pieces: tuple[tuple[str, str | None], ...]

    @classmethod
    def parse(cls, text: str) -> PromptTemplate:
        pieces: list[tuple[str, str | None]] = []
        try:
            parsed = list(string.Formatter().parse(text))
        except ValueError as exc:  # a lone `{` or `}`
            raise TemplateError(f"bad template ({exc}; write {{{{ and }}}} for literal braces)") from None
        for literal, field, spec, conversion in parsed:
            if literal:
                pieces.append((literal, None))
            if field is None:
                continue
            if not _IDENT.match(field) or spec or conversion:
                written = field + ("!" + conversion if conversion else "") + (":" + spec if spec else "")
                raise TemplateError(
                    f"bad field {{{written}}} (fields are plain names like {{customer_name}}; "
                    "write {{ and }} for literal braces)"
                )
            pieces.append(("", field))
        return cls(tuple(pieces))

    @property
    def fields(self) -> frozenset[str]:
        return frozenset(field for _, field in self.pieces if field is not None)

    def render(self, values: Mapping[str, str]) -> str:
        """The prompt with every field replaced (a missing value renders empty; `check` at load
        time makes sure there is none)."""
        return "".join(literal if field is None else values.get(field, "") for literal, field in self.pieces)

    def check(self, declared: Mapping[str, str]) -> None:
        undeclared = sorted(self.fields - set(declared) - set(CALL_FACTS))
        if undeclared:
            names = ", ".join("{" + name + "}" for name in undeclared)
            raise TemplateError(
                f"text_prompt uses {names} but `variables:` does not declare "
                f"{'it' if len(undeclared) == 1 else 'them'} (declare each with its default)"
            )


def clean_value(value: object) -> str | None:
    """A value as it may enter a prompt: text on one line, bounded; None for non-scalars."""
    if isinstance(value, bool):
        value = "yes" if value else "no"
    if not isinstance(value, str | int | float):
        return None
    text = _CONTROL.sub(" ", str(value)).strip()
    return text[:MAX_VALUE_CHARS]


def pick_declared(source: Mapping[str, object], declared: Mapping[str, str]) -> dict[str, str]:
    """The declared variables present in `source`, cleaned (everything else is ignored)."""
    picked: dict[str, str] = {}
    for name in declared:
        if name in source:
            value = clean_value(source[name])
            if value is not None:
                picked[name] = value
    return picked


def facts_body(facts: Mapping[str, object]) -> bytes:
    return json.dumps(facts, separators=(",", ":")).encode()


async def fetch_context(
    http: HttpOut, url: str, body: bytes, timeout_s: float, headers: Mapping[str, str]
) -> dict[str, object]:
    """POST the call's facts (`body`, JSON) to `url`; the JSON object it answers (or its
    `variables` member), or {} (logged) on a timeout, an error status or anything but an object."""
    try:
        status, answer = await http.post(url, body, headers, timeout_s, max_answer_bytes=64 * 1024)
    except Exception as exc:  # timeouts and connection errors alike: the call goes on with defaults
        log.warning("phone: context_url %s failed (%s): using the defaults", url, type(exc).__name__)
        return {}
    if not 200 <= status < 300:
        log.warning("phone: context_url %s answered %d: using the defaults", url, status)
        return {}
    try:
        data = json.loads(answer)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        log.warning("phone: context_url %s did not answer a JSON object: using the defaults", url)
        return {}
    inner = data.get("variables")
    return inner if isinstance(inner, dict) else data
