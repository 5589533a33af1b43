"""The carrier-neutral phone call: every phone line, natively, on the server's SessionManager.

`mount(app, ["twilio", "telnyx"])` (what `serve --carriers twilio,telnyx` does) adds to a server
app (one made by `personaplex_voice.server.app.create_app`) one `PhoneService` and each carrier:

| route                                 | what                                                     |
| ------------------------------------- | -------------------------------------------------------- |
| the answer webhook                    | `/twilio/voice`, `/telnyx/voice`, `/plivo/answer`, ...   |
| the status webhook                    | `/twilio/status`, `/plivo/hangup`, `/vonage/event`, ...  |
| `WS /<carrier>/media-stream/{ticket}` | the audio both ways (Genesys: `/genesys/audio-connector/*`) |
| `GET /phone/calls[/{id}[/recording]]` | calls, records, recordings (Bearer); also `/<carrier>/calls` |
| `GET /calls`                          | the calls page                                           |

The rooms: carrier.py (what a carrier implements), service.py (webhooks, tickets, answers),
stream.py (a stream's life cycle), caller_audio.py and playout.py (audio in, audio out, paced by
playback_buffer.py; formats in audio_path.py), phone_call.py (a call across its streams),
journal.py (the one writer of a call's record), personas.py + context.py + actions.py (who
answers, knowing what, doing what), records.py, recording.py, webhooks.py, calls_api.py (what we
show); what carriers share of their own parts: carrier_kit.py, wire_json.py, xml_markup.py,
sim_sides.py. See docs/phone.md. The phone call knows the session API and `personaplex_voice.audio`,
never torch; a carrier knows this package, never another carrier.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from personaplex_voice.errors import UserError

from .config import PhoneSettings

if TYPE_CHECKING:
    from fastapi import FastAPI

    from .carrier import Carrier
    from .service import PhoneService

__all__ = ["CARRIERS", "PhoneSettings", "add_carrier", "mount", "phone_service"]

# Carrier name -> its package. Each package has `make_carrier(service, settings=None, **options)`.
CARRIERS: dict[str, str] = {
    "twilio": "personaplex_twilio",
    "telnyx": "personaplex_telnyx",
    "plivo": "personaplex_plivo",
    "vonage": "personaplex_vonage",
    "exotel": "personaplex_exotel",
    "asterisk": "personaplex_asterisk",
    "jambonz": "personaplex_jambonz",
    "genesys": "personaplex_genesys",
}


def parse_carriers(names: str | Sequence[str]) -> list[str]:
    """`"twilio, Telnyx"` -> ["twilio", "telnyx"], each known, none twice."""
    items = names.split(",") if isinstance(names, str) else list(names)
    chosen: list[str] = []
    for item in items:
        name = item.strip().lower()
        if not name:
            continue
        if name not in CARRIERS:
            raise UserError(f"unknown carrier {name!r} (known: {', '.join(CARRIERS)})")
        if name not in chosen:
            chosen.append(name)
    return chosen


def phone_service(app: FastAPI, settings: PhoneSettings | None = None) -> PhoneService:
    """The app's phone service, created (with `settings`, else from the environment) at first use."""
    service = getattr(app.state, "phone", None)
    if service is not None:
        return service
    from .calls_api import service_router
    from .personas import PersonaBook
    from .service import PhoneService, records_dir_for

    settings = settings or PhoneSettings()
    book = PersonaBook.load(settings.personas_file)
    service = PhoneService(app, settings, book, records_dir_for(settings, app))
    app.state.phone = service
    app.include_router(service_router(service))
    return service


def add_carrier(app: FastAPI, carrier: Carrier) -> None:
    """Mount `carrier` on the app's phone service (its webhooks, stream and extra routes)."""
    from .calls_api import carrier_router

    service = phone_service(app)
    if carrier.name in service.carriers:
        raise UserError(f"carrier {carrier.name} is mounted twice")
    carrier.check()
    service.carriers[carrier.name] = carrier
    # The carrier's own routes first: where one has the path of a generic one, the carrier's wins.
    extra = getattr(carrier, "routes", None)
    if callable(extra):
        router = extra(service)
        if router is not None:
            app.include_router(router)
    app.include_router(carrier_router(service, carrier))


def mount(
    app: FastAPI,
    names: str | Sequence[str],
    settings: PhoneSettings | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
) -> PhoneService:
    """Mount the named carriers (`options[name]` are keywords for that carrier's factory)."""
    service = phone_service(app, settings)
    for name in parse_carriers(names):
        try:
            package = importlib.import_module(CARRIERS[name])
        except ImportError as exc:
            raise UserError(
                f"carrier {name} needs its bridge and the phone extra: "
                f"pip install 'personaplex-voice[phone]' ({exc})"
            ) from None
        add_carrier(app, package.make_carrier(service, **dict((options or {}).get(name, {}))))
    return service
