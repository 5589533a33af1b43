"""Vonage: phone calls over NCCOs and the WebSocket endpoint (binary L16), as a carrier of the
phone call (personaplex_phone).

| route                               | what                                                  |
| ----------------------------------- | ----------------------------------------------------- |
| `GET /vonage/answer`                | the answer URL (signed JWT): an NCCO `connect`        |
| `POST /vonage/event`                | the event URL (signed JWT): call status               |
| `WS /vonage/media-stream/{ticket}`  | the call's audio: binary L16 16 kHz, 640 B per 20 ms  |
| `GET/POST /vonage/instructions/{token}` | NCCOs of ours Vonage fetches (signed)             |

The rooms: wire.py, ncco.py, control.py (Voice API), signatures.py (JWTs), carrier.py,
config.py, sim.py (Vonage's side). See docs/vonage.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import VonageSettings

if TYPE_CHECKING:
    from .carrier import VonageCarrier

__all__ = ["VonageSettings", "make_carrier"]


def make_carrier(service: Any, settings: VonageSettings | None = None) -> VonageCarrier:
    """The Vonage carrier for `service` (a personaplex_phone PhoneService)."""
    from personaplex_phone.carrier_kit import with_publisher

    from .carrier import VonageCarrier

    chosen, validate = settings or VonageSettings(), service.settings.validate_signatures
    return with_publisher(
        service, lambda publish: VonageCarrier(chosen, service.rest.send, publish, validate)
    )
