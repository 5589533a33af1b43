"""Twilio bridge: phone calls in and out over Media Streams, on the server's SessionManager.

`mount(app)` adds to a server app (one made by `personaplex_voice.server.app.create_app`):

| route                            | what                                                         |
| -------------------------------- | ------------------------------------------------------------ |
| `POST /twilio/voice`             | incoming-call webhook (signed): `<Connect><Stream>` or busy  |
| `WS /twilio/media-stream/{ticket}` | the call's audio, both ways (upgrade signed)               |
| `POST /twilio/status`            | call status callbacks (signed), recorded per call            |
| `POST /twilio/whisper`           | what a transfer's far end hears first (signed)               |
| `POST /twilio/call`              | place an outbound call (Bearer token)                        |
| `GET /twilio/calls[/{sid}[/recording]]` | live calls, call records, recordings (Bearer)         |
| `GET /calls`                     | the calls page                                               |

The rooms: wire.py (the Media Streams messages), media_stream.py (a stream's life cycle),
caller_audio.py and playout.py (audio in, audio out, paced by playback_buffer.py), phone_call.py
(a call across its streams: record, recording, actions), personas.py + context.py (who answers,
knowing what), actions.py, records.py, recording.py, webhooks.py, bridge.py (webhooks),
calls_api.py (what we show). See docs/twilio.md and docs/contact-center.md. The bridge knows
the session API and `personaplex_voice.audio`, never torch.
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
    """Add the `/twilio/*` routes to `app`; they use `app.state.host` (the session host).

    `http_client` replaces the HTTP layer of Twilio's REST client (tests, proxies).
    Raises `UserError` when the settings cannot work (no auth token while signatures are checked,
    an unreadable personas file).
    """
    from .bridge import TwilioBridge, records_dir_for
    from .calls import CallControl
    from .calls_api import build_router
    from .personas import PersonaBook

    settings = settings or TwilioSettings()
    settings.check()
    book = PersonaBook.load(settings.personas_file)
    # Process-wide interpreter settings (gc.freeze, the GIL switch interval) that keep the pacing
    # of every call on time are the server's job: its lifespan applies them once the engine is
    # loaded (personaplex_voice.process.runtime).
    control = CallControl(settings, http_client=http_client)
    bridge = TwilioBridge(app, settings, control, book, records_dir=records_dir_for(settings, app))
    app.state.twilio = bridge
    app.include_router(build_router(bridge))
