"""Twilio as a carrier of the phone call: Media Streams, TwiML, the REST API, signatures.

The wire format itself is wire.py (which imports nothing of ours); `TwilioWire` turns its
messages into the phone call's events. Everything else a Twilio call does (tickets, audio,
playout, actions, records) is personaplex_phone's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from personaplex_phone import carrier as phone
from personaplex_phone.carrier import (
    MULAW_8K,
    CallerMedia,
    CallFacts,
    CallStatus,
    CarrierPaths,
    ProtocolError,
    Reply,
    StreamStart,
    Webhook,
)
from personaplex_phone.carrier_kit import TWIML_FIELDS, CarrierDefaults
from personaplex_phone.service import form_fields
from personaplex_phone.wire_json import JsonStreamWire
from starlette.requests import HTTPConnection

from . import twiml, wire
from .calls import MEDIA_STREAM_PATH, STATUS_PATH, VOICE_PATH, CallControl, TwilioControl
from .config import TwilioSettings
from .signatures import SIGNATURE_HEADER, SignatureChecker

XML = "application/xml"
TERMINAL_STATUSES = {"completed", "busy", "failed", "no-answer", "canceled"}


class TwilioWire(JsonStreamWire):
    """One Media Stream's messages: wire.py's parsing in the phone call's JSON stream skeleton.
    Our media messages carry `message_ms` of audio each (Twilio's own are 20 ms)."""

    stream_key = "streamSid"
    stream_key_required = True  # Twilio names the stream on every message

    def __init__(self, max_bytes: int, message_ms: int = phone.CHUNK_MS):
        super().__init__()
        self.max_bytes = max_bytes
        self.outbound = replace(MULAW_8K, message_ms=message_ms)
        self.messages = wire.OutboundMessages("")

    def parse(self, message: Mapping[str, Any]) -> phone.StreamEvent | None:
        try:
            return super().parse(message)
        except wire.ProtocolError as exc:
            raise ProtocolError(str(exc), exc.code) from None

    def read(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        return wire.parse_message(dict(raw), self.max_bytes)

    def start(self, message: dict[str, Any]) -> StreamStart:
        start = wire.parse_start(message)
        self.stream_id = start.stream_sid
        self.messages = wire.OutboundMessages(start.stream_sid)
        return StreamStart(
            start.stream_sid, start.call_sid, MULAW_8K, self.outbound, params=start.custom_parameters
        )

    def caller_media(self, media: dict[str, Any]) -> CallerMedia | None:
        if not wire.is_caller_track(media):
            return None  # only the caller's audio goes to the agent
        return CallerMedia(wire.media_payload(media), wire.media_chunk(media))

    def dtmf_key(self, dtmf: dict[str, Any]) -> str:
        return wire.dtmf_digit(dtmf)

    def media(self, payload: bytes) -> str:
        return self.messages.media(payload)

    def mark(self, name: str) -> str:
        return self.messages.mark(name)

    def clear(self) -> str:
        return self.messages.clear()


class TwilioCarrier(CarrierDefaults):
    name = "twilio"
    paths = CarrierPaths(
        answer=VOICE_PATH, answer_methods=("POST",), status=STATUS_PATH, media=MEDIA_STREAM_PATH
    )
    stream_ends_on_close = False  # Twilio says `stop`; a close without it is a lost socket

    def __init__(self, settings: TwilioSettings, calls: CallControl, max_message_bytes: int):
        self.settings = settings
        self.calls = calls
        self.control = TwilioControl(calls)
        self.signatures = SignatureChecker(settings)
        self.max_message_bytes = max_message_bytes

    def check(self) -> None:
        self.settings.check()

    # --- webhooks ------------------------------------------------------------------------------
    def fields(self, method: str, query: Mapping[str, str], body: bytes, content_type: str) -> dict[str, str]:
        # Twilio posts its form; a GET webhook's parameters are in its (signed) URL.
        return form_fields(body) if method == "POST" else {}

    def verify(self, webhook: Webhook) -> bool:
        return self.signatures.valid(
            webhook.url, webhook.fields, webhook.headers.get(SIGNATURE_HEADER.lower())
        )

    def verify_upgrade(self, conn: HTTPConnection) -> bool:
        return self.signatures.check_upgrade(conn)

    def facts(self, webhook: Webhook) -> CallFacts:
        return TWIML_FIELDS.facts(webhook.fields)

    def status(self, webhook: Webhook) -> CallStatus | None:
        form = webhook.fields
        status = form.get("CallStatus", "unknown")
        facts = TWIML_FIELDS.status_facts(form)
        return CallStatus(
            facts.call_id, status, status in TERMINAL_STATUSES, facts, form.get("CallDuration", "")
        )

    # --- markup --------------------------------------------------------------------------------
    def answer_stream(self, stream_url: str, params: Mapping[str, str], facts: CallFacts) -> Reply:
        return Reply(twiml.connect_stream(stream_url, params), XML)

    def answer_refusal(self, message: str, busy: bool) -> Reply:
        fallback = self.settings.busy_twiml if busy else ""
        if fallback.startswith(("http://", "https://")):
            return Reply(twiml.redirect(fallback), XML)
        if fallback:
            return Reply(fallback, XML)
        return Reply(twiml.say_and_hang_up(message), XML)

    def engine_lost(self, apology: str) -> list[phone.Step]:
        fallback = self.settings.engine_lost_twiml
        if fallback.startswith(("http://", "https://")):
            return [phone.Redirect(fallback)]
        if fallback:
            return [phone.Markup(fallback)]
        return [phone.Say(apology), phone.Hangup()]

    def new_wire(self) -> TwilioWire:
        return TwilioWire(self.max_message_bytes, self.settings.message_ms)

    def routes(self, service: Any) -> Any:
        from .outbound import twilio_routes

        return twilio_routes(service, self)
