"""The URLs carriers use to reach us, rebuilt from `PUBLIC_URL` (signatures are over them).

Behind a proxy or tunnel the server does not see the URL the carrier used, so it is rebuilt from
`PUBLIC_URL` and the request's path and query; without `PUBLIC_URL` the request's own Host
header is used, which is right only when the carrier reaches the server directly.
"""

from __future__ import annotations

from starlette.requests import HTTPConnection

from .config import PhoneSettings


def public_base(settings: PhoneSettings, conn: HTTPConnection) -> str:
    """`https://host[:port][/prefix]` the carrier uses to reach this app (no trailing slash)."""
    if settings.public_url:
        return settings.public_url
    url = conn.url
    scheme = {"ws": "http", "wss": "https"}.get(url.scheme, url.scheme)
    return f"{scheme}://{url.netloc}"


def websocket_base(http_base: str) -> str:
    """The WebSocket flavour of a base URL: https -> wss, http -> ws."""
    if http_base.startswith("https://"):
        return "wss://" + http_base[len("https://") :]
    if http_base.startswith("http://"):
        return "ws://" + http_base[len("http://") :]
    return http_base


def public_url_of(settings: PhoneSettings, conn: HTTPConnection) -> str:
    """The URL the carrier requested, as it saw it (path relative to the app's root)."""
    path = conn.url.path
    root = conn.scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    url = public_base(settings, conn) + path
    if conn.url.query:
        url += "?" + conn.url.query
    return url
