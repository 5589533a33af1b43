"""Vonage signed webhooks: a JWT in `Authorization: Bearer …`, HS256 with the signature secret.

Its claims: `iat` (when Vonage signed it: too old and the request is refused, a replay),
`payload_hash` (SHA-256 hex of the raw body, present when there is one: the body cannot be
swapped), `jti`, `api_key`, `application_id`. PyJWT checks the signature.

Our REST requests are authorised the other way round: a short-lived RS256 JWT of our own, signed
with the application's private key (`application_id`, `iat`, `exp`, `jti`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import time
from collections.abc import Mapping

import jwt

from personaplex_voice import untrusted

# A token's header and claims: small objects, read with the bounded reader before PyJWT reads
# them with the standard one; `iat` is a time in Unix seconds, not any number.
JWT_LIMITS = untrusted.JsonLimits(max_bytes=8192, max_depth=8)
MAX_IAT = 2.0**40


def bearer(headers: Mapping[str, str]) -> str:
    value = headers.get("authorization", "")
    return value[7:].strip() if value.lower().startswith("bearer ") else ""


def readable(token: str) -> bool:
    """The token's header and claims are JSON objects within JWT_LIMITS."""
    parts = token.split(".")
    if len(parts) != 3:
        return False
    try:
        for part in parts[:2]:
            padded = part + "=" * (-len(part) % 4)
            untrusted.loads_object(base64.urlsafe_b64decode(padded), JWT_LIMITS, "a JWT part")
    except (ValueError, binascii.Error):  # InputRefused is a ValueError
        return False
    return True


def verify(
    secret: str, headers: Mapping[str, str], body: bytes, max_age_s: float, now: float | None = None
) -> bool:
    token = bearer(headers)
    if not secret or not token or not readable(token):
        return False
    try:
        claims = jwt.decode(
            token, secret, algorithms=["HS256"], options={"require": ["iat"], "verify_iat": False}
        )
    except jwt.PyJWTError:
        return False
    issued = untrusted.finite_number(claims.get("iat"), 0.0, MAX_IAT)
    if issued is None or abs((time.time() if now is None else now) - issued) > max_age_s:
        return False
    claimed = claims.get("payload_hash")
    if body or claimed is not None:
        if not isinstance(claimed, str):
            return False
        return hmac.compare_digest(claimed.lower().encode(), hashlib.sha256(body).hexdigest().encode())
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
