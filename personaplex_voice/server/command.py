"""`personaplex-voice serve`: run the server under uvicorn.

Every flag has a `PERSONAPLEX_<NAME>` environment variable (e.g. `PERSONAPLEX_MAX_SESSIONS=8`);
a flag given on the command line wins over the environment. Defaults live in `ServerSettings`.
"""

from __future__ import annotations

import logging
import re
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from personaplex_voice.cli_options import (
    DeviceOpt,
    DtypeOpt,
    KvDtype,
    MimiWeightOpt,
    ModelOpt,
    MoshiWeightOpt,
    PrefillMode,
    QuantizeMode,
    ThreadsOpt,
    TokenizerOpt,
    VoiceDirOpt,
)
from personaplex_voice.errors import UserError
from personaplex_voice.server.config import ServerSettings
from personaplex_voice.server.http_guard import (
    AppLogsItsRefusals,
    ClientMistakesAreWarnings,
    protocol_classes,
)


def serve(
    host: Annotated[
        str | None, typer.Option(help="Interface to bind (env PERSONAPLEX_HOST; default 127.0.0.1)")
    ] = None,
    port: Annotated[int | None, typer.Option(help="TCP port (env PERSONAPLEX_PORT; default 8998)")] = None,
    model: ModelOpt = None,  # type: ignore[assignment]  # None: PERSONAPLEX_MODEL or the default
    moshi_weight: MoshiWeightOpt = None,
    mimi_weight: MimiWeightOpt = None,
    tokenizer: TokenizerOpt = None,
    voice_prompt_dir: VoiceDirOpt = None,
    device: DeviceOpt = None,  # type: ignore[assignment]
    dtype: DtypeOpt = None,  # type: ignore[assignment]
    threads: ThreadsOpt = None,  # type: ignore[assignment]
    prefill: Annotated[
        PrefillMode | None,
        typer.Option(
            help="System prompts: parallel (fast) or stepwise (bit for bit the published run) "
            "(env PERSONAPLEX_PREFILL; parallel)"
        ),
    ] = None,
    quantize: Annotated[
        QuantizeMode | None,
        typer.Option(help="int8: the LM's linear weights as int8 (env PERSONAPLEX_QUANTIZE; none)"),
    ] = None,
    kv_dtype: Annotated[
        KvDtype | None,
        typer.Option(
            help="The LM's KV cache: auto (LM dtype), bfloat16, float16, float32, float8 "
            "(env PERSONAPLEX_KV_DTYPE; auto)"
        ),
    ] = None,
    max_sessions: Annotated[
        int | None,
        typer.Option(help="Concurrent conversations = batch slots (env PERSONAPLEX_MAX_SESSIONS; 4)"),
    ] = None,
    max_queue: Annotated[
        int | None, typer.Option(help="Callers that may wait for a free slot (env PERSONAPLEX_MAX_QUEUE; 0)")
    ] = None,
    max_call_s: Annotated[
        float | None,
        typer.Option(help="End a call after this many seconds, 0 = never (env PERSONAPLEX_MAX_CALL_S; 3600)"),
    ] = None,
    idle_timeout_s: Annotated[
        float | None,
        typer.Option(
            help="End a call after this many seconds without audio, 0 = never "
            "(env PERSONAPLEX_IDLE_TIMEOUT_S; 60)"
        ),
    ] = None,
    persona_cache_mb: Annotated[
        float | None,
        typer.Option(
            help="Memory for prefilled personas (slot snapshots), 0 = off "
            "(env PERSONAPLEX_PERSONA_CACHE_MB; 1024)"
        ),
    ] = None,
    ssl: Annotated[
        Path | None,
        typer.Option(help="Directory with cert.pem and key.pem: serve https/wss (env PERSONAPLEX_SSL)"),
    ] = None,
    voice_dir: Annotated[
        Path | None,
        typer.Option(help="Same as --voice-prompt-dir (env PERSONAPLEX_VOICE_DIR)"),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(help="Require this key (?token=, Bearer or X-API-Key) (env PERSONAPLEX_API_KEY)"),
    ] = None,
    allowed_origins: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated browser origins allowed on /api/chat (env PERSONAPLEX_ALLOWED_ORIGINS)"
        ),
    ] = None,
    engine: Annotated[
        str | None,
        typer.Option(help="`model` (PersonaPlex) or `echo` (loopback, no torch) (env PERSONAPLEX_ENGINE)"),
    ] = None,
    twilio: Annotated[
        bool | None,
        typer.Option(
            "--twilio/--no-twilio", help="Mount the Twilio bridge at /twilio (env PERSONAPLEX_TWILIO)"
        ),
    ] = None,
    records_dir: Annotated[
        Path | None,
        typer.Option(
            help="Keep call records, transcripts and recordings here (Twilio bridge) "
            "(env PERSONAPLEX_RECORDS_DIR)"
        ),
    ] = None,
    log_level: Annotated[
        str | None, typer.Option(help="debug, info, warning (env PERSONAPLEX_LOG_LEVEL)")
    ] = None,
    static: Annotated[
        Path | None,
        typer.Option(
            help="Serve this client build at / instead of web/, e.g. the reference PersonaPlex "
            "client's dist/ (env PERSONAPLEX_STATIC)"
        ),
    ] = None,
    # -- cluster (docs/cluster.md) --
    workers: Annotated[
        int | None,
        typer.Option(
            help="Front-end processes sharing the port, each with every transport; 0 = one process "
            "(env PERSONAPLEX_WORKERS; 0)"
        ),
    ] = None,
    engine_workers: Annotated[
        int | None,
        typer.Option(
            help="Engine worker processes (one engine each; CPU or --device) (env PERSONAPLEX_ENGINE_WORKERS)"
        ),
    ] = None,
    gpus: Annotated[
        str | None, typer.Option(help="One engine worker per listed GPU, e.g. 0,1 (env PERSONAPLEX_GPUS)")
    ] = None,
    ray: Annotated[
        str | None,
        typer.Option(
            help="Join this Ray cluster (auto or HOST:PORT): engine workers are Ray actors "
            "(env PERSONAPLEX_RAY)"
        ),
    ] = None,
    drain_s: Annotated[
        float | None,
        typer.Option(
            help="Cluster: on SIGTERM admit nothing new and let calls run this long "
            "(env PERSONAPLEX_DRAIN_S; 30)"
        ),
    ] = None,
) -> None:
    """Serve /api/chat, the browser client, health and metrics."""
    given = {
        name: value.value if isinstance(value, Enum) else value
        for name, value in locals().items()
        if value is not None
    }
    alias = given.pop("voice_prompt_dir", None)
    if alias is not None:
        if given.get("voice_dir", alias) != alias:
            raise UserError("--voice-dir and --voice-prompt-dir name different directories: give one")
        given["voice_dir"] = alias
    try:
        settings = ServerSettings(**given)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in exc.errors()
        )
        raise UserError(f"invalid server settings: {problems}") from None
    if settings.cluster:
        from personaplex_voice.cluster.supervisor import run_cluster

        run_cluster(settings)
        return
    run_server(settings)


