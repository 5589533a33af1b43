"""Call control on Asterisk: the dialplan carries the call on after our media leg, or ARI does.

Asterisk has no call-control REST API for a channel in the dialplan. What it has is the dialplan
itself: when our leg ends (we send AudioSocket's hang-up, or chan_websocket's socket closes),
`AudioSocket()` returns, or the `Dial()` of the AudioSocket/WebSocket channel does, and the
caller's channel goes on to the next priority. So an action is a *next step*: kept here per
call, asked for by the dialplan (`GET /asterisk/calls/{uuid}/next`, JSON read with
`JSON_DECODE`), then carried out by it:

| key         | what                                                              |
| ----------- | ----------------------------------------------------------------- |
| `action`    | `hangup`, `transfer`, `agent` (back to the agent), `goto`         |
| `target`    | transfer: the rule's `to` (E.164 number or sip: URI)              |
| `caller_id`, `whisper` | transfer: the rule's, when set                         |
| `say`       | words to say first (the persona's goodbye, an announcement)       |
| `play`      | a sound URL to play first                                         |
| `uuid`      | `agent`: the new UUID to connect back with                        |
| `goto`      | `goto`: `context,exten,priority` (a configured fallback)          |

With ARI configured (`ASTERISK_ARI_URL`, for calls your Stasis application holds), the same
step is set on the caller's channel as `PERSONAPLEX_<KEY>` variables and the channel continues
in the dialplan at `ari_context`, extension = the action; a hang-up deletes the channel.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import quote, urlencode

from personaplex_phone import carrier as phone
from personaplex_phone.carrier import CallHandle, Outcome, RestRequest, SendRequest

from .config import AsteriskSettings
from .tickets import NextSteps

log = logging.getLogger(__name__)

# A resume: (call handle, the Resume step) -> the UUID the caller comes back with.
MintResume = Callable[[CallHandle, phone.Resume], str]


def next_step(
    steps: Sequence[phone.Step], mint_resume: MintResume, call: CallHandle
) -> dict[str, Any] | None:
    """The dialplan's next step for `steps`, or None for steps Asterisk cannot take (a URL of
    markup to fetch: Asterisk has no such thing)."""
    step: dict[str, Any] = {}
    said: list[str] = []
    for item in steps:
        if isinstance(item, phone.Say):
            said.append(item.text)
        elif isinstance(item, phone.Play):
            step["play"] = item.url
        elif isinstance(item, phone.Dial):
            step.update(action="transfer", target=item.target)
            if item.caller_id:
                step["caller_id"] = item.caller_id
            if item.whisper:
                step["whisper"] = item.whisper
        elif isinstance(item, phone.Hangup):
            step.setdefault("action", "hangup")
        elif isinstance(item, phone.Resume):
            step.update(action="agent", uuid=mint_resume(call, item))
        elif isinstance(item, phone.Markup):
            step.update(action="goto", goto=item.text.strip())
        else:  # Redirect: a document of the user's at a URL
            return None
    if said:
        step["say"] = " ".join(said)
    step.setdefault("action", "hangup")
    return step


def describe(step: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in step.items())


class AsteriskControl:
    """The phone call's CallControl for Asterisk (see the module docstring)."""

    def __init__(
        self,
        settings: AsteriskSettings,
        steps: NextSteps,
        send: SendRequest,
        mint_resume: MintResume,
    ):
        self.settings = settings
        self.steps = steps
        self._send = send
        self._mint_resume = mint_resume

    @property
    def available(self) -> bool:
        return True  # the dialplan path needs nothing more

    async def hang_up(self, call: CallHandle) -> Outcome:
        self.steps.set(call.call_id, {"action": "hangup"})
        if not self.settings.ari:
            return Outcome(True, "the dialplan continues: action=hangup")
        answer = await self._send(self._ari("DELETE", f"channels/{quote(call.call_id, safe='')}"))
        if answer.ok or answer.status == 404:  # 404: the channel is already gone
            return Outcome(True)
        return Outcome(False, f"ARI refused the hang-up ({answer.status or answer.error})")

    async def instruct(self, call: CallHandle, steps: Sequence[phone.Step]) -> Outcome:
        step = next_step(steps, self._mint_resume, call)
        if step is None:
            return Outcome(False, "a redirect to a URL is not supported on asterisk")
        self.steps.set(call.call_id, step)
        if not self.settings.ari:
            return Outcome(True, f"the dialplan continues: {describe(step)}")
        channel = quote(call.call_id, safe="")
        for key, value in step.items():
            variable = {"variable": f"PERSONAPLEX_{key.upper()}", "value": str(value)}
            answer = await self._send(self._ari("POST", f"channels/{channel}/variable?{urlencode(variable)}"))
            if not answer.ok:
                return Outcome(False, f"ARI refused a channel variable ({answer.status or answer.error})")
        where = {"context": self.settings.ari_context, "extension": step["action"], "priority": "1"}
        answer = await self._send(self._ari("POST", f"channels/{channel}/continue?{urlencode(where)}"))
        if not answer.ok:
            return Outcome(False, f"ARI refused to continue the channel ({answer.status or answer.error})")
        return Outcome(True, f"ARI: {describe(step)}")

    def _ari(self, method: str, path: str) -> RestRequest:
        user = f"{self.settings.ari_username}:{self.settings.ari_password.get_secret_value()}"
        auth = base64.b64encode(user.encode()).decode("ascii")
        return RestRequest(method, f"{self.settings.ari_url}/{path}", {"Authorization": f"Basic {auth}"})
