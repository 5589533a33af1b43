"""Genesys call control: the outcome, handed to the Architect flow.

An Audio Connector session cannot move the call itself: when the bot is done, the flow that
called it continues and routes the call with what the bot returned, the output variables of
our `disconnect`. So the phone call's instructions become output variables of the live
session (found by its session id); the stream then ends and says them (wire.py):

| step                     | output variables                                          |
| ------------------------ | --------------------------------------------------------- |
| Dial(target, whisper)    | `action=transfer`, `target`, `whisper`, `caller_id`        |
| Hangup                   | `action=hangup`                                            |
| Redirect(url)            | `action=redirect`, `target=url`                            |
| Say(text) / Play(url)    | `say` (texts joined) / `play` (the URL): said by the flow  |
| Resume, Markup           | not supported on Genesys (the caller stays with the agent)|

No socket here, and no REST: the session's own socket carries it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from personaplex_phone import carrier as phone
from personaplex_phone.carrier import CallHandle, Outcome

from .wire import GenesysWire, one_line


def variables(steps: Sequence[phone.Step]) -> dict[str, str] | None:
    """The output variables for `steps`; None when a step cannot be done on Genesys."""
    out: dict[str, str] = {}
    said: list[str] = []
    for step in steps:
        if isinstance(step, phone.Say):
            said.append(step.text)
        elif isinstance(step, phone.Play):
            out["play"] = one_line(step.url)
        elif isinstance(step, phone.Dial):
            out["action"] = "transfer"
            out["target"] = one_line(step.target)
            if step.whisper:
                out["whisper"] = one_line(step.whisper)
            if step.caller_id:
                out["caller_id"] = one_line(step.caller_id)
        elif isinstance(step, phone.Hangup):
            out.setdefault("action", "hangup")
        elif isinstance(step, phone.Redirect):
            out["action"] = "redirect"
            out["target"] = one_line(step.url)
        else:
            return None
    if said:
        out["say"] = one_line(" ".join(said))
    return out


class GenesysControl:
    def __init__(self, live: Mapping[str, GenesysWire]):
        self.live = live

    @property
    def available(self) -> bool:
        return True

    def _session(self, call: CallHandle) -> GenesysWire | None:
        wire = self.live.get(call.control_id)
        return wire if wire is not None and not wire.ended else None

    async def hang_up(self, call: CallHandle) -> Outcome:
        wire = self._session(call)
        if wire is None:
            return Outcome(False, "the Genesys session is over")
        wire.outputs.setdefault("action", "hangup")  # a decision already made stands
        return Outcome(True)

    async def instruct(self, call: CallHandle, steps: Sequence[phone.Step]) -> Outcome:
        wire = self._session(call)
        if wire is None:
            return Outcome(False, "the Genesys session is over")
        outputs = variables(steps)
        if outputs is None:
            kinds = ", ".join(type(s).__name__ for s in steps)
            return Outcome(False, f"{kinds}: not supported on genesys (the flow routes the call)")
        wire.outputs.update(outputs)
        return Outcome(True)
