"""Asterisk: calls of your own PBX over AudioSocket or chan_websocket, as a carrier of the phone call.

`serve --carriers asterisk` (and `--audiosocket HOST:PORT` for the TCP listener) adds:

| route                                   | what                                                     |
| --------------------------------------- | -------------------------------------------------------- |
| `POST /asterisk/calls`                  | the dialplan asks for a call (API key): `{"uuid": …}`    |
| AudioSocket on `HOST:PORT` (TCP)        | `AudioSocket(uuid,host:port)` / `Dial(AudioSocket/…)`    |
| `WS /asterisk/media?ticket=UUID`        | chan_websocket (`Dial(WebSocket/conn/c(slin16)v(ticket=…))`) |
| `GET /asterisk/calls/{uuid}/next`       | what the dialplan does after our leg (API key)           |
| `GET /asterisk/calls[/{id}[/recording]]` | calls, records, recordings (as on every carrier)        |

The rooms: audiosocket.py and media_ws.py (the two wire formats; they import nothing of ours),
wire.py (them as the phone call's events), listener.py (the TCP listener and its link),
tickets.py (UUIDs, next steps), control.py (actions: the dialplan or ARI), carrier.py,
config.py, simulate.py (an Asterisk of each kind, for `phone simulate`, tests and benchmarks).
See docs/asterisk.md. It imports the phone call and `personaplex_voice`, no other carrier.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import AsteriskSettings, parse_listen

if TYPE_CHECKING:
    from .carrier import AsteriskCarrier

__all__ = ["AsteriskSettings", "make_carrier"]


def make_carrier(
    service: Any, settings: AsteriskSettings | None = None, audiosocket: str | None = None
) -> AsteriskCarrier:
    """The Asterisk carrier for `service` (a personaplex_phone PhoneService). `audiosocket`
    (HOST:PORT) overrides the settings' and the server's `--audiosocket`."""
    from personaplex_voice.errors import UserError

    from .carrier import AsteriskCarrier

    settings = settings or AsteriskSettings()
    server = getattr(service.app.state, "settings", None)
    listen = audiosocket or settings.audiosocket or getattr(server, "audiosocket", "") or ""
    if getattr(server, "workers", 0) > 1:
        # A UUID is known to the process that issued it; the dialplan's request and the media
        # leg must reach the same one.
        raise UserError("asterisk needs one front-end process: serve it with --workers 0 or 1")
    return AsteriskCarrier(service, settings, parse_listen(listen) if listen else None)
