"""Plivo as a carrier of the phone call: Plivo XML answers, the bidirectional audio stream,
its Voice API for hang-ups and transfers, V3 request signatures.

The Plivo application's Answer URL is `POST /plivo/answer`, its Hangup URL `POST /plivo/hangup`.
Plivo does not sign the stream's WebSocket upgrade: the stream URL ends with the call's
single-use ticket, and the stream's `start` names the call (its `callId`), which must be the
call the ticket was issued for.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import parse_qsl

from personaplex_phone import carrier as phone
from personaplex_phone.carrier import CallFacts, CallStatus, CarrierPaths, Reply, Webhook
from personaplex_phone.carrier_kit import CarrierDefaults, FactFields
from personaplex_phone.service import form_fields

from . import plivoxml, signatures
from .config import PlivoSettings
from .control import ANSWER_PATH, PlivoControl
from .wire import PlivoWire

FIELDS = FactFields("CallUUID", "From", "To", "Direction")


class PlivoCarrier(CarrierDefaults):
    name = "plivo"
    paths = CarrierPaths(
        answer=ANSWER_PATH,
        answer_methods=("POST", "GET"),
        status="/plivo/hangup",
        media="/plivo/media-stream",
    )
    stream_ends_on_close = True  # Plivo ends a stream by closing its socket

    def __init__(
        self, settings: PlivoSettings, send: phone.SendRequest, publish: phone.Publish, validate: bool
    ):
        self.settings = settings
        self.validate = validate
        self.control = PlivoControl(settings, send, publish)

    # --- webhooks ------------------------------------------------------------------------------
    def fields(self, method: str, query: Mapping[str, str], body: bytes, content_type: str) -> dict[str, str]:
        return form_fields(body) if method == "POST" else dict(query)

    def verify(self, webhook: Webhook) -> bool:
        if self.settings.dev_skip_signature:
            return True
        form = parse_qsl(webhook.body.decode("utf-8", "replace"), keep_blank_values=True)
        token = self.settings.auth_token.get_secret_value()
        return signatures.verify(token, webhook.method, webhook.url, webhook.headers, form)

    def facts(self, webhook: Webhook) -> CallFacts:
        return FIELDS.facts(webhook.fields)

    def status(self, webhook: Webhook) -> CallStatus | None:
        # The application's Hangup URL: whatever it says, the call is over.
        form = webhook.fields
        facts = FIELDS.status_facts(form)
        return CallStatus(
            facts.call_id, form.get("CallStatus", "completed"), True, facts, form.get("Duration", "")
        )

    # --- markup --------------------------------------------------------------------------------
    def answer_stream(self, stream_url: str, params: Mapping[str, str], facts: CallFacts) -> Reply:
        return Reply(plivoxml.stream(stream_url, params, self.settings.content_type), plivoxml.XML)

    def answer_refusal(self, message: str, busy: bool) -> Reply:
        return Reply(plivoxml.say_and_hang_up(message), plivoxml.XML)

    def new_wire(self) -> PlivoWire:
        return PlivoWire()
