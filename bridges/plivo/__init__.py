"""Plivo: phone calls over Plivo XML and bidirectional audio streams, as a carrier of the phone
call (personaplex_phone).

| route                              | what                                                    |
| ---------------------------------- | ------------------------------------------------------- |
| `POST /plivo/answer`               | the Answer URL (V3-signed): `<Stream bidirectional>` or busy |
| `POST /plivo/hangup`               | the Hangup URL (signed)                                 |
| `WS /plivo/media-stream/{ticket}`  | the call's audio: L16 16 kHz (or μ-law 8 kHz) both ways |
| `POST /plivo/instructions/{token}` | Plivo XML of ours Plivo fetches (signed)                |

The rooms: wire.py, plivoxml.py, control.py (Voice API), signatures.py (V3), carrier.py,
config.py, sim.py (Plivo's side). See docs/plivo.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import PlivoSettings

if TYPE_CHECKING:
    from .carrier import PlivoCarrier

__all__ = ["PlivoSettings", "make_carrier"]


def make_carrier(service: Any, settings: PlivoSettings | None = None) -> PlivoCarrier:
    """The Plivo carrier for `service` (a personaplex_phone PhoneService)."""
    from personaplex_phone.carrier_kit import with_publisher

    from .carrier import PlivoCarrier

    chosen, validate = settings or PlivoSettings(), service.settings.validate_signatures
    return with_publisher(service, lambda publish: PlivoCarrier(chosen, service.rest.send, publish, validate))
