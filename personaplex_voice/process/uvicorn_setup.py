"""The uvicorn settings and server class every HTTP process runs (the embedded server, each
cluster front-end). Imported only where uvicorn runs: importing it stays cheap."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from personaplex_voice.process.http_guard import protocol_classes
from personaplex_voice.process.settings import ServerSettings

BeforeClose = Callable[[], Awaitable[None]]


def uvicorn_config(settings: ServerSettings, app: object) -> Any:
    import uvicorn

    ssl_files = settings.ssl_files()
    http_protocol, ws_protocol = protocol_classes(settings.http_limits())
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        ssl_certfile=str(ssl_files[0]) if ssl_files else None,
        ssl_keyfile=str(ssl_files[1]) if ssl_files else None,
        log_level=settings.log_level.lower(),
        # Above our own per-message cap, so an oversize message gets a 0x05 from us, not a bare close.
        ws_max_size=max(16 * 1024 * 1024, 4 * settings.max_message_bytes),
        ws_per_message_deflate=False,  # Opus does not compress; deflate would only cost CPU
        # Request-line, header and head-timeout limits, and WebSocket upgrades that are always
        # answered (http_guard.py: uvicorn alone leaves all three open).
        http=http_protocol,
        ws=ws_protocol,
        timeout_keep_alive=settings.http_keepalive_timeout_s,
        timeout_graceful_shutdown=5,
        lifespan="on",
    )


def server_class() -> Any:
    """uvicorn.Server that runs `before_close` (ending the calls in words) before closing its
    sockets: uvicorn itself closes WebSockets with a bare 1012 on shutdown."""
    import uvicorn

    class CallEndingServer(uvicorn.Server):
        def __init__(self, config: uvicorn.Config, before_close: BeforeClose | None = None):
            super().__init__(config)
            self._before_close = before_close

        async def shutdown(self, sockets: list | None = None) -> None:
            if self._before_close is not None:
                await self._before_close()
            await super().shutdown(sockets)

    return CallEndingServer
