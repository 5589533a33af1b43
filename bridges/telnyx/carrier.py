"""Telnyx as a carrier of the phone call: TeXML webhooks, media streaming in bidirectional RTP
mode, Call Control for hang-ups and transfers, Ed25519 webhook signatures.

The number's TeXML application points its voice URL at `POST /telnyx/voice` and its status
callback at `POST /telnyx/status`. Telnyx does not sign the stream's WebSocket upgrade: the
stream URL ends with the call's single-use ticket, and our `<Parameter name="call_id">` ties the
stream to the call the ticket was issued for.
"""

from __future__ import annotations

from collections.abc import Mapping

from personaplex_phone import carrier as phone
from personaplex_phone.carrier import AudioFormat, CallFacts, CallStatus, CarrierPaths, Reply, Webhook
from personaplex_phone.carrier_kit import TWIML_FIELDS, CarrierDefaults
from personaplex_phone.service import form_fields

from personaplex_voice.errors import UserError

from . import signatures, texml
from .config import TelnyxSettings
from .control import ANSWER_PATH, TelnyxControl
from .wire import CALL_ID_PARAMETER, TelnyxWire, audio_format

TERMINAL_STATUSES = {"completed", "busy", "failed", "no-answer", "canceled"}


class TelnyxCarrier(CarrierDefaults):
    name = "telnyx"
    paths = CarrierPaths(
        answer=ANSWER_PATH, answer_methods=("POST",), status="/telnyx/status", media="/telnyx/media-stream"
    )
    stream_ends_on_close = False  # Telnyx says `stop`

    def __init__(
        self, settings: TelnyxSettings, send: phone.SendRequest, publish: phone.Publish, validate: bool
    ):
        self.settings = settings
        self.validate = validate
        self.control = TelnyxControl(settings, send, publish)
        self.outbound: AudioFormat = audio_format(settings.codec, settings.sample_rate)
        self._key_error = ""
        try:
            self.key = signatures.load_public_key(settings.public_key)
        except ValueError as exc:
            self.key, self._key_error = None, str(exc)

    def check(self) -> None:
        super().check()
        if self._key_error:
            raise UserError(self._key_error)

    # --- webhooks ------------------------------------------------------------------------------
    def fields(self, method: str, query: Mapping[str, str], body: bytes, content_type: str) -> dict[str, str]:
        return form_fields(body) if method == "POST" else dict(query)

    def verify(self, webhook: Webhook) -> bool:
        if self.settings.dev_skip_signature:
            return True
        return signatures.verify(
            self.key,
            webhook.headers.get(signatures.SIGNATURE_HEADER),
            webhook.headers.get(signatures.TIMESTAMP_HEADER),
            webhook.body,
            self.settings.signature_tolerance_s,
        )

    def facts(self, webhook: Webhook) -> CallFacts:
        return TWIML_FIELDS.facts(webhook.fields)

    def status(self, webhook: Webhook) -> CallStatus | None:
        form = webhook.fields
        status = form.get("CallStatus") or form.get("StreamEvent") or "unknown"
        facts = TWIML_FIELDS.status_facts(form)
        return CallStatus(
            facts.call_id, status, status in TERMINAL_STATUSES, facts, form.get("CallDuration", "")
        )

    # --- markup --------------------------------------------------------------------------------
    def answer_stream(self, stream_url: str, params: Mapping[str, str], facts: CallFacts) -> Reply:
        parameters = {**params, CALL_ID_PARAMETER: facts.call_id}
        codec = self.outbound.codec.upper()
        return Reply(texml.connect_stream(stream_url, parameters, codec, self.outbound.rate), texml.XML)

    def answer_refusal(self, message: str, busy: bool) -> Reply:
        return Reply(texml.say_and_hang_up(message), texml.XML)

    def new_wire(self) -> TelnyxWire:
        return TelnyxWire(self.outbound)
