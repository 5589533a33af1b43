"""Exotel call control through its Legs API (HTTP Basic: EXOTEL_API_KEY / EXOTEL_API_TOKEN).

| what            | request                                                                  |
| --------------- | ------------------------------------------------------------------------ |
| hang up         | `POST /v2/accounts/{sid}/legs/{call_sid}/actions/hangup` `{}`            |
| anything else   | `POST /v2/accounts/{sid}/legs/{call_sid}/actions` `{"exoml": "<Flow>…</Flow>"}` |

The ExoML verbs used: `<StartSay>`, `<StartPlay>`, `<Dial>`, `<Hangup/>`.

Exotel's flows have no "fetch new instructions from this URL": a redirect action, and `play …
then: resume`, are not supported on Exotel (the action is logged as failed, the caller stays
with the agent); end the Voicebot applet instead (a hang-up) and let the flow's next applet
take over. Requests are built here and sent by the phone call's HTTP client.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Sequence

from personaplex_phone import carrier as phone
from personaplex_phone.carrier import CallHandle, Outcome, RestRequest, SendRequest
from personaplex_phone.xml_markup import xml_document

from . import signatures
from .config import ExotelSettings


def exoml(steps: Sequence[phone.Step]) -> str | None:
    """The steps as an ExoML `<Flow>`, or None when one of them has no ExoML."""
    flow = ET.Element("Flow")
    for step in steps:
        if isinstance(step, phone.Say):
            ET.SubElement(flow, "StartSay").text = step.text
        elif isinstance(step, phone.Play):
            ET.SubElement(flow, "StartPlay").text = step.url
        elif isinstance(step, phone.Dial):
            ET.SubElement(
                flow, "Dial", {"callerId": step.caller_id} if step.caller_id else {}
            ).text = step.target
        elif isinstance(step, phone.Hangup):
            ET.SubElement(flow, "Hangup")
        else:
            return None
    return xml_document(flow)


class ExotelControl:
    def __init__(self, settings: ExotelSettings, send: SendRequest):
        self.settings = settings
        self._send = send

    @property
    def available(self) -> bool:
        s = self.settings
        return bool(s.api_key and s.api_token.get_secret_value() and s.account_sid)

    async def _post(self, call: CallHandle, action: str, body: dict) -> Outcome:
        if not self.available:
            return Outcome(False, "no EXOTEL_API_KEY/EXOTEL_API_TOKEN/EXOTEL_ACCOUNT_SID")
        s = self.settings
        url = f"{s.api_url.rstrip('/')}/v2/accounts/{s.account_sid}/legs/{call.call_id}/{action}"
        auth = signatures.basic(s.api_key, s.api_token.get_secret_value())
        request = RestRequest("POST", url, headers={"Authorization": auth}, json=body)
        return (await self._send(request)).outcome("Exotel")

    async def hang_up(self, call: CallHandle) -> Outcome:
        return await self._post(call, "actions/hangup", {})

    async def instruct(self, call: CallHandle, steps: Sequence[phone.Step]) -> Outcome:
        if len(steps) == 1 and isinstance(steps[0], phone.Hangup):
            return await self.hang_up(call)
        document = exoml(steps)
        if document is None:
            kinds = ", ".join(
                type(s).__name__.lower()
                for s in steps
                if not isinstance(s, phone.Say | phone.Play | phone.Dial | phone.Hangup)
            )
            return Outcome(False, f"{kinds} is not supported on exotel")
        return await self._post(call, "actions", {"exoml": document})
