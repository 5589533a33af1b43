"""What the phone service shows of its calls (all behind the API key), and its routes.

| route                                  | what                                                    |
| -------------------------------------- | ------------------------------------------------------- |
| `GET /phone/calls[?live_metrics=0]`    | live calls (metrics, levels), recent calls' summaries   |
| `GET /phone/calls/{id}[?since=N]`      | one call's record (transcript from piece N on)          |
| `GET /phone/calls/{id}/recording`      | its stereo WAV (caller left, agent right)               |
| `GET /calls`                           | the calls page (web/calls.html; it asks for the key)    |

The same three call routes are also under each mounted carrier's prefix (`/twilio/calls`, ...),
where a Twilio server has always served them. Per carrier (carrier.paths): the answer webhook,
the status webhook, `WS …/media-stream/{ticket}` and `…/instructions/{token}`.

The page and its two files are served here rather than by the server's web/ fallback, so the
page is there even when `--static` serves another client at /.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import FileResponse, JSONResponse, Response

from personaplex_voice.server.static import web_root
from personaplex_voice.untrusted import ascii_int_or_none

from .carrier import Carrier
from .records import valid_sid
from .service import PhoneService

LIST_LIMIT = 100
PAGE_FILES = {"calls.js": "text/javascript", "calls.css": "text/css"}


def _unauthorized() -> JSONResponse:
    return JSONResponse({"error": "unauthorized"}, status_code=401)


class CallsApi:
    def __init__(self, service: PhoneService):
        self.service = service
        self.registry = service.registry
        self.store = service.store

    async def list_calls(self, request: Request) -> Response:
        if not self.service.authorized(request):
            return _unauthorized()
        manager = self.service.manager
        if manager is None:
            return JSONResponse({"error": "the engine is still loading"}, status_code=503)
        streams = list(self.registry.live.values())
        # The full per-stream metrics sort thousands of samples each: the page, which polls, skips them.
        with_metrics = request.query_params.get("live_metrics", "1") != "0"
        recent = [j.summary() for j in list(self.registry.calls.values())[-LIST_LIMIT:]]
        seen = {r["call_sid"] for r in recent}
        earlier = [r for r in self.service.past if r["call_sid"] not in seen][
            : max(0, LIST_LIMIT - len(recent))
        ]
        return JSONResponse(
            {
                "capacity": manager.capacity,
                "active_sessions": manager.active_count,
                "reserved": manager.reserved_count,
                "carriers": sorted(self.service.carriers),
                "live_streams": {call.stream_sid or call.call_sid: call.metrics() for call in streams}
                if with_metrics
                else {},
                "live": [call.live_view() for call in streams],
                "calls": recent,
                "earlier_calls": earlier,
                "records": self.service.outputs.recordings,
            }
        )

    def _record(self, call_sid: str) -> dict[str, Any] | None:
        journal = self.registry.find(call_sid)
        if journal is not None and journal.ended is None:
            return journal.record.to_dict()  # live (or not yet streamed): whole in memory
        on_disk = self.store.load(call_sid)
        if on_disk is not None:
            return on_disk
        return dict(journal.summary(), transcript=[]) if journal is not None else None

    async def call(self, request: Request) -> Response:
        if not self.service.authorized(request):
            return _unauthorized()
        call_sid = request.path_params["sid"]
        record = self._record(call_sid) if valid_sid(call_sid) else None
        if record is None:
            return JSONResponse({"error": f"no record of call {call_sid}"}, status_code=404)
        since = ascii_int_or_none(request.query_params.get("since", ""), 9)
        if since is not None:
            record["transcript_from"] = since
            record["transcript"] = record["transcript"][since:]
        return JSONResponse(record)

    async def recording(self, request: Request) -> Response:
        if not self.service.authorized(request):
            return _unauthorized()
        call_sid = request.path_params["sid"]
        path = self.store.recording(call_sid) if self.service.outputs.recordings else None
        if path is None:
            return JSONResponse({"error": f"no recording of call {call_sid}"}, status_code=404)
        return FileResponse(path, media_type="audio/wav", filename=f"{call_sid}.wav")

    async def page(self, request: Request) -> Response:
        return self._web_file("calls.html", "text/html")

    async def page_file(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in PAGE_FILES:
            return JSONResponse({"error": "not found"}, status_code=404)
        return self._web_file(name, PAGE_FILES[name])

    @staticmethod
    def _web_file(name: str, media_type: str) -> Response:
        root = web_root()
        if root is None or not (root / name).is_file():
            return JSONResponse({"error": "the web client is not installed"}, status_code=404)
        return FileResponse(root / name, media_type=media_type, headers={"Cache-Control": "no-cache"})

    def add_call_routes(self, router: APIRouter, prefix: str) -> None:
        router.add_api_route(f"{prefix}/calls", self.list_calls, methods=["GET"])
        router.add_api_route(f"{prefix}/calls/{{sid}}", self.call, methods=["GET"])
        router.add_api_route(f"{prefix}/calls/{{sid}}/recording", self.recording, methods=["GET"])


def service_router(service: PhoneService) -> APIRouter:
    """The routes every phone server has, whatever its carriers: calls, records, the page."""
    api = CallsApi(service)
    router = APIRouter()
    api.add_call_routes(router, "/phone")
    router.add_api_route("/calls", api.page, methods=["GET"], include_in_schema=False)
    router.add_api_route("/calls/{name}", api.page_file, methods=["GET"], include_in_schema=False)
    return router


def carrier_router(service: PhoneService, carrier: Carrier) -> APIRouter:
    """One carrier's webhooks and stream, and the call routes under its prefix."""
    paths = carrier.paths
    prefix = f"/{carrier.name}"
    router = APIRouter()

    async def answer(request: Request) -> Response:
        return await service.answer(carrier, request)

    async def status(request: Request) -> Response:
        return await service.status(carrier, request)

    async def instructions(request: Request) -> Response:
        return await service.instructions(carrier, request)

    async def media_stream(ws: WebSocket) -> None:
        await service.media_stream(carrier, ws)

    async def unticketed(ws: WebSocket) -> None:
        await service.unticketed_stream(carrier, ws)

    if paths.answer:
        methods = list(paths.answer_methods)
        router.add_api_route(paths.answer, answer, methods=methods, include_in_schema=False)
    if paths.status:
        router.add_api_route(
            paths.status, status, methods=list(paths.status_methods), include_in_schema=False
        )
    router.add_api_route(
        f"{prefix}/instructions/{{token}}", instructions, methods=["GET", "POST"], include_in_schema=False
    )
    if getattr(carrier, "answers_in_stream", False):
        # No answer webhook, no ticket: the stream is the call's arrival, admitted at its start,
        # at the path itself or any below it (the platform appends its own ids).
        router.add_api_websocket_route(paths.media, media_stream)
        router.add_api_websocket_route(paths.media + "/{connection:path}", media_stream)
    else:
        router.add_api_websocket_route(paths.media + "/{ticket}", media_stream)
        router.add_api_websocket_route(paths.media, unticketed)
    CallsApi(service).add_call_routes(router, prefix)
    return router
