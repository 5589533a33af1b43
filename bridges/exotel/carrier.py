"""Exotel as a carrier of the phone call: the Voicebot applet's dynamic URL, its bidirectional
stream, the Legs API for hang-ups and transfers, HTTP Basic authentication.

The Voicebot applet's URL is `https://host/exotel/answer?token=ANSWER_TOKEN` (a dynamic URL:
Exotel GETs it with the call's details and takes the stream's `wss://` URL from our JSON answer);
its status callback `/exotel/status?token=ANSWER_TOKEN`. Exotel documents no credentials for
those HTTPS requests, so they are taken on the token in their query (or on valid HTTP Basic
credentials, where they carry any). The stream URL we answer with carries Exotel's Basic
credentials (`wss://KEY:TOKEN@…`, the authentication Exotel documents for streams), the
`sample-rate`, the call's single-use ticket and our custom parameters (at most three, as Exotel
allows).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from urllib.parse import quote, urlencode

from personaplex_phone import carrier as phone
from personaplex_phone import wire_json as j
from personaplex_phone.carrier import CallFacts, CallStatus, CarrierPaths, Reply, Webhook
from personaplex_phone.carrier_kit import CarrierDefaults
from personaplex_phone.service import form_fields
from starlette.requests import HTTPConnection

from personaplex_voice import untrusted

from . import signatures
from .config import ExotelSettings
from .control import ExotelControl
from .wire import ExotelWire

log = logging.getLogger(__name__)

JSON = "application/json"
TERMINAL_STATUSES = {"completed", "failed", "busy", "no-answer", "canceled"}
MAX_PARAMETERS = 3  # Exotel passes at most three custom parameters, 256 characters in all
MAX_PARAMETER_CHARS = 256


class ExotelCarrier(CarrierDefaults):
    name = "exotel"
    paths = CarrierPaths(
        answer="/exotel/answer",
        answer_methods=("GET", "POST"),
        status="/exotel/status",
        media="/exotel/media-stream",
        status_methods=("GET", "POST"),
    )
    stream_ends_on_close = False  # Exotel says `stop`

    def __init__(self, settings: ExotelSettings, send: phone.SendRequest, validate: bool):
        self.settings = settings
        self.validate = validate
        self.control = ExotelControl(settings, send)

    def _authentic(self, headers: Mapping[str, str]) -> bool:
        if self.settings.dev_skip_signature:
            return True
        return signatures.verify(self.settings.api_key, self.settings.api_token.get_secret_value(), headers)

    def check(self) -> None:
        super().check()
        if self.validate and not self.settings.answer_token.get_secret_value():
            log.warning(
                "exotel: no PERSONAPLEX_EXOTEL_ANSWER_TOKEN: the Voicebot applet's dynamic URL is "
                "taken only with HTTP Basic credentials, which Exotel does not document for it; set "
                "a token and end the applet's URL with ?token=<it> (docs/exotel.md)"
            )

    # --- webhooks ------------------------------------------------------------------------------
    def fields(self, method: str, query: Mapping[str, str], body: bytes, content_type: str) -> dict[str, str]:
        if method == "POST" and body:
            if "json" in content_type:
                return j.string_map(untrusted.loads(body))  # InputRefused (400) out of bounds
            return {**query, **form_fields(body)}
        return dict(query)

    def verify(self, webhook: Webhook) -> bool:
        if self.settings.dev_skip_signature:
            return True
        s = self.settings
        return signatures.verify_request(
            s.api_key,
            s.api_token.get_secret_value(),
            s.answer_token.get_secret_value(),
            webhook.headers,
            webhook.query,
        )

    def flow_values(self, webhook: Webhook) -> dict[str, str]:
        """The dynamic URL's query, less our answer token (never a template's value, never
        passed on in the stream URL)."""
        return {k: v for k, v in webhook.query.items() if k != "token"}

    def verify_upgrade(self, conn: HTTPConnection) -> bool:
        return self._authentic({k.lower(): v for k, v in conn.headers.items()})

    def facts(self, webhook: Webhook) -> CallFacts:
        values = webhook.fields
        return CallFacts(
            call_id=values.get("CallSid", ""),
            from_=values.get("CallFrom") or values.get("From", ""),
            to=values.get("CallTo") or values.get("To", ""),
            direction=values.get("Direction", "inbound"),
        )

    def status(self, webhook: Webhook) -> CallStatus | None:
        values = webhook.fields
        status = values.get("Status") or values.get("CallStatus") or "unknown"
        facts = self.facts(webhook)
        return CallStatus(
            facts.call_id, status, status in TERMINAL_STATUSES, facts, values.get("ConversationDuration", "")
        )

    # --- markup --------------------------------------------------------------------------------
    def stream_url(self, ws_base: str, ticket: str) -> str:
        scheme, sep, rest = ws_base.partition("://")
        key, token = self.settings.api_key, self.settings.api_token.get_secret_value()
        credentials = f"{quote(key, safe='')}:{quote(token, safe='')}@" if key and token else ""
        return f"{scheme}{sep}{credentials}{rest}/{ticket}"

    def answer_stream(self, stream_url: str, params: Mapping[str, str], facts: CallFacts) -> Reply:
        query = {"sample-rate": str(self.settings.sample_rate)}
        for key, value in list(params.items())[:MAX_PARAMETERS]:
            if len(urlencode({**query, key: value})) <= MAX_PARAMETER_CHARS:
                query[key] = value
        return Reply(json.dumps({"url": f"{stream_url}?{urlencode(query)}"}), JSON)

    def answer_refusal(self, message: str, busy: bool) -> Reply:
        # No stream URL: the Voicebot applet fails and Exotel takes the flow's next applet (put a
        # Greeting there that says you are busy).
        return Reply(json.dumps({"error": message}), JSON, status=503 if busy else 404)

    def new_wire(self) -> ExotelWire:
        return ExotelWire(self.settings.sample_rate)
