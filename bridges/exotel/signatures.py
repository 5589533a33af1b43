"""Exotel's authentication of its requests to us: HTTP Basic with the account's API key and token.

Exotel does not sign requests; it authenticates them as its docs describe: the Voicebot applet's
URL (and the dynamic URL's answer) carries `KEY:TOKEN@host`, which Exotel sends as
`Authorization: Basic base64(KEY:TOKEN)` on the HTTP request and on the WebSocket upgrade. (IP
allow-listing, the other option Exotel offers, is for your firewall.) Compared in constant time.
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
