"""The FastAPI app: `/api/chat`, `/api/voices`, `/healthz`, `/readyz`, `/metrics` and `web/` at `/`.

The app serves HTTP while the model loads (so `/healthz` answers and `/readyz` says "loading");
the engine is built and warmed in a worker thread by the lifespan, then one SessionManager is
started and published as `app.state.manager`, which every transport (this chat endpoint, the
Twilio bridge) shares.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from personaplex_voice.server import access, metrics, runtime
from personaplex_voice.server.chat import chat_endpoint
from personaplex_voice.server.config import ServerSettings
from personaplex_voice.server.engine_loader import load_engine, warm_engine
from personaplex_voice.server.static import web_root

log = logging.getLogger("personaplex_voice.server")

OnLoadError = Callable[[BaseException], None]


def create_app(
    settings: ServerSettings,
    manager: Any | None = None,
    *,
    on_load_error: OnLoadError | None = None,
) -> FastAPI:
    """Build the app. With `manager` given (tests, embedding) no engine is loaded: the lifespan
    only starts and stops that manager. `on_load_error` is called if loading fails (the CLI uses
    it to stop the server with the error)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader: asyncio.Task[None] | None = None
        if manager is not None:
            await manager.start()
            _publish(app, manager, getattr(manager, "engine", None))
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
            if app.state.manager is not None:
                await app.state.manager.shutdown()

    app = FastAPI(title="personaplex-voice", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.settings = settings
    app.state.manager = None
    app.state.engine = None
    app.state.model_name = settings.model if settings.engine == "model" else "echo"
    app.state.load_status = {"state": "loading", "detail": "starting"}
    app.state.server_metrics = metrics.ServerMetrics.create()
    app.state.registry = metrics.build_registry(app.state.server_metrics, lambda: _manager_instruments(app))

    app.add_api_websocket_route("/api/chat", chat_endpoint)
    app.add_api_route("/api/voices", _voices, methods=["GET"])
    app.add_api_route("/healthz", _healthz, methods=["GET"])
    app.add_api_route("/readyz", _readyz, methods=["GET"])
    app.add_api_route("/metrics", _metrics, methods=["GET"])
    _serve_web_when_unmatched(app)

    if settings.twilio:
        mount_twilio(app)
    return app


async def end_all_calls(app: FastAPI, timeout_s: float = 3.0) -> None:
    """Before the server closes its sockets: end every session, so each caller gets a 0x05
    "the session ended on the server (shutdown)" and a clean close rather than a bare 1012."""
    manager = app.state.manager
    if manager is None:
        return
    for session in manager.sessions:
        await session.close(reason="shutdown")
    open_connections = app.state.server_metrics.open_connections
    deadline = time.monotonic() + timeout_s
    while open_connections.value > 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def mount_twilio(app: FastAPI) -> None:
    from personaplex_voice.errors import UserError

    try:
        import personaplex_twilio
    except ImportError as exc:
        raise UserError(
            f"--twilio needs the Twilio bridge and its extra: pip install 'personaplex-voice[twilio]' ({exc})"
        ) from None
    personaplex_twilio.mount(app)


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
    _publish(app, manager, engine)
    _tune_runtime(settings)
    status.update(state="ready", detail=f"ready in {time.monotonic() - started:.1f} s")
    log.info("%s: %s, %d session slot(s)", app.state.model_name, status["detail"], manager.capacity)


def _publish(app: FastAPI, manager: Any, engine: Any) -> None:
    app.state.engine = engine
    app.state.manager = manager
    if engine is not None and getattr(engine, "name", None):
        app.state.model_name = engine.name
    app.state.load_status.update(state="ready", detail="ready")


def _tune_runtime(settings: ServerSettings) -> None:
    """Once the engine is loaded (its objects exist, so they are frozen too): gc.freeze and the
    short GIL switch interval, once per process."""
    if settings.tune_runtime:
        runtime.tune_for_realtime()


def _manager_instruments(app: FastAPI) -> list[Any]:
    manager = app.state.manager
    source = getattr(manager, "metrics", None)
    return list(source.instruments()) if source is not None else []


# -- HTTP endpoints ----------------------------------------------------------------------------


def _require_key(request: Request) -> None:
    if not access.key_ok(request.app.state.settings, request.headers, request.query_params):
        raise HTTPException(status_code=401, detail="missing or wrong API key")


async def _voices(request: Request) -> JSONResponse:
    _require_key(request)
    engine = request.app.state.engine
    if engine is None:
        return JSONResponse({"detail": "the model is still loading"}, status_code=503)
    voices = [{"name": v.name, "kind": v.kind, "source": v.source} for v in engine.voices()]
    return JSONResponse({"voices": voices})


def _occupancy(app: FastAPI) -> dict[str, Any]:
    manager = app.state.manager
    if manager is None:
        return {}
    return {
        "active": manager.active_count,
        "queued": manager.queued_count,
        "reserved": manager.reserved_count,
        "available": manager.available,
        "capacity": manager.capacity,
    }


async def _healthz(request: Request) -> JSONResponse:
    app = request.app
    return JSONResponse(
        {"status": "ok", "model": app.state.model_name, **app.state.load_status, **_occupancy(app)}
    )


async def _readyz(request: Request) -> JSONResponse:
    """200 when a new conversation would start now; 503 while loading, after a failed load, or
    when every slot is taken or reserved (so a load balancer sends the next caller elsewhere)."""
    app = request.app
    status = dict(app.state.load_status)
    occupancy = _occupancy(app)
    if status["state"] != "ready":
        return JSONResponse({"status": status["state"], "detail": status["detail"]}, status_code=503)
    if occupancy["available"] <= 0:
        return JSONResponse({"status": "full", **occupancy}, status_code=503)
    return JSONResponse({"status": "ready", "model": app.state.model_name, **occupancy})


async def _metrics(request: Request) -> Response:
    body = metrics.render(request.app.state.registry)
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


# -- the browser client ------------------------------------------------------------------------


def _serve_web_when_unmatched(app: FastAPI) -> None:
    """Serve web/ for any GET no route claims. Done through the router's fallback rather than a
    Mount at "/", so routes added later (the Twilio bridge's /twilio/*) are never shadowed."""
    root = web_root()
    if root is None:
        log.warning("web/ not found: the browser client is not served")
        return
    files = StaticFiles(directory=root, html=True)
    not_found = app.router.default

    async def fallback(scope: Scope, receive: Receive, send: Send) -> None:
        target: ASGIApp = files if scope["type"] == "http" else not_found
        await target(scope, receive, send)

    app.router.default = fallback
