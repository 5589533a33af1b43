"""Genesys Cloud Audio Connector as a carrier of the phone call.

There is no answer webhook: an Architect flow's *Call Audio Connector* action opens a WebSocket
to the integration's base URI with the action's connector id appended (any path below
`/genesys/audio-connector` is taken), and the session's `open` is the call's arrival, admitted
then like an answer webhook's call (persona, template, context, a slot). Every connection must
carry the integration's API key (`X-API-KEY`), and, when a client secret is configured, an HTTP
message signature made with it (httpsig.py). Call control is the session's outcome, handed to
the flow (control.py).
"""

from __future__ import annotations

import hmac
import logging
import weakref
from collections.abc import Mapping
from urllib.parse import urlsplit

from personaplex_phone import carrier as phone
from personaplex_phone.carrier import CallFacts, CallStatus, CarrierPaths, Reply, Webhook
from personaplex_phone.carrier_kit import CarrierDefaults
from personaplex_phone.config import PhoneSettings
from personaplex_phone.urls import public_url_of
from starlette.requests import HTTPConnection

from . import httpsig
from .config import GenesysSettings
from .control import GenesysControl
from .wire import GenesysWire

log = logging.getLogger(__name__)

MEDIA_PATH = "/genesys/audio-connector"
DEFAULT_PORTS = {"https": "443", "http": "80", "wss": "443", "ws": "80"}


def authority(url: str) -> str:
    """The host (and port, unless the scheme's default) a URL dials, as signatures cover it."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = parts.port
    if port is not None and str(port) != DEFAULT_PORTS.get(parts.scheme, ""):
        host += f":{port}"
    return host


class GenesysCarrier(CarrierDefaults):
    name = "genesys"
    paths = CarrierPaths(answer="", answer_methods=(), status=None, media=MEDIA_PATH)
    stream_ends_on_close = False  # Genesys says `close` first; a bare close is a lost socket
    answers_in_stream = True

    def __init__(self, settings: GenesysSettings, phone_settings: PhoneSettings, validate: bool):
        self.settings = settings
        self.phone_settings = phone_settings
        self.validate = validate
        # Live sessions by session id, for call control; a finished stream's wire just goes.
        self.live: weakref.WeakValueDictionary[str, GenesysWire] = weakref.WeakValueDictionary()
        self.control = GenesysControl(self.live)
        self.verifier: httpsig.SignatureVerifier | None = None

    def check(self) -> None:
        super().check()
        if self.settings.client_secret.get_secret_value():
            self.verifier = httpsig.SignatureVerifier(
                self.settings.secret_key(), self.settings.max_signature_age_s
            )

    # --- the connection ----------------------------------------------------------------------------
    def verify_upgrade(self, conn: HTTPConnection) -> bool:
        if self.settings.dev_skip_signature:
            return True
        expected = self.settings.api_key.get_secret_value()
        given = conn.headers.get("x-api-key", "")
        if not expected or not hmac.compare_digest(given.encode(), expected.encode()):
            log.warning("genesys: refused a connection without the integration's X-API-KEY")
            return False
        if self.verifier is None:
            return True
        url = public_url_of(self.phone_settings, conn)
        parts = urlsplit(url)
        request = httpsig.Request(
            request_target=parts.path + (f"?{parts.query}" if parts.query else ""),
            authority=authority(url) if self.phone_settings.public_url else conn.headers.get("host", ""),
            header=lambda name: _header(conn, name),
        )
        headers = {k: conn.headers.get(k, "") for k in ("signature-input", "signature")}
        problem = self.verifier.verify(headers, given, request)
        if problem:
            log.warning("genesys: refused a connection: signature: %s", problem)
            return False
        return True

    def new_wire(self) -> GenesysWire:
        return GenesysWire(self.live, self.settings.message_ms)

    def wire_for(self, conn: HTTPConnection) -> GenesysWire:
        """The session's wire, told the organization the upgrade's `audiohook-organization-id`
        names: its `open` must name the same one."""
        organization = conn.headers.get("audiohook-organization-id", "")
        return GenesysWire(self.live, self.settings.message_ms, organization=organization)

    def engine_lost(self, apology: str) -> list[phone.Step]:
        # The flow decides what comes next: `action=error` (the end reason says the engine was
        # lost), and the apology for it to say.
        return [phone.Say(apology)]

    # --- no webhooks: the parts of a carrier Genesys has no use for ---------------------------------
    def fields(self, method: str, query: Mapping[str, str], body: bytes, content_type: str) -> dict[str, str]:
        return {}

    def verify(self, webhook: Webhook) -> bool:
        return False  # Genesys sends no webhooks: nothing that comes as one is Genesys's

    def facts(self, webhook: Webhook) -> CallFacts:
        return CallFacts("")

    def status(self, webhook: Webhook) -> CallStatus | None:
        return None

    def answer_stream(self, stream_url: str, params: Mapping[str, str], facts: CallFacts) -> Reply:
        return Reply("", "text/plain")  # the session's `opened` is the answer (the wire's accept)

    def answer_refusal(self, message: str, busy: bool) -> Reply:
        return Reply(message, "text/plain", status=404)


def _header(conn: HTTPConnection, name: str) -> str | None:
    values = conn.headers.getlist(name)
    return ", ".join(httpsig.canonical(v) for v in values) if values else None
