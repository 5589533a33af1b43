"""Action rules: what a caller's keys or the agent's own words make happen to the call.

The model cannot call tools, but what it says and what the caller presses can be watched:

```yaml
actions:
  - on_dtmf: "0"                      # a key the caller pressed
    do: transfer                      # to a number or a SIP URI (through the carrier's REST API)
    to: "+15551230099"
    announce: "Connecting you to a colleague."   # optional: said to the caller first
    whisper: "A caller from the billing line."   # optional: said to whoever answers, first
  - on_agent_text: "transfer you"     # a regular expression over the agent's text (no case)
    do: transfer
    to: "sip:queue@pbx.example.com"
    after_s: 1.5                      # optional: let the agent finish its sentence
  - on_agent_text: "\\bgoodbye\\b"
    do: hangup
    say: "Thanks for calling."        # optional
  - on_dtmf: "9"
    do: play                          # a short <Say> or <Play>, then `resume` the agent or `end`
    say: "Our offices open at nine."
    then: resume
  - on_dtmf: "*"
    do: redirect                      # hand the call to your own markup (TwiML, TeXML...)
    url: "https://example.com/ivr.xml"
```
Each rule fires at most `times` times per call (default 1; 0 = every time). The text matcher
keeps the agent's recent text (pieces arrive word by word) and only looks past its last match,
so one phrase fires a rule once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

ACTION_KINDS = ("transfer", "hangup", "play", "redirect")
_DTMF_KEYS = set("0123456789*#ABCD")
_RULE_KEYS = {
    "on_dtmf",
    "on_agent_text",
    "do",
    "to",
    "announce",
    "whisper",
    "caller_id",
    "say",
    "play_url",
    "then",
    "url",
    "times",
    "after_s",
}
TEXT_WINDOW = 400  # characters of agent text a rule's expression sees
MAX_SAY_CHARS = 1000
_TRANSFER_TARGET = re.compile(r"^(\+?[0-9]{3,20}|sips?:[^\s<>\"']{3,200})$")


class RuleError(ValueError):
    """A rule that cannot work; the message names the problem."""


@dataclass(frozen=True)
class ActionRule:
    index: int  # position in the persona's list (named in the call record)
    kind: str  # one of ACTION_KINDS
    dtmf: str | None = None
    agent_text: re.Pattern[str] | None = None
    to: str | None = None
    announce: str | None = None
    whisper: str | None = None
    caller_id: str | None = None
    say: str | None = None
    play_url: str | None = None
    then: str = "end"  # play: "resume" or "end"
    url: str | None = None
    times: int = 1
    after_s: float = 0.0

    @property
    def trigger(self) -> str:
        return f"dtmf {self.dtmf}" if self.dtmf is not None else f"agent text /{self.agent_text.pattern}/"  # type: ignore[union-attr]

    def describe(self) -> str:
        """The action in words, for the call record and the log."""
        if self.kind == "transfer":
            return f"transfer to {self.to}"
        if self.kind == "redirect":
            return f"redirect to {self.url}"
        if self.kind == "play":
            return f"play then {self.then}"
        return "hangup"


def _text(spec: dict[str, Any], key: str, where: str) -> str | None:
    value = spec.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_SAY_CHARS:
        raise RuleError(f"{where}: `{key}` must be text of 1-{MAX_SAY_CHARS} characters")
    return value.strip()


def _http_url(value: object, key: str, where: str) -> str:
    if (
        not isinstance(value, str)
        or urlsplit(value).scheme not in ("http", "https")
        or not urlsplit(value).netloc
    ):
        raise RuleError(f"{where}: `{key}` must be an http(s) URL")
    return value


def parse_rule(index: int, spec: object) -> ActionRule:
    where = f"actions[{index}]"
    if not isinstance(spec, dict):
        raise RuleError(f"{where} must be a mapping")
    unknown = set(spec) - _RULE_KEYS
    if unknown:
        raise RuleError(f"{where}: unknown keys {sorted(unknown)}")
    kind = spec.get("do")
    if kind not in ACTION_KINDS:
        raise RuleError(f"{where}: `do` must be one of {', '.join(ACTION_KINDS)}")
    triggers = [k for k in ("on_dtmf", "on_agent_text") if spec.get(k) is not None]
    if len(triggers) != 1:
        raise RuleError(f"{where}: give exactly one of `on_dtmf`, `on_agent_text`")
    dtmf = pattern = None
    if "on_dtmf" in triggers:
        dtmf = str(spec["on_dtmf"])
        if len(dtmf) != 1 or dtmf not in _DTMF_KEYS:
            raise RuleError(f"{where}: `on_dtmf` must be one key of 0-9 * # A-D")
    else:
        text = spec["on_agent_text"]
        if not isinstance(text, str) or not text or len(text) > 200:
            raise RuleError(f"{where}: `on_agent_text` must be a regular expression of 1-200 characters")
        try:
            pattern = re.compile(text, re.IGNORECASE)
        except re.error as exc:
            raise RuleError(f"{where}: `on_agent_text` is not a regular expression ({exc})") from None
    times = spec.get("times", 1)
    if not isinstance(times, int) or isinstance(times, bool) or times < 0:
        raise RuleError(f"{where}: `times` must be a whole number >= 0 (0 = every time)")
    after_s = spec.get("after_s", 0.0)
    if not isinstance(after_s, int | float) or isinstance(after_s, bool) or not 0 <= after_s <= 30:
        raise RuleError(f"{where}: `after_s` must be 0-30 seconds")
    fields: dict[str, Any] = {
        "announce": _text(spec, "announce", where),
        "whisper": _text(spec, "whisper", where),
        "say": _text(spec, "say", where),
    }
    allowed = {
        "transfer": {"to", "announce", "whisper", "caller_id"},
        "hangup": {"say"},
        "play": {"say", "play_url", "then"},
        "redirect": {"url"},
    }[kind]
    extra = {
        k for k in ("to", "announce", "whisper", "caller_id", "say", "play_url", "then", "url") if k in spec
    }
    if extra - allowed:
        raise RuleError(f"{where}: `{kind}` does not take {sorted(extra - allowed)}")
    if kind == "transfer":
        to = str(spec.get("to") or "").strip()
        if not _TRANSFER_TARGET.match(to):
            raise RuleError(f"{where}: `to` must be a phone number (E.164) or a sip: URI")
        fields["to"] = to
        if spec.get("caller_id") is not None:
            fields["caller_id"] = str(spec["caller_id"])
    elif kind == "play":
        if spec.get("play_url") is not None:
            fields["play_url"] = _http_url(spec["play_url"], "play_url", where)
        if fields["say"] is None and fields.get("play_url") is None:
            raise RuleError(f"{where}: `play` needs `say` or `play_url`")
        then = spec.get("then", "end")
        if then not in ("resume", "end"):
            raise RuleError(f"{where}: `then` must be resume or end")
        fields["then"] = then
    elif kind == "redirect":
        fields["url"] = _http_url(spec.get("url"), "url", where)
    return ActionRule(
        index=index, kind=kind, dtmf=dtmf, agent_text=pattern, times=times, after_s=float(after_s), **fields
    )


def parse_rules(specs: object) -> tuple[ActionRule, ...]:
    if specs is None:
        return ()
    if not isinstance(specs, list):
        raise RuleError("`actions` must be a list of rules")
    return tuple(parse_rule(i, spec) for i, spec in enumerate(specs))


class ActionMatcher:
    """One call's view of its rules: what fired how often, and the agent's recent text."""

    def __init__(self, rules: tuple[ActionRule, ...]):
        self.rules = rules
        self._dtmf = [r for r in rules if r.dtmf is not None]
        self._text_rules = [r for r in rules if r.agent_text is not None]
        self.fired = [0] * len(rules)
        self._text = ""  # agent text since the last match, at most TEXT_WINDOW characters

    def _may_fire(self, rule: ActionRule) -> bool:
        return rule.times == 0 or self.fired[rule.index] < rule.times

    def _fire(self, rule: ActionRule) -> ActionRule:
        self.fired[rule.index] += 1
        return rule

    def on_dtmf(self, digit: str) -> list[ActionRule]:
        return [self._fire(r) for r in self._dtmf if r.dtmf == digit and self._may_fire(r)]

    def on_agent_text(self, piece: str) -> list[tuple[ActionRule, str]]:
        """The rules this piece of agent text fires, each with the phrase that matched."""
        if not self._text_rules:
            return []
        self._text = (self._text + piece)[-TEXT_WINDOW:]
        fired: list[tuple[ActionRule, str]] = []
        end = 0
        for rule in self._text_rules:
            if not self._may_fire(rule):
                continue
            match = rule.agent_text.search(self._text)  # type: ignore[union-attr]
            if match is not None:
                fired.append((self._fire(rule), match.group(0).strip()))
                end = max(end, match.end())
        if end:
            self._text = self._text[end:]  # that phrase is spent: no rule sees it again
        return fired
