"""Vonage signed webhooks: a JWT in `Authorization: Bearer …`, HS256 with the signature secret.

Its claims: `iat` (when Vonage signed it: too old and the request is refused, a replay),
`payload_hash` (SHA-256 hex of the raw body, present when there is one: the body cannot be
swapped), `jti`, `api_key`, `application_id`. PyJWT checks the signature.

Our REST requests are authorised the other way round: a short-lived RS256 JWT of our own, signed
with the application's private key (`application_id`, `iat`, `exp`, `jti`).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Mapping

import jwt


def bearer(headers: Mapping[str, str]) -> str:
    value = headers.get("authorization", "")
    return value[7:].strip() if value.lower().startswith("bearer ") else ""


def verify(
    secret: str, headers: Mapping[str, str], body: bytes, max_age_s: float, now: float | None = None
) -> bool:
    token = bearer(headers)
    if not secret or not token:
        return False
    try:
        claims = jwt.decode(
            token, secret, algorithms=["HS256"], options={"require": ["iat"], "verify_iat": False}
        )
    except jwt.PyJWTError:
        return False
    issued = claims.get("iat")
    if not isinstance(issued, int | float) or abs((time.time() if now is None else now) - issued) > max_age_s:
        return False
    claimed = claims.get("payload_hash")
    if body or claimed is not None:
        if not isinstance(claimed, str):
            return False
        return hmac.compare_digest(claimed.lower(), hashlib.sha256(body).hexdigest())
    return True


def application_token(application_id: str, private_key_pem: str, ttl_s: float = 300.0) -> str:
    """A JWT for Vonage's REST API, signed with the application's private key."""
    now = int(time.time())
    claims = {
        "application_id": application_id,
        "iat": now,
        "exp": now + int(ttl_s),
        "jti": secrets.token_hex(16),
    }
    return jwt.encode(claims, private_key_pem, algorithm="RS256")
