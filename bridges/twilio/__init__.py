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
    import gc
    import sys

    from .bridge import TwilioBridge, build_router
    from .calls import CallControl
    from .personas import PersonaBook

    settings = settings or TwilioSettings()
    settings.check()
    book = PersonaBook.load(settings.personas_file)
    # A full garbage collection walks every object alive (FastAPI, pydantic, numpy, twilio...):
    # ~50 ms on a small CPU, a pause every live call's 20 ms pacing feels at once (Twilio runs
    # dry). Objects that exist by now live as long as the process: take them out of collection.
    gc.freeze()
    # The engine's frame clock runs on the inference thread; with many calls the event loop holds
    # the GIL nearly all the time and the default 5 ms hand-over interval, paid several times per
    # tick, made ticks ~50 ms late at 25 calls. 1 ms keeps them within the playout cushion.
    sys.setswitchinterval(min(sys.getswitchinterval(), 0.001))
    bridge = TwilioBridge(app, settings, CallControl(settings, http_client=http_client), book)
    app.state.twilio = bridge
    app.include_router(build_router(bridge))
