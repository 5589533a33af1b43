"""jambonz: phone calls from any SIP trunk through a jambonz application whose `listen` verb
streams the call's audio to us, as a carrier of the phone call (personaplex_phone).

| route                                  | what                                                   |
| -------------------------------------- | ------------------------------------------------------ |
| `POST /jambonz/call`                   | the application's calling webhook (signed): a `listen` |
| `POST /jambonz/status`                 | its call status webhook (signed)                       |
| `WS /jambonz/media-stream/{ticket}`    | the listen: binary L16 both ways (`audio.jambonz.org`) |
| `POST /jambonz/action`                 | the listen's actionHook (signed): what the call does next |
| `GET/POST /jambonz/instructions/{token}` | verbs of ours jambonz fetches (a transfer's whisper) |

The rooms: wire.py (the listen socket's messages), verbs.py (our applications), control.py (call
control through the actionHook), signatures.py, carrier.py, config.py, sim.py (jambonz's side,
for the simulator). See docs/jambonz.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import JambonzSettings

if TYPE_CHECKING:
    from .carrier import JambonzCarrier

__all__ = ["JambonzSettings", "make_carrier"]


def make_carrier(service: Any, settings: JambonzSettings | None = None) -> JambonzCarrier:
    """The jambonz carrier for `service` (a personaplex_phone PhoneService)."""
    from personaplex_phone.carrier_kit import with_publisher

    from .carrier import JambonzCarrier

    chosen, validate = settings or JambonzSettings(), service.settings.validate_signatures
    return with_publisher(service, lambda publish: JambonzCarrier(chosen, publish, validate))
