"""Exotel: phone calls over the Voicebot applet's bidirectional stream, as a carrier of the phone
call (personaplex_phone).

| route                               | what                                                  |
| ----------------------------------- | ----------------------------------------------------- |
| `GET /exotel/answer?token=…`        | the Voicebot applet's dynamic URL: `{"url": …}`       |
| `POST /exotel/status?token=…`       | status callbacks                                      |
| `WS /exotel/media-stream/{ticket}`  | the call's audio (HTTP Basic): PCM 8 kHz (16, 24) both ways |

The rooms: wire.py, control.py (Legs API, ExoML), signatures.py (the URL token, Basic),
carrier.py, config.py, sim.py (Exotel's side). See docs/exotel.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import ExotelSettings

if TYPE_CHECKING:
    from .carrier import ExotelCarrier

__all__ = ["ExotelSettings", "make_carrier"]


def make_carrier(service: Any, settings: ExotelSettings | None = None) -> ExotelCarrier:
    """The Exotel carrier for `service` (a personaplex_phone PhoneService)."""
    from .carrier import ExotelCarrier

    return ExotelCarrier(
        settings or ExotelSettings(), service.rest.send, service.settings.validate_signatures
    )
