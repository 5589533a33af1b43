"""Twilio: phone calls in and out over Media Streams, as a carrier of the phone call.

`mount(app)` adds Twilio to a server app (one made by `personaplex_voice.server.app.create_app`),
on the app's phone service (personaplex_phone; created here when it is the first carrier):

| route                            | what                                                         |
| -------------------------------- | ------------------------------------------------------------ |
| `POST /twilio/voice`             | incoming-call webhook (signed): `<Connect><Stream>` or busy  |
| `WS /twilio/media-stream/{ticket}` | the call's audio, both ways (upgrade signed)               |
| `POST /twilio/status`            | call status callbacks (signed), recorded per call            |
| `POST /twilio/whisper`           | what a transfer's far end hears first (signed)               |
| `POST /twilio/call`              | place an outbound call (Bearer token)                        |
| `GET /twilio/calls[/{sid}[/recording]]` | live calls, call records, recordings (Bearer)         |

The rooms: wire.py (the Media Streams messages; imports nothing of ours), carrier.py (Twilio as
the phone call sees it), twiml.py, calls.py (REST), signatures.py, outbound.py (outbound calls,
whispers), config.py, cli.py (`personaplex-voice call`). See docs/twilio.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import TwilioSettings

if TYPE_CHECKING:
    from fastapi import FastAPI

    from twilio.http import HttpClient

    from .carrier import TwilioCarrier

__all__ = ["TwilioSettings", "make_carrier", "mount"]


def make_carrier(
    service: Any, settings: TwilioSettings | None = None, http_client: HttpClient | None = None
) -> TwilioCarrier:
    """The Twilio carrier for `service` (a personaplex_phone PhoneService)."""
    from .calls import CallControl
    from .carrier import TwilioCarrier

    settings = settings or TwilioSettings()
    return TwilioCarrier(
        settings, CallControl(settings, http_client=http_client), service.settings.max_message_bytes
    )


def mount(
    app: FastAPI, settings: TwilioSettings | None = None, *, http_client: HttpClient | None = None
) -> None:
    """Add the `/twilio/*` routes to `app`; they use `app.state.host` (the session host).

    `settings` also configure the phone call when Twilio is the first carrier mounted (a
    `TwilioSettings` holds the phone call's settings too). `http_client` replaces the HTTP layer of
    Twilio's REST client (tests, proxies). Raises `UserError` when the settings cannot work (no auth
    token while signatures are checked, an unreadable personas file).
    """
    from personaplex_phone import add_carrier, phone_service

    settings = settings or TwilioSettings()
    settings.check()
    service = phone_service(app, settings)
    twilio = make_carrier(service, settings, http_client)
    add_carrier(app, twilio)
    app.state.twilio = twilio
