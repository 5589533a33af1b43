"""Telnyx: phone calls over TeXML and media streaming (bidirectional RTP), as a carrier of the
phone call (personaplex_phone).

| route                               | what                                                   |
| ----------------------------------- | ------------------------------------------------------ |
| `POST /telnyx/voice`                | the TeXML voice webhook (Ed25519): `<Connect><Stream>`  |
| `POST /telnyx/status`               | call status callbacks (signed)                         |
| `WS /telnyx/media-stream/{ticket}`  | the call's audio: the call's codec in, L16 16 kHz out  |
| `POST /telnyx/instructions/{token}` | TeXML of ours Telnyx fetches (signed)                  |

The rooms: wire.py (the stream's messages), texml.py (markup), control.py (Call Control and
TeXML REST), signatures.py (Ed25519), carrier.py, config.py, sim.py (Telnyx's side, for
`personaplex-voice phone simulate` and the tests). See docs/telnyx.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import TelnyxSettings

if TYPE_CHECKING:
    from .carrier import TelnyxCarrier

__all__ = ["TelnyxSettings", "make_carrier"]


def make_carrier(service: Any, settings: TelnyxSettings | None = None) -> TelnyxCarrier:
    """The Telnyx carrier for `service` (a personaplex_phone PhoneService)."""
    from personaplex_phone.carrier_kit import with_publisher

    from .carrier import TelnyxCarrier

    chosen, validate = settings or TelnyxSettings(), service.settings.validate_signatures
    return with_publisher(
        service, lambda publish: TelnyxCarrier(chosen, service.rest.send, publish, validate)
    )
