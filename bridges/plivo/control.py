"""Plivo call control through its Voice API (HTTP Basic: PLIVO_AUTH_ID / PLIVO_AUTH_TOKEN).

| what                 | request                                                                |
| -------------------- | ---------------------------------------------------------------------- |
| hang up              | `DELETE /v1/Account/{auth_id}/Call/{call_uuid}/`                        |
| anything else        | `POST /v1/Account/{auth_id}/Call/{call_uuid}/` `{"legs": "aleg", "aleg_url", …}` |

"Anything else" transfers the call to a Plivo XML document of ours (a transfer's `<Dial>`, a
goodbye, a message then `<Redirect>` back to the agent) or, for a redirect action, to yours.

Requests are built here and sent by the phone call's HTTP client: no socket in this module.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence

from personaplex_phone import carrier as phone
from personaplex_phone.carrier import CallHandle, Outcome, Publish, Reply, RestRequest, SendRequest
from personaplex_phone.carrier_kit import resume_url

from . import plivoxml
from .config import PlivoSettings

ANSWER_PATH = "/plivo/answer"


class PlivoControl:
    def __init__(self, settings: PlivoSettings, send: SendRequest, publish: Publish):
        self.settings = settings
        self._send = send
        self._publish = publish

    @property
    def available(self) -> bool:
        return bool(self.settings.auth_id and self.settings.auth_token.get_secret_value())

    def _call_url(self, call: CallHandle) -> str:
        return f"{self.settings.api_url.rstrip('/')}/v1/Account/{self.settings.auth_id}/Call/{call.call_id}/"

    def _auth(self) -> dict[str, str]:
        pair = f"{self.settings.auth_id}:{self.settings.auth_token.get_secret_value()}".encode()
        return {"Authorization": "Basic " + base64.b64encode(pair).decode("ascii")}

    async def _go(self, request: RestRequest) -> Outcome:
        if not self.available:
            return Outcome(False, "no PLIVO_AUTH_ID/PLIVO_AUTH_TOKEN")
        return (await self._send(request)).outcome("Plivo")

    async def hang_up(self, call: CallHandle) -> Outcome:
        return await self._go(RestRequest("DELETE", self._call_url(call), headers=self._auth()))

    async def instruct(self, call: CallHandle, steps: Sequence[phone.Step]) -> Outcome:
        only = steps[0] if len(steps) == 1 else None
        if isinstance(only, phone.Hangup):
            return await self.hang_up(call)
        if isinstance(only, phone.Redirect):
            url = only.url
        else:
            document = only.text if isinstance(only, phone.Markup) else self.document(call, steps)
            url = self._publish(Reply(document, plivoxml.XML), call.public_base)
        body = {"legs": "aleg", "aleg_url": url, "aleg_method": "POST"}
        return await self._go(RestRequest("POST", self._call_url(call), headers=self._auth(), json=body))

    def document(self, call: CallHandle, steps: Sequence[phone.Step]) -> str:
        def whisper(dial: phone.Dial) -> str | None:
            if not dial.whisper:
                return None
            return self._publish(Reply(plivoxml.say_only(dial.whisper), plivoxml.XML), call.public_base)

        def resume(step: phone.Resume) -> str:
            return resume_url(call.public_base, ANSWER_PATH, step)

        return plivoxml.render(steps, whisper_url=whisper, resume_url=resume)
