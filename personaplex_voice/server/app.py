"""The FastAPI app: `/api/chat`, `/api/prompts`, `/api/voices`, `/healthz`, `/readyz`, `/metrics`,
the WebRTC endpoints (`server/webrtc`: WHIP and Pipecat's offer API) and `web/` (or the `--static`
build) at `/`. No OpenAPI schema or docs pages are served.

The app serves HTTP while the model loads (so `/healthz` answers and `/readyz` says "loading");
the engine is built and warmed in a worker thread by the lifespan, then one SessionManager is
started and published as `app.state.host`, the `session_api.SessionHost` every transport (this
chat endpoint, the phone bridges) shares. A cluster front-end passes its `ClusterClient` as the
host instead; the app treats both alike. Once a host is published, a `LoopMonitor` samples this
loop's lag and load into the host's headroom (saturation: docs/capacity.md).

`/metrics` exports the server's own instruments, the host's, and those of any source a transport
adds to `app.state.metric_sources` (the phone call's).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from personaplex_voice import untrusted
from personaplex_voice.metrics import LabelledSnapshot
from personaplex_voice.process import runtime
from personaplex_voice.process.engine_loader import load_engine, warm_engine
from personaplex_voice.process.loop_monitor import LoopMonitor
from personaplex_voice.process.settings import ServerSettings
from personaplex_voice.server import access, info, metrics
from personaplex_voice.server.chat import chat_endpoint, why_refused
from personaplex_voice.server.prompts import PromptStore
from personaplex_voice.server.protocol import ChatParams, QueryError
from personaplex_voice.server.static import web_root
from personaplex_voice.session_api import SessionHost, occupancy

log = logging.getLogger("personaplex_voice.server")

OnLoadError = Callable[[BaseException], None]


def create_app(
    settings: ServerSettings,
    host: SessionHost | None = None,
    *,
    on_load_error: OnLoadError | None = None,
) -> FastAPI:
    """Build the app. With `host` given (a cluster front-end's client; tests, embedding) no
    engine is loaded: the lifespan only starts and stops that host. `on_load_error` is called
    if loading fails (the CLI uses it to stop the server with the error)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader: asyncio.Task[None] | None = None
        if host is not None:
            await host.start()
            _publish(app, host)
            _tune_runtime(settings)
        else:
            loader = asyncio.create_task(_load(app, settings, on_load_error), name="engine-load")
        try:
            yield
        finally:
            if loader is not None and not loader.done():
                loader.cancel()  # the worker thread finishes on its own; its result is dropped
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await loader
            if app.state.loop_monitor is not None:
                await app.state.loop_monitor.stop()
            if app.state.host is not None:
                await app.state.host.shutdown()

    app = FastAPI(
        title="personaplex-voice", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.settings = settings
    app.state.prompts = PromptStore(ttl_s=settings.prompt_ttl_s)
    app.state.host = None
    app.state.model_name = settings.model if settings.engine == "model" else "echo"
    app.state.load_status = {"state": "loading", "detail": "starting"}
    app.state.loop_monitor = None
    app.state.server_metrics = metrics.ServerMetrics.create()
    app.state.metric_sources = []  # more snapshot sources (a transport's own instruments)
    app.state.registry = metrics.build_registry(
        lambda: [LabelledSnapshot({}, app.state.server_metrics.snapshot())],
        lambda: _host_snapshots(app),
        lambda: [snapshot for source in app.state.metric_sources for snapshot in source()],
    )

    app.add_api_websocket_route("/api/chat", chat_endpoint)
    app.add_api_route("/api/chat", why_refused, methods=["GET"])  # why an upgrade was refused
    app.add_api_route("/api/prompts", _store_prompt, methods=["POST"])
    app.add_api_route("/api/voices", _voices, methods=["GET"])
    app.add_api_route("/healthz", _healthz, methods=["GET"])
    app.add_api_route("/readyz", _readyz, methods=["GET"])
    app.add_api_route("/metrics", _metrics, methods=["GET"])
    app.add_api_route("/api/cluster", _cluster, methods=["GET"])
    if settings.webrtc:
        from personaplex_voice.server.webrtc import mount as mount_webrtc

        mount_webrtc(app)
    _serve_web_when_unmatched(app, settings.static)

    if settings.carrier_names:
        mount_phone(app, settings.carrier_names)
    return app


async def end_all_calls(app: FastAPI, timeout_s: float = 3.0) -> None:
    """Before the server closes its sockets: end every session, so each caller gets a 0x05
    "the session ended on the server (shutdown)" and a clean close rather than a bare 1012."""
    host: SessionHost | None = app.state.host
    if host is None:
        return
    for session in host.sessions:
        await session.close(reason="shutdown")
    open_connections = app.state.server_metrics.open_connections
    deadline = time.monotonic() + timeout_s
    while open_connections.value > 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def mount_phone(app: FastAPI, carriers: list[str]) -> None:
    """The phone carriers (`--carriers`, `--twilio`) on one phone service (personaplex_phone)."""
    from personaplex_voice.errors import UserError

    try:
        import personaplex_phone
    except ImportError as exc:
        raise UserError(
            f"--carriers needs the phone bridge and its extra: pip install 'personaplex-voice[phone]' ({exc})"
        ) from None
    personaplex_phone.mount(app, carriers)


# -- loading -----------------------------------------------------------------------------------


async def _load(app: FastAPI, settings: ServerSettings, on_error: OnLoadError | None) -> None:
    from personaplex_voice.sessions import SessionManager

    status = app.state.load_status
    started = time.monotonic()

    def progress(detail: str) -> None:  # called from the worker thread; a dict store is atomic
        status["detail"] = detail
        log.info("%s", detail)

    try:
        engine = await asyncio.to_thread(load_engine, settings, progress)
        progress("warming up the engine")
        await asyncio.to_thread(warm_engine, engine)
        manager = SessionManager(engine, realtime=True, **settings.manager_options())
        await manager.start()
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        status.update(state="failed", detail=str(exc) or type(exc).__name__)
        log.error("loading failed: %s", status["detail"])
        if on_error is not None:
            on_error(exc)
        return
    _publish(app, manager)
    _tune_runtime(settings)
    status.update(state="ready", detail=f"ready in {time.monotonic() - started:.1f} s")
    log.info("%s: %s, %d session slot(s)", app.state.model_name, status["detail"], manager.capacity)


def _publish(app: FastAPI, host: SessionHost) -> None:
    app.state.host = host
    app.state.model_name = host.model_name
    app.state.load_status.update(state="ready", detail="ready")
    monitor = LoopMonitor(host.headroom)
    monitor.start()
    app.state.loop_monitor = monitor


def _tune_runtime(settings: ServerSettings) -> None:
    """Once the engine is loaded (its objects exist, so they are frozen too): gc.freeze and the
    short GIL switch interval, once per process."""
    if settings.tune_runtime:
        runtime.tune_for_realtime()


def _host_snapshots(app: FastAPI) -> list[LabelledSnapshot]:
    host: SessionHost | None = app.state.host
    return host.metrics_snapshots() if host is not None else []


# -- HTTP endpoints ----------------------------------------------------------------------------


def _require_key(request: Request) -> None:
    if not access.key_ok(request.app.state.settings, request.headers, request.query_params):
        raise HTTPException(status_code=401, detail="missing or wrong API key")


async def _voices(request: Request) -> JSONResponse:
    _require_key(request)
    host: SessionHost | None = request.app.state.host
    if host is None:
        return JSONResponse({"detail": "the model is still loading"}, status_code=503)
    voices = [{"name": v.name, "kind": v.kind, "source": v.source} for v in host.voices()]
    return JSONResponse({"voices": voices})


async def _healthz(request: Request) -> JSONResponse:
    """Liveness and load progress. Local model paths only for callers holding the API key (none
    is configured: nobody holds it), others see the last part of each path."""
    app = request.app
    settings: ServerSettings = app.state.settings
    status = dict(app.state.load_status)
    model = app.state.model_name
    if not (settings.api_key is not None and access.key_ok(settings, request.headers, request.query_params)):
        model = info.public_model_name(model)
        status["detail"] = info.redact_paths(str(status.get("detail", "")), settings)
    host: SessionHost | None = app.state.host
    counts = {**occupancy(host), "saturated": host.headroom.refusing} if host is not None else {}
    return JSONResponse({"status": "ok", "model": model, **status, **counts})


async def _store_prompt(request: Request) -> JSONResponse:
    """`POST /api/prompts` with `{"text_prompt": "..."}` (or the text as text/plain): stores it and
    answers `{"prompt_id", "expires_in_s", "characters"}` for `/api/chat?prompt_id=`."""
    settings: ServerSettings = request.app.state.settings
    _require_key(request)
    if not access.origin_ok(settings, request.headers):
        raise HTTPException(
            status_code=403, detail=f"origin {request.headers.get('origin')!r} is not allowed"
        )
    limit = settings.max_prompt_chars * 4 + 1024  # UTF-8 is at most 4 bytes a character, plus JSON
    body = await _bounded_body(request, limit, settings.http_request_timeout_s)
    text = _prompt_text(body, request.headers.get("content-type", ""))
    try:
        ChatParams.from_query({}, max_prompt_chars=settings.max_prompt_chars, text_prompt=text)
    except QueryError as exc:
        raise HTTPException(status_code=400, detail=str(exc)) from None
    store: PromptStore = request.app.state.prompts
    prompt_id = store.put(text)
    return JSONResponse(
        {"prompt_id": prompt_id, "expires_in_s": store.ttl_s, "characters": len(text)}, status_code=201
    )


async def _bounded_body(request: Request, limit: int, timeout_s: float) -> bytes:
    declared = request.headers.get("content-length")
    size = untrusted.ascii_int_or_none(declared) if declared is not None else 0
    if size is None or size > limit:
        raise HTTPException(status_code=413, detail=f"a stored prompt is at most {limit} bytes")
    body = bytearray()

    async def read() -> None:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise HTTPException(status_code=413, detail=f"a stored prompt is at most {limit} bytes")

    try:
        await asyncio.wait_for(read(), timeout_s)
    except TimeoutError:
        raise HTTPException(
            status_code=408, detail=f"the body did not arrive within {timeout_s:g} s"
        ) from None
    return bytes(body)


def _prompt_text(body: bytes, content_type: str) -> str:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise HTTPException(status_code=400, detail="the prompt is not UTF-8") from None
    if not content_type.split(";")[0].strip().lower().endswith("json"):
        return text
    try:
        data = untrusted.loads(text, untrusted.JsonLimits(max_bytes=len(text)))
    except untrusted.InputRefused as exc:
        raise HTTPException(status_code=400, detail=f"the body is not valid JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("text_prompt"), str):
        raise HTTPException(status_code=400, detail='send {"text_prompt": "..."} (a JSON object)')
    return data["text_prompt"]


async def _readyz(request: Request) -> JSONResponse:
    """200 when a new conversation would start now; 503 while loading, after a failed load, when
    every slot is taken or reserved, or while the process has no real-time headroom left
    (`saturated`): a load balancer then sends the next caller elsewhere."""
    app = request.app
    status = dict(app.state.load_status)
    host: SessionHost | None = app.state.host
    if status["state"] != "ready" or host is None:
        return JSONResponse({"status": status["state"], "detail": status["detail"]}, status_code=503)
    ok, body = host.readiness()
    model = info.public_model_name(app.state.model_name)  # never a local path, to anyone
    return JSONResponse({**body, "model": model}, status_code=200 if ok else 503)


async def _cluster(request: Request) -> JSONResponse:
    """The engine workers behind this server (pid, device, node, slots, cached personas) and
    this process; one embedded worker when the server runs in one process."""
    _require_key(request)
    host: SessionHost | None = request.app.state.host
    if host is None:
        return JSONResponse({"detail": "the model is still loading"}, status_code=503)
    return JSONResponse(host.describe())


async def _metrics(request: Request) -> Response:
    _require_key(request)
    body = metrics.render(request.app.state.registry)
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


# -- the browser client ------------------------------------------------------------------------


def _serve_web_when_unmatched(app: FastAPI, static_dir: Path | None = None) -> None:
    """Serve web/ (or `static_dir`, another client's build) for any GET no route claims. Done
    through the router's fallback rather than a Mount at "/", so routes added later (the Twilio
    bridge's /twilio/*) are never shadowed."""
    root = static_dir or web_root()
    if root is None:
        log.warning("web/ not found: the browser client is not served")
        return
    if static_dir is not None:
        log.info("serving the client build in %s at /", static_dir)
    files = StaticFiles(directory=root, html=True)
    not_found = app.router.default

    async def fallback(scope: Scope, receive: Receive, send: Send) -> None:
        target: ASGIApp = files if scope["type"] == "http" else not_found
        await target(scope, receive, send)

    app.router.default = fallback
