"""jambonz as a carrier of the phone call: a `listen` verb answers the application's webhook, the
listen WebSocket carries L16 both ways, the listen's `actionHook` carries call control, and every
webhook is signed (`Jambonz-Signature`).

The jambonz application's calling webhook is `POST /jambonz/call`, its call status webhook
`POST /jambonz/status`. jambonz does not sign the WebSocket's upgrade: the stream URL ends with
the call's single-use ticket, and the first frame's `callSid` ties the stream to its call.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from personaplex_phone import carrier as phone
from personaplex_phone.carrier import CallFacts, CallStatus, CarrierPaths, Reply, Webhook
from personaplex_phone.carrier_kit import CarrierDefaults, FactFields, json_fields

from . import signatures, verbs
from .config import JambonzSettings
from .control import JambonzControl
from .wire import SUBPROTOCOL, JambonzWire

log = logging.getLogger(__name__)

FIELDS = FactFields("call_sid", "from", "to", "direction", "account_sid")
TERMINAL_STATUSES = {"completed", "failed", "busy", "no-answer"}


def http_base(stream_url: str) -> str:
    """The public base URL a stream URL of ours was built on (`wss://host/p/jambonz/…` -> `https://host/p`)."""
    base = stream_url[: stream_url.index(verbs.MEDIA_PATH)]
    for ws, http in (("wss://", "https://"), ("ws://", "http://")):
        if base.startswith(ws):
            return http + base[len(ws) :]
    return base


class JambonzCarrier(CarrierDefaults):
    name = "jambonz"
    paths = CarrierPaths(
        answer="/jambonz/call", answer_methods=("POST",), status="/jambonz/status", media=verbs.MEDIA_PATH
    )
    stream_ends_on_close = True  # jambonz ends the listen (the caller hung up) by closing it
    subprotocol = SUBPROTOCOL

    def __init__(self, settings: JambonzSettings, publish: phone.Publish, validate: bool):
        self.settings = settings
        self.validate = validate
        self.control = JambonzControl(publish, settings.sample_rate)

    # --- webhooks ------------------------------------------------------------------------------
    def fields(self, method: str, query: Mapping[str, str], body: bytes, content_type: str) -> dict[str, str]:
        if not body:
            return dict(query)
        return json_fields(body, "jambonz")  # ValueError: not jambonz's (refused)

    def verify(self, webhook: Webhook) -> bool:
        if self.settings.dev_skip_signature:
            return True
        secret = self.settings.webhook_secret.get_secret_value()
        return signatures.verify(secret, webhook.headers, webhook.body, self.settings.max_signature_age_s)

    def facts(self, webhook: Webhook) -> CallFacts:
        return FIELDS.facts(webhook.fields)

    def status(self, webhook: Webhook) -> CallStatus | None:
        values = webhook.fields
        status = values.get("call_status")
        if not status:
            return None
        call_id = values.get("call_sid", "")
        terminal = status in TERMINAL_STATUSES
        if terminal:
            self.control.forget(call_id)
        return CallStatus(call_id, status, terminal, None, values.get("duration", ""))

    # --- markup --------------------------------------------------------------------------------
    def answer_stream(self, stream_url: str, params: Mapping[str, str], facts: CallFacts) -> Reply:
        action_url = http_base(stream_url) + verbs.ACTION_PATH
        verb = verbs.listen(stream_url, self.settings.sample_rate, params, action_url)
        return Reply(json.dumps([verb]), verbs.JSON)

    def answer_refusal(self, message: str, busy: bool) -> Reply:
        return Reply(json.dumps(verbs.say_and_hang_up(message)), verbs.JSON)

    def new_wire(self) -> JambonzWire:
        return JambonzWire()

    # --- the listen's actionHook -----------------------------------------------------------------
    def routes(self, service: Any) -> APIRouter:
        router = APIRouter()

        async def action(request: Request) -> Response:
            webhook = await service.webhook(self, request)
            if webhook is None:
                return Response("invalid jambonz signature", status_code=403, media_type="text/plain")
            call_id = self.facts(webhook).call_id
            document = self.control.next_verbs(call_id)
            log.info(
                "jambonz: call %s: the listen ended; next: %s", call_id, [v.get("verb") for v in document]
            )
            return Response(json.dumps(document), media_type=verbs.JSON)

        router.add_api_route(verbs.ACTION_PATH, action, methods=["POST"], include_in_schema=False)
        return router
