"""jambonz webhook signatures: `Jambonz-Signature: t=<unix seconds>,v1=<hex>`.

The hex is HMAC-SHA256, keyed by the account's webhook secret, of `"<t>.<raw body>"`. The time
makes a replay detectable: a signature further than `max_age_s` from now (either way) is
refused. A header may carry several `v1` values (a secret being rotated): one match is enough.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Mapping

from personaplex_voice import untrusted

HEADER = "jambonz-signature"
TIMESTAMP_DIGITS = 12  # `t`: Unix seconds, ASCII digits only


def sign(secret: str, body: bytes, timestamp: int | None = None) -> str:
    """The header value jambonz would send for `body` (the simulator's, and the tests')."""
    t = int(time.time()) if timestamp is None else timestamp
    digest = hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={t},v1={digest}"


def verify(
    secret: str, headers: Mapping[str, str], body: bytes, max_age_s: float, now: float | None = None
) -> bool:
    value = headers.get(HEADER, "")
    if not secret or not value or len(value) > 1024:
        return False
    stamp, given = "", []
    for item in value.split(","):
        key, _, part = item.strip().partition("=")
        if key == "t":
            stamp = part
        elif key == "v1":
            given.append(part.lower())
    try:
        signed_at = untrusted.ascii_int(stamp, TIMESTAMP_DIGITS)
    except untrusted.InputRefused:
        return False
    if not given or abs((time.time() if now is None else now) - signed_at) > max_age_s:
        return False
    expected = hmac.new(secret.encode(), stamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    # Bytes: comparing a str with non-ASCII characters (a forged header's) raises TypeError.
    return any(hmac.compare_digest(expected.encode(), g.encode()) for g in given)
