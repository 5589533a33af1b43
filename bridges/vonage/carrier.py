"""Vonage as a carrier of the phone call: NCCO answers, the WebSocket endpoint (binary L16),
its Voice API for hang-ups and transfers, signed-JWT webhooks.

The Vonage application's answer URL is `GET /vonage/answer`, its event URL `POST /vonage/event`.
Vonage does not sign the WebSocket's upgrade: the stream URL ends with the call's single-use
ticket, and our endpoint header `call_uuid` ties the stream to the call it was issued for.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from urllib.parse import parse_qsl, urlsplit

from personaplex_phone import carrier as phone
from personaplex_phone.carrier import CallFacts, CallStatus, CarrierPaths, Reply, Webhook
from personaplex_phone.carrier_kit import CarrierDefaults, FactFields, json_fields

from . import ncco, signatures
from .config import VonageSettings
from .control import MEDIA_PATH, VonageControl
from .wire import CALL_ID_HEADER, VonageWire

FIELDS = FactFields("uuid", "from", "to", "direction")
TERMINAL_STATUSES = {"completed", "busy", "cancelled", "failed", "rejected", "timeout", "unanswered"}


class VonageCarrier(CarrierDefaults):
    name = "vonage"
    paths = CarrierPaths(
        answer="/vonage/answer", answer_methods=("GET", "POST"), status="/vonage/event", media=MEDIA_PATH
    )
    stream_ends_on_close = True  # Vonage ends the WebSocket leg by closing it

    def __init__(
        self, settings: VonageSettings, send: phone.SendRequest, publish: phone.Publish, validate: bool
    ):
        self.settings = settings
        self.validate = validate
        self.content_type = f"audio/l16;rate={settings.sample_rate}"
        self.control = VonageControl(settings, send, publish, self.content_type)

    # --- webhooks ------------------------------------------------------------------------------
    def fields(self, method: str, query: Mapping[str, str], body: bytes, content_type: str) -> dict[str, str]:
        if method == "GET" or not body:
            return dict(query)
        return json_fields(body, "Vonage")  # ValueError: not Vonage's (refused)

    def verify(self, webhook: Webhook) -> bool:
        if self.settings.dev_skip_signature:
            return True
        secret = self.settings.signature_secret.get_secret_value()
        # The query as received, in its order: a GET's payload hash covers its parameters so.
        query = parse_qsl(urlsplit(webhook.url).query, keep_blank_values=True)
        return signatures.verify(
            secret,
            webhook.headers,
            webhook.body,
            self.settings.max_token_age_s,
            method=webhook.method,
            query=query,
        )

    def facts(self, webhook: Webhook) -> CallFacts:
        return FIELDS.facts(webhook.fields)

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
    def answer_stream(self, stream_url: str, params: Mapping[str, str], facts: CallFacts) -> Reply:
        headers = {**params, CALL_ID_HEADER: facts.call_id}
        return Reply(json.dumps([ncco.websocket(stream_url, self.content_type, headers)]), ncco.JSON)

    def answer_refusal(self, message: str, busy: bool) -> Reply:
        return Reply(json.dumps([{"action": "talk", "text": message}]), ncco.JSON)

    def new_wire(self) -> VonageWire:
        return VonageWire()
