"""Who may use the server: the optional API key and the browser Origin allow-list.

Browsers cannot set headers on a WebSocket, so the key may come as the `token` query parameter
as well as `Authorization: Bearer KEY` or `X-API-Key: KEY`.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from personaplex_voice.process.settings import ServerSettings


def presented_key(headers: Mapping[str, str], query: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return headers.get("x-api-key") or query.get("token") or None


def key_ok(settings: ServerSettings, headers: Mapping[str, str], query: Mapping[str, str]) -> bool:
    if settings.api_key is None:
        return True
    given = presented_key(headers, query)
    expected = settings.api_key.get_secret_value()
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def origin_ok(settings: ServerSettings, headers: Mapping[str, str]) -> bool:
    """Non-browser clients send no Origin and are judged by the API key alone."""
    allowed = settings.origins
    origin = headers.get("origin")
    if not allowed or origin is None:
        return True
    return origin.rstrip("/") in allowed
