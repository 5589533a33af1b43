"""`X-Twilio-Signature` checks for webhooks and the Media Streams WebSocket upgrade.

Twilio signs the full URL it requested (scheme, host, path, query) plus the sorted POST form
fields with HMAC-SHA1 keyed by the account's auth token; `twilio.request_validator` does the
arithmetic. Behind a proxy or tunnel the server does not see the URL Twilio used, so the URL is
rebuilt from `PUBLIC_URL` and the request's path and query (personaplex_phone.urls).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from personaplex_phone.urls import public_base, public_url_of, websocket_base
from starlette.requests import HTTPConnection

from twilio.request_validator import SIGNATURE_HEADER, RequestValidator

from .config import TwilioSettings

log = logging.getLogger(__name__)

__all__ = ["SIGNATURE_HEADER", "SignatureChecker", "public_base", "public_url_of", "websocket_base"]


class SignatureChecker:
    """Validates Twilio signatures; a no-op only under the explicit development flag."""

    def __init__(self, settings: TwilioSettings):
        self.settings = settings
        token = settings.auth_token.get_secret_value()
        self._validator = RequestValidator(token) if token else None

    def valid(self, url: str, params: Mapping[str, str] | None, signature: str | None) -> bool:
        if not self.settings.validate_signatures:
            return True
        if self._validator is None or not signature:
            return False
        return bool(self._validator.validate(url, dict(params or {}), signature))

    def check_webhook(self, conn: HTTPConnection, form: Mapping[str, str]) -> bool:
        url = public_url_of(self.settings, conn)
        ok = self.valid(url, form, conn.headers.get(SIGNATURE_HEADER))
        if not ok:
            log.warning("twilio: rejected webhook with a missing or wrong signature for %s", url)
        return ok

    def check_upgrade(self, conn: HTTPConnection) -> bool:
        """The upgrade is signed over the Stream URL we gave Twilio (ws/wss, no query)."""
        http_url = public_url_of(self.settings, conn)
        signature = conn.headers.get(SIGNATURE_HEADER)
        # Accept the signature over the wss:// form (the URL in our TwiML) or its https:// twin.
        ok = self.valid(websocket_base(http_url), {}, signature) or self.valid(http_url, {}, signature)
        if not ok:
            log.warning("twilio: rejected media-stream upgrade with a missing or wrong signature")
        return ok
