"""Vonage call control through its Voice API, authorised by a JWT of the application.

| what           | request                                                                         |
| -------------- | ------------------------------------------------------------------------------- |
| hang up        | `PUT /v1/calls/{uuid}` `{"action": "hangup"}`                                   |
| anything else  | `PUT /v1/calls/{uuid}` `{"action": "transfer", "destination": {"type": "ncco", …}}` |

The destination is our NCCO (`"ncco": [...]`), or yours for a redirect action (`"url": [...]`).

Requests are built here and sent by the phone call's HTTP client: no socket in this module.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from personaplex_phone import carrier as phone
from personaplex_phone.carrier import CallHandle, Outcome, Publish, Reply, RestRequest, SendRequest
from personaplex_phone.urls import websocket_base

from . import ncco, signatures
from .config import VonageSettings
from .wire import CALL_ID_HEADER

MEDIA_PATH = "/vonage/media-stream"


class VonageControl:
    def __init__(self, settings: VonageSettings, send: SendRequest, publish: Publish, content_type: str):
        self.settings = settings
        self._send = send
        self._publish = publish
        self.content_type = content_type

    @property
    def available(self) -> bool:
        return bool(self.settings.application_id and self.settings.private_key.get_secret_value())

    async def _put(self, call: CallHandle, body: dict[str, Any]) -> Outcome:
        if not self.available:
            return Outcome(False, "no VONAGE_APPLICATION_ID/VONAGE_PRIVATE_KEY")
        token = signatures.application_token(self.settings.application_id, self.settings.private_key_pem())
        url = f"{self.settings.api_url.rstrip('/')}/v1/calls/{call.call_id}"
        request = RestRequest("PUT", url, headers={"Authorization": f"Bearer {token}"}, json=body)
        return (await self._send(request)).outcome("Vonage")

    async def hang_up(self, call: CallHandle) -> Outcome:
        return await self._put(call, {"action": "hangup"})

    async def instruct(self, call: CallHandle, steps: Sequence[phone.Step]) -> Outcome:
        only = steps[0] if len(steps) == 1 else None
        if isinstance(only, phone.Redirect):
            return await self._put(
                call, {"action": "transfer", "destination": {"type": "ncco", "url": [only.url]}}
            )
        if isinstance(only, phone.Markup):
            try:
                actions = json.loads(only.text)
            except ValueError:
                return Outcome(False, "the configured NCCO is not JSON")
        else:
            actions = self.document(call, steps)
        if not actions:  # nothing but a hang-up
            return await self.hang_up(call)
        return await self._put(call, {"action": "transfer", "destination": {"type": "ncco", "ncco": actions}})

    def document(self, call: CallHandle, steps: Sequence[phone.Step]) -> list[dict[str, Any]]:
        def whisper(dial: phone.Dial) -> str | None:
            if not dial.whisper:
                return None
            body = json.dumps([{"action": "talk", "text": dial.whisper}])
            return self._publish(Reply(body, ncco.JSON), call.public_base)

        def resume(step: phone.Resume) -> dict[str, Any]:
            uri = f"{websocket_base(call.public_base)}{MEDIA_PATH}/{step.token}"
            return ncco.websocket(
                uri, self.content_type, {CALL_ID_HEADER: call.call_id, "persona": step.persona}
            )

        return ncco.render(steps, whisper_url=whisper, resume=resume)
