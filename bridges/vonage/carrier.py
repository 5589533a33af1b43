"""Vonage as a carrier of the phone call: NCCO answers, the WebSocket endpoint (binary L16),
its Voice API for hang-ups and transfers, signed-JWT webhooks.

The Vonage application's answer URL is `GET /vonage/answer`, its event URL `POST /vonage/event`.
Vonage does not sign the WebSocket's upgrade: the stream URL ends with the call's single-use
ticket, and our endpoint header `call_uuid` ties the stream to the call it was issued for.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from personaplex_phone import carrier as phone
from personaplex_phone.carrier import CallFacts, CallStatus, CarrierPaths, Reply, Webhook
from starlette.requests import HTTPConnection

from . import ncco, signatures
from .config import VonageSettings
from .control import MEDIA_PATH, Publish, VonageControl
from .wire import CALL_ID_HEADER, VonageWire

TERMINAL_STATUSES = {"completed", "busy", "cancelled", "failed", "rejected", "timeout", "unanswered"}


class VonageCarrier:
    name = "vonage"
    paths = CarrierPaths(
        answer="/vonage/answer", answer_methods=("GET", "POST"), status="/vonage/event", media=MEDIA_PATH
    )
    stream_ends_on_close = True  # Vonage ends the WebSocket leg by closing it

    def __init__(self, settings: VonageSettings, send: phone.SendRequest, publish: Publish, validate: bool):
        self.settings = settings
        self.validate = validate
        self.content_type = f"audio/l16;rate={settings.sample_rate}"
        self.control = VonageControl(settings, send, publish, self.content_type)

    def check(self) -> None:
        self.settings.check(self.validate)

    # --- webhooks ------------------------------------------------------------------------------
    def fields(self, method: str, query: Mapping[str, str], body: bytes, content_type: str) -> dict[str, str]:
        if method == "GET" or not body:
            return dict(query)
        data = json.loads(body)  # ValueError: not Vonage's (refused)
        if not isinstance(data, dict):
            raise ValueError("a Vonage webhook body is a JSON object")
        return {
            k: str(v) for k, v in data.items() if isinstance(v, str | int | float) and not isinstance(v, bool)
        }

    def verify(self, webhook: Webhook) -> bool:
        if self.settings.dev_skip_signature:
            return True
        secret = self.settings.signature_secret.get_secret_value()
        return signatures.verify(secret, webhook.headers, webhook.body, self.settings.max_token_age_s)

    def verify_upgrade(self, conn: HTTPConnection) -> bool:
        return True  # unsigned by Vonage: the ticket in the URL is what the stream must present

    def facts(self, webhook: Webhook) -> CallFacts:
        values = webhook.fields
        return CallFacts(
            call_id=values.get("uuid", ""),
            from_=values.get("from", ""),
            to=values.get("to", ""),
            direction=values.get("direction", "inbound"),
        )

    def status(self, webhook: Webhook) -> CallStatus | None:
        values = webhook.fields
        status = values.get("status")
        if not status:
            return None  # other events (input, recordings...) are not the call's state
        # Only the caller's leg is a call of ours; our WebSocket leg's events carry another uuid
        # and find no journal (facts None: nothing is created for them).
        return CallStatus(
            values.get("uuid", ""), status, status in TERMINAL_STATUSES, None, values.get("duration", "")
        )

    # --- markup --------------------------------------------------------------------------------
    def stream_url(self, ws_base: str, ticket: str) -> str:
        return f"{ws_base}/{ticket}"

    def answer_stream(self, stream_url: str, params: Mapping[str, str], facts: CallFacts) -> Reply:
        headers = {**params, CALL_ID_HEADER: facts.call_id}
        return Reply(json.dumps([ncco.websocket(stream_url, self.content_type, headers)]), ncco.JSON)

    def answer_refusal(self, message: str, busy: bool) -> Reply:
        return Reply(json.dumps([{"action": "talk", "text": message}]), ncco.JSON)

    def engine_lost(self, apology: str) -> list[phone.Step]:
        return [phone.Say(apology), phone.Hangup()]

    def new_wire(self) -> VonageWire:
        return VonageWire()
