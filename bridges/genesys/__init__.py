"""Genesys Cloud: an Architect flow's *Call Audio Connector* action streams the call to us (the
AudioHook protocol, bidirectional), as a carrier of the phone call (personaplex_phone).

| route                             | what                                                      |
| --------------------------------- | --------------------------------------------------------- |
| `WS /genesys/audio-connector[/…]` | one session per call: `X-API-KEY` (and a signature) checked, |
|                                   | `open` admits the call, PCMU 8 kHz both ways, the outcome |
|                                   | back in `disconnect` / `closed`                           |

No webhooks, no REST: the session carries the call's facts in, its audio both ways and the
agent's outcome back to the flow, which routes the call next. The rooms: wire.py (the AudioHook
messages), control.py (instructions -> output variables), httpsig.py (the signed upgrade),
carrier.py, config.py, sim.py (Genesys's side, for the simulator). See docs/genesys.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import GenesysSettings

if TYPE_CHECKING:
    from .carrier import GenesysCarrier

__all__ = ["GenesysSettings", "make_carrier"]


def make_carrier(service: Any, settings: GenesysSettings | None = None) -> GenesysCarrier:
    """The Genesys carrier for `service` (a personaplex_phone PhoneService)."""
    from .carrier import GenesysCarrier

    return GenesysCarrier(
        settings or GenesysSettings(), service.settings, service.settings.validate_signatures
    )
