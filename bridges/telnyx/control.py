"""Telnyx call control: hang-up and transfer through its Call Control API, everything else (a
transfer with words, a goodbye, a message then back to the agent, your own TeXML) as a TeXML
call update pointing at a document of ours.

| what                         | request                                                          |
| ---------------------------- | ---------------------------------------------------------------- |
| hang up                      | `POST /v2/calls/{call_control_id}/actions/hangup`                |
| transfer (no announce/whisper) | `POST /v2/calls/{call_control_id}/actions/transfer` `{"to", "from"}` |
| anything else                | `POST /v2/texml/Accounts/{AccountSid}/Calls/{CallSid}` `{"Url", "Method"}` |

Every request carries `Authorization: Bearer TELNYX_API_KEY`. Requests are built here and sent by
the phone call's HTTP client: no socket in this module.
"""

from __future__ import annotations

from collections.abc import Sequence

from personaplex_phone import carrier as phone
from personaplex_phone.carrier import CallHandle, Outcome, Publish, Reply, RestRequest, SendRequest
from personaplex_phone.carrier_kit import resume_url

from . import texml
from .config import TelnyxSettings

ANSWER_PATH = "/telnyx/voice"


class TelnyxControl:
    def __init__(self, settings: TelnyxSettings, send: SendRequest, publish: Publish):
        self.settings = settings
        self._send = send
        self._publish = publish

    @property
    def available(self) -> bool:
        return bool(self.settings.api_key.get_secret_value())

    def _request(self, path: str, body: dict) -> RestRequest:
        return RestRequest(
            "POST",
            self.settings.api_url.rstrip("/") + path,
            headers={"Authorization": f"Bearer {self.settings.api_key.get_secret_value()}"},
            json=body,
        )

    async def _go(self, request: RestRequest) -> Outcome:
        if not self.available:
            return Outcome(False, "no TELNYX_API_KEY")
        return (await self._send(request)).outcome("Telnyx")

    async def hang_up(self, call: CallHandle) -> Outcome:
        return await self._go(
            self._request(f"/v2/calls/{call.control_id or call.call_id}/actions/hangup", {})
        )

    async def instruct(self, call: CallHandle, steps: Sequence[phone.Step]) -> Outcome:
        only = steps[0] if len(steps) == 1 else None
        if isinstance(only, phone.Hangup):
            return await self.hang_up(call)
        if isinstance(only, phone.Dial) and not only.whisper:
            body = {"to": only.target, **({"from": only.caller_id} if only.caller_id else {})}
            return await self._go(
                self._request(f"/v2/calls/{call.control_id or call.call_id}/actions/transfer", body)
            )
        if isinstance(only, phone.Redirect):
            url = only.url
        else:
            document = only.text if isinstance(only, phone.Markup) else self.document(call, steps)
            url = self._publish(Reply(document, texml.XML), call.public_base)
        if not call.account:
            return Outcome(False, "no TeXML AccountSid for this call (its answer came elsewhere)")
        path = f"/v2/texml/Accounts/{call.account}/Calls/{call.call_id}"
        return await self._go(self._request(path, {"Url": url, "Method": "POST"}))

    def document(self, call: CallHandle, steps: Sequence[phone.Step]) -> str:
        def whisper(dial: phone.Dial) -> str | None:
            if not dial.whisper:
                return None
            return self._publish(Reply(texml.say_only(dial.whisper), texml.XML), call.public_base)

        def resume(step: phone.Resume) -> str:
            return resume_url(call.public_base, ANSWER_PATH, step)

        return texml.render(steps, whisper_url=whisper, resume_url=resume)
