"""Run the embedded server (one process: the app, its engine and every transport) under uvicorn."""

from __future__ import annotations

import logging

from personaplex_voice.errors import UserError
from personaplex_voice.process import tls
from personaplex_voice.process.checks import check_files
from personaplex_voice.process.logs import configure_logging
from personaplex_voice.process.settings import ServerSettings
from personaplex_voice.process.uvicorn_setup import server_class, uvicorn_config


def run(settings: ServerSettings) -> None:
    """Serve until stopped; a model that fails to load stops the server with its error."""
    from personaplex_voice.audio.opus_library import require_opus

    require_opus()  # /api/chat speaks Ogg-Opus: a machine without libopus is told so, in one line
    from personaplex_voice.server.app import create_app, end_all_calls

    check_files(settings)
    configure_logging(settings)
    tls.prepare(settings)  # --ssl: the pair found and checked, or made when the directory has none

    failure: list[BaseException] = []
    server = None

    def on_load_error(exc: BaseException) -> None:
        failure.append(exc)
        if server is not None:
            server.should_exit = True

    app = create_app(settings, on_load_error=on_load_error)
    server = server_class()(uvicorn_config(settings, app), lambda: end_all_calls(app))
    logging.getLogger("personaplex_voice.server").info(
        "serving %s on %s://%s:%d/ (engine %s)",
        settings.model if settings.engine == "model" else "echo",
        settings.scheme,
        settings.host,
        settings.port,
        settings.engine,
    )
    server.run()
    if failure:
        exc = failure[0]
        if isinstance(exc, UserError):
            raise exc
        raise UserError(f"could not load the model: {exc}") from exc
