"""Exotel's authentication of its requests to us.

Exotel does not sign requests. For the Voicebot stream it documents HTTP Basic
(developer.exotel.com/docs/agentstream/stream-voicebot-applet, "Authentication"): a `wss://`
URL written `wss://KEY:TOKEN@host/…` reaches us with `Authorization: Basic base64(KEY:TOKEN)` on
the WebSocket upgrade; IP allow-listing, the other option, is for your firewall. For the applet's
HTTPS (dynamic) URL and status callbacks it documents no credentials at all: those requests are
taken when they carry our answer token in their query (`?token=…`, the URL you configure), or,
where a proxy or Exotel adds them, valid Basic credentials. Compared in constant time.
"""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import Mapping


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")


def verify(user: str, password: str, headers: Mapping[str, str]) -> bool:
    if not user or not password:
        return False
    given = headers.get("authorization", "")
    if not given.lower().startswith("basic "):
        return False
    try:
        decoded = base64.b64decode(given[6:].strip(), validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        return False
    name, sep, secret = decoded.partition(":")
    ok_name = hmac.compare_digest(name.encode(), user.encode())
    ok_secret = hmac.compare_digest(secret.encode(), password.encode())
    return bool(sep) and ok_name and ok_secret


def verify_request(
    user: str, password: str, answer_token: str, headers: Mapping[str, str], query: Mapping[str, str]
) -> bool:
    """An HTTPS request of Exotel's (the dynamic URL, a status callback): the configured answer
    token in its query, or valid Basic credentials when it carries any."""
    given = query.get("token", "")
    if answer_token and given and hmac.compare_digest(given.encode(), answer_token.encode()):
        return True
    return verify(user, password, headers)
