"""Plivo's V3 request signatures, built exactly as Plivo builds them.

Plivo signs each request to us with HMAC-SHA256 keyed by the auth token, over a string made of
the request URL and its parameters, then a dot and the request's nonce:

- the URL without its query string (scheme, host, path);
- for a GET: `?` and the query's pairs `key=value`, sorted, joined with `&` (none: nothing);
- for a POST: `?`, the sorted query pairs and a `.` when there is a query, then the form's
  pairs sorted by key, each written `keyvalue` with nothing between (a POST without form fields
  is signed like a GET);
- a repeated key contributes each of its values, sorted;
- `.` + the `X-Plivo-Signature-V3-Nonce` header.

The base64 digest must equal one of the comma-separated signatures in `X-Plivo-Signature-V3`
(Plivo sends several while an auth token is being rotated). Values are the decoded ones.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Mapping, Sequence
from urllib.parse import parse_qsl, urlsplit, urlunsplit

SIGNATURE_HEADER = "x-plivo-signature-v3"
NONCE_HEADER = "x-plivo-signature-v3-nonce"

Pairs = Sequence[tuple[str, str]]


def _grouped(pairs: Pairs) -> list[tuple[str, list[str]]]:
    groups: dict[str, list[str]] = {}
    for key, value in pairs:
        groups.setdefault(key, []).append(value)
    return [(key, sorted(values)) for key, values in sorted(groups.items())]


def _query_string(pairs: Pairs) -> str:
    return "&".join(f"{key}={value}" for key, values in _grouped(pairs) for value in values)


def _form_string(pairs: Pairs) -> str:
    return "".join(f"{key}{value}" for key, values in _grouped(pairs) for value in values)


def signed_string(method: str, url: str, form: Pairs = ()) -> str:
    """What Plivo signs for a request (before `.nonce`)."""
    parts = urlsplit(url)
    base = urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
    query = _query_string(parse_qsl(parts.query, keep_blank_values=True))
    if method.upper() == "GET" or not form:
        return base + (f"?{query}" if query else "")
    return base + "?" + (f"{query}." if query else "") + _form_string(form)


def signature(auth_token: str, method: str, url: str, nonce: str, form: Pairs = ()) -> str:
    digest = hmac.new(
        auth_token.encode(), f"{signed_string(method, url, form)}.{nonce}".encode(), hashlib.sha256
    ).digest()
    return base64.b64encode(digest).decode("ascii")


def verify(auth_token: str, method: str, url: str, headers: Mapping[str, str], form: Pairs = ()) -> bool:
    given, nonce = headers.get(SIGNATURE_HEADER, ""), headers.get(NONCE_HEADER, "")
    if not auth_token or not given or not nonce:
        return False
    expected = signature(auth_token, method, url, nonce, form)
    # Bytes: comparing a str with non-ASCII characters (a forged header's) raises TypeError.
    return any(hmac.compare_digest(expected.encode(), c.strip().encode()) for c in given.split(","))
