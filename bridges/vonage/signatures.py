"""Vonage signed webhooks: a JWT in `Authorization: Bearer …`, HS256 with the signature secret.

Its claims: `iat` (when Vonage signed it: too old and the request is refused, a replay),
`payload_hash`, `jti`, `api_key`, `application_id`. PyJWT checks the signature.

`payload_hash` binds the request's payload to the token, as Vonage's support article "How do I
verify that the Voice API Webhook request and its payload has not been tampered during transit?"
(api.support.vonage.com, article 19033783342876) describes it: an object of the query parameters
for a GET, or of the request body for a POST, its properties in the parameters' order, written as
JSON with no whitespace, then SHA-256 (hex). A request that carries a payload must carry its hash
(a captured token cannot be replayed with other parameters); a POST body is also accepted hashed
as sent, byte for byte (the same thing when Vonage's JSON is compact).

Our REST requests are authorised the other way round: a short-lived RS256 JWT of our own, signed
with the application's private key (`application_id`, `iat`, `exp`, `jti`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Mapping, Sequence

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


def compact_json(value: object) -> bytes:
    """JSON as JavaScript's `JSON.stringify` writes it: no whitespace, non-ASCII as is."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def payload_hashes(method: str, query: Sequence[tuple[str, str]], body: bytes) -> set[str]:
    """The `payload_hash` values that fit this request (empty: it carries no payload)."""
    if method.upper() == "GET" or not body:
        if not query:
            return set()
        # One property per name, in the order the names first appear (a later repeat of a name
        # replaces its value, as assigning to a JavaScript object does).
        params: dict[str, str] = {}
        for key, value in query:
            params[key] = value
        return {hashlib.sha256(compact_json(params)).hexdigest()}
    hashes = {hashlib.sha256(body).hexdigest()}
    try:
        parsed = untrusted.loads(body)
    except untrusted.InputRefused:
        return hashes
    return hashes | {hashlib.sha256(compact_json(parsed)).hexdigest()}


def verify(
    secret: str,
    headers: Mapping[str, str],
    body: bytes,
    max_age_s: float,
    now: float | None = None,
    *,
    method: str = "POST",
    query: Sequence[tuple[str, str]] = (),
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
    expected = payload_hashes(method, query, body)
    if not expected and claimed is None:
        return True  # nothing to bind: a GET without parameters
    if not isinstance(claimed, str):
        return False  # a payload without its hash: it could have been swapped
    if not expected:
        expected = {hashlib.sha256(b"{}").hexdigest()}  # an empty object's hash
    # Bytes, not str: compare_digest refuses a str with non-ASCII characters (a forged claim).
    given = claimed.lower().encode()
    return any(hmac.compare_digest(given, candidate.encode()) for candidate in expected)


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
