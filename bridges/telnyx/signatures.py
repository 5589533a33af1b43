"""Telnyx webhook signatures: Ed25519 over `timestamp|body`, fresh timestamps only.

Telnyx signs every webhook with its account key: header `telnyx-signature-ed25519` is the base64
signature of the bytes `<telnyx-timestamp>|<raw body>`, `telnyx-timestamp` the signing time in
Unix seconds. Checked against `TELNYX_PUBLIC_KEY` (base64 of the raw 32-byte public key); a
timestamp further than the tolerance from our clock is refused, so a captured webhook cannot be
replayed later.
"""

from __future__ import annotations

import base64
import binascii
import time

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from personaplex_voice import untrusted

SIGNATURE_HEADER = "telnyx-signature-ed25519"
TIMESTAMP_HEADER = "telnyx-timestamp"
TIMESTAMP_DIGITS = 12  # Unix seconds, ASCII digits only (a longer number is no time of ours)


def load_public_key(text: str) -> Ed25519PublicKey | None:
    """TELNYX_PUBLIC_KEY as a key (None when empty); ValueError naming what is wrong."""
    if not text:
        return None
    try:
        raw = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("TELNYX_PUBLIC_KEY is not base64") from None
    if len(raw) != 32:
        raise ValueError(f"TELNYX_PUBLIC_KEY must be a 32-byte Ed25519 key, got {len(raw)} bytes")
    return Ed25519PublicKey.from_public_bytes(raw)


def signed_message(timestamp: str, body: bytes) -> bytes:
    return timestamp.encode("ascii", "replace") + b"|" + body


def verify(
    key: Ed25519PublicKey | None,
    signature: str | None,
    timestamp: str | None,
    body: bytes,
    tolerance_s: float,
    now: float | None = None,
) -> bool:
    if key is None or not signature or not timestamp:
        return False
    try:
        signed_at = untrusted.ascii_int(timestamp, TIMESTAMP_DIGITS)
        raw = base64.b64decode(signature, validate=True)
    except (ValueError, binascii.Error):  # InputRefused is a ValueError
        return False
    if abs((time.time() if now is None else now) - signed_at) > tolerance_s:
        return False  # stale (or from the future): a replay, never a live webhook
    try:
        key.verify(raw, signed_message(timestamp, body))
    except InvalidSignature:
        return False
    return True
