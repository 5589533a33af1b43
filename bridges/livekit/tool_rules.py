"""A persona's action rules as LiveKit function calls.

PersonaPlex calls no tools, but what it says can be watched. The same `actions` a persona has on
a phone line (`on_agent_text` rules: a regular expression over the agent's words, see
docs/contact-center.md) fire the tools the LiveKit app registered: `do: transfer` calls the
app's transfer tool, `do: hangup` its end-call tool, with the rule's own fields as arguments.
So a LiveKit telephony agent hands a call off the way the Twilio bridge does.

This module is the one place the LiveKit bridge reads the rules (parsing and matching are the
phone bridge's, imported narrowly here: the rule format has one owner).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from personaplex_phone.actions import ActionMatcher, ActionRule, parse_rules

log = logging.getLogger("personaplex_livekit.tool_rules")

# The tool each kind of action calls unless the app names another: LiveKit's own EndCallTool is
# called "end_call"; "transfer_call" is what LiveKit's telephony examples call theirs.
DEFAULT_TOOL_NAMES: Mapping[str, str] = {
    "transfer": "transfer_call",
    "hangup": "end_call",
    "play": "play_message",
    "redirect": "redirect_call",
}
# The rule fields each kind passes to its tool (only those the rule sets).
_ARGUMENTS = {
    "transfer": ("to", "announce", "whisper", "caller_id"),
    "hangup": ("say",),
    "play": ("say", "play_url", "then"),
    "redirect": ("url",),
}


@dataclass(frozen=True)
class ToolCall:
    """A rule that fired: call `name` with `arguments` (JSON) `after_s` from now."""

    name: str
    arguments: str
    after_s: float
    rule: int  # the rule's index in the persona's list
    phrase: str  # the words that fired it


class ToolRules:
    """One session's rules: `on_agent_text(piece)` gives the tool calls a piece of the agent's
    text fires. Rules on keys (`on_dtmf`) have nothing to watch here and are ignored."""

    def __init__(
        self, actions: Sequence[Mapping[str, Any]] | None, tool_names: Mapping[str, str] | None = None
    ):
        rules = parse_rules(list(actions) if actions is not None else None)
        self._names = {**DEFAULT_TOOL_NAMES, **(tool_names or {})}
        self._matcher = ActionMatcher(rules)
        self._watching = any(r.agent_text is not None for r in rules)

    def __bool__(self) -> bool:
        return self._watching

    def on_agent_text(self, piece: str) -> list[ToolCall]:
        return [self._call(rule, phrase) for rule, phrase in self._matcher.on_agent_text(piece)]

    def _call(self, rule: ActionRule, phrase: str) -> ToolCall:
        arguments = {k: getattr(rule, k) for k in _ARGUMENTS[rule.kind] if getattr(rule, k) is not None}
        return ToolCall(
            name=self._names[rule.kind],
            arguments=json.dumps(arguments),
            after_s=rule.after_s,
            rule=rule.index,
            phrase=phrase,
        )
