"""WebRTC for browsers and apps: the same sessions over WHIP (RFC 9725) and Pipecat's
small-WebRTC offer API, on aiortc (the `webrtc` extra). See docs/webrtc.md.

`mount(app)` adds the endpoints to the server's app (every process that serves it: the embedded
server and each cluster front-end). aiortc is imported when the app starts, off the event loop
(it takes about a second), never when this package is: a server without the extra starts, and
its WebRTC endpoints answer 501 saying what to install.

| module | job |
| --- | --- |
| `routes.py` | the HTTP endpoints, their refusals |
| `service.py` | the process's calls by id, settings, metrics |
| `call.py` | one call: peer connection, session, data channel, how it ends |
| `caller_audio.py` | the caller's RTP → 24 kHz PCM: FEC, concealment, DTX, late packets |
| `agent_audio.py` | session frames → paced Opus packets (an aiortc track) |
| `dialects.py` | the data channel's messages: /api/chat kinds, or Pipecat's RTVI |
| `sdp.py`, `ice.py`, `params.py` | offers and answers, STUN/TURN, the persona from a request |
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from personaplex_voice.server.webrtc.service import WebRTCService

__all__ = ["INSTALL_HINT", "WebRTCService", "mount"]

log = logging.getLogger("personaplex_voice.server.webrtc")

INSTALL_HINT = "WebRTC needs aiortc: pip install 'personaplex-voice[webrtc]'"


def _load_aiortc() -> str | None:
    """None when aiortc (and its PyAV) import; otherwise why not, in one line."""
    try:
        import aiortc  # noqa: F401
        import av  # noqa: F401
    except ImportError as exc:
        return f"{INSTALL_HINT} ({exc})"
    return None


def mount(app: Any) -> WebRTCService:
    """The WebRTC endpoints on `app` (its settings are `app.state.settings`)."""
    from personaplex_voice.server.webrtc.routes import router

    settings = app.state.settings
    service = WebRTCService(settings)
    app.state.webrtc = service
    if settings.log_level.lower() != "debug":
        # aioice logs every candidate pair's state change at INFO: ten lines a call.
        logging.getLogger("aioice").setLevel(logging.WARNING)
    app.state.metric_sources.append(service.snapshots)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        reason = await asyncio.to_thread(_load_aiortc)
        service.available = reason is None
        service.unavailable_reason = reason or ""
        if reason is not None:
            log.warning("the WebRTC endpoints answer 501: %s", reason)
        try:
            yield
        finally:
            await service.close_all()

    app.include_router(router(lifespan))
    return service
