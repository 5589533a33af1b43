"""Twilio bridge: phone calls in and out over Media Streams, on the server's SessionManager.

`mount(app)` adds to a server app (one made by `personaplex_voice.server.app.create_app`):

| route                        | what                                                         |
| ---------------------------- | ------------------------------------------------------------ |
| `POST /twilio/voice`         | incoming-call webhook (signed): `<Connect><Stream>` or busy  |
| `WS /twilio/media-stream`    | the call's audio, both ways (upgrade signed)                 |
| `POST /twilio/status`        | call status callbacks (signed), recorded per call            |
| `POST /twilio/call`          | place an outbound call (Bearer token)                        |
| `GET /twilio/calls`          | live streams with their metrics, recent call history (Bearer) |

See docs/twilio.md. The bridge knows the session API and `personaplex_voice.audio`, never torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .config import TwilioSettings

if TYPE_CHECKING:
    from fastapi import FastAPI

    from twilio.http import HttpClient

__all__ = ["TwilioSettings", "mount"]


def mount(
    app: FastAPI, settings: TwilioSettings | None = None, *, http_client: HttpClient | None = None
) -> None:
    """Add the `/twilio/*` routes to `app`; they use `app.state.manager`.

    `http_client` replaces the HTTP layer of Twilio's REST client (tests, proxies).
    Raises `UserError` when the settings cannot work (no auth token while signatures are checked,
    an unreadable personas file).
    """
    from .bridge import TwilioBridge, build_router
    from .calls import CallControl
    from .personas import PersonaBook

    settings = settings or TwilioSettings()
    settings.check()
    book = PersonaBook.load(settings.personas_file)
    # Process-wide interpreter settings (gc.freeze, the GIL switch interval) that keep the pacing
    # of every call on time are the server's job: its lifespan applies them once the engine is
    # loaded (personaplex_voice.server.runtime).
    bridge = TwilioBridge(app, settings, CallControl(settings, http_client=http_client), book)
    app.state.twilio = bridge
    app.include_router(build_router(bridge))