class RedactTokens(logging.Filter):
    """Uvicorn logs request lines with their query string: keep API keys out of the logs."""

    _TOKEN = re.compile(r"(token=)[^&\s\"']+")

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(
                self._TOKEN.sub(r"\1***", a) if isinstance(a, str) else a for a in record.args
            )
        if isinstance(record.msg, str):
            record.msg = self._TOKEN.sub(r"\1***", record.msg)
        return True


def check_files(settings: ServerSettings) -> None:
    """The files the settings name exist (before anything starts)."""
    ssl_files = settings.ssl_files()
    if ssl_files is not None:
        for path in ssl_files:
            if not path.is_file():
                raise UserError(f"--ssl {settings.ssl}: {path.name} not found (need cert.pem and key.pem)")
    if settings.voice_dir is not None and not settings.voice_dir.is_dir():
        raise UserError(f"--voice-prompt-dir {settings.voice_dir}: not a directory")
    if settings.static is not None and not (settings.static / "index.html").is_file():
        raise UserError(f"--static {settings.static}: no index.html there (give a client build's folder)")
    for flag, path in (
        ("--moshi-weight", settings.moshi_weight),
        ("--mimi-weight", settings.mimi_weight),
        ("--tokenizer", settings.tokenizer),
    ):
        if path is not None and not path.is_file():
            raise UserError(f"{flag} {path}: no such file")


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(settings: ServerSettings, fmt: str = LOG_FORMAT) -> None:
    level = settings.log_level.upper()
    # The CLI set up warnings-only logging; a server wants its info lines, with timestamps.
    logging.basicConfig(level=level, format=fmt, force=True)
    for name in ("uvicorn.access", "uvicorn.error"):
        logging.getLogger(name).addFilter(RedactTokens())
    logging.getLogger("uvicorn.error").addFilter(ClientMistakesAreWarnings())
    logging.getLogger("uvicorn.error").addFilter(AppLogsItsRefusals())  # /api/chat logs its own


def uvicorn_config(settings: ServerSettings, app: object):
    """The uvicorn settings every server process runs with (the embedded server, each front-end)."""
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
        # answered (server/http_guard.py: uvicorn alone leaves all three open).
        http=http_protocol,
        ws=ws_protocol,
        timeout_keep_alive=settings.http_keepalive_timeout_s,
        timeout_graceful_shutdown=5,
        lifespan="on",
    )


def call_ending_server_class():
    """uvicorn.Server that ends the calls in words before closing sockets (uvicorn itself closes
    WebSockets with a bare 1012 on shutdown). A function, so importing this module stays cheap."""
    import uvicorn

    from personaplex_voice.server.app import end_all_calls

    class CallEndingServer(uvicorn.Server):
        def __init__(self, config: uvicorn.Config, app: object):
            super().__init__(config)
            self._app = app

        async def shutdown(self, sockets: list | None = None) -> None:
            await end_all_calls(self._app)
            await super().shutdown(sockets)

    return CallEndingServer


def run_server(settings: ServerSettings) -> None:
    from personaplex_voice.audio.opus_library import require_opus

    require_opus()  # /api/chat speaks Ogg-Opus: a machine without libopus is told so, in one line
    from personaplex_voice.server.app import create_app

    check_files(settings)
    configure_logging(settings)

    failure: list[BaseException] = []
    server = None

    def on_load_error(exc: BaseException) -> None:
        failure.append(exc)
        if server is not None:
            server.should_exit = True

    app = create_app(settings, on_load_error=on_load_error)
    server = call_ending_server_class()(uvicorn_config(settings, app), app)
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
