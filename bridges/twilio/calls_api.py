"""What the bridge shows of its calls (all behind the API key), and the routes of the bridge.

| route                                   | what                                                   |
| --------------------------------------- | ------------------------------------------------------ |
| `GET /twilio/calls[?live_metrics=0]`    | live calls (metrics, levels), recent calls' summaries  |
| `GET /twilio/calls/{sid}[?since=N]`     | one call's record (transcript from piece N on)         |
| `GET /twilio/calls/{sid}/recording`     | its stereo WAV (caller left, agent right)              |
| `GET /calls`                            | the calls page (web/calls.html; it asks for the key)   |

The page and its two files are served here rather than by the server's web/ fallback, so the
page is there even when `--static` serves another client at /.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from personaplex_voice.server.static import web_root

from .bridge import TwilioBridge
from .calls import MEDIA_STREAM_PATH, STATUS_PATH, VOICE_PATH, WHISPER_PATH
from .records import valid_sid

LIST_LIMIT = 100
PAGE_FILES = {"calls.js": "text/javascript", "calls.css": "text/css"}


def _unauthorized() -> JSONResponse:
    return JSONResponse({"error": "unauthorized"}, status_code=401)


class CallsApi:
    def __init__(self, bridge: TwilioBridge):
        self.bridge = bridge
        self.registry = bridge.registry
        self.store = bridge.store

    async def list_calls(self, request: Request) -> Response:
        if not self.bridge.authorized(request):
            return _unauthorized()
        manager = self.bridge.manager
        if manager is None:
            return JSONResponse({"error": "the engine is still loading"}, status_code=503)
        streams = list(self.registry.live.items())
        # The full per-stream metrics sort thousands of samples each: the page, which polls, skips them.
        with_metrics = request.query_params.get("live_metrics", "1") != "0"
        recent = [r.summary() for r in list(self.registry.calls.values())[-LIST_LIMIT:]]
        seen = {r["call_sid"] for r in recent}
        earlier = [r for r in self.bridge.past if r["call_sid"] not in seen][
            : max(0, LIST_LIMIT - len(recent))
        ]
        return JSONResponse(
            {
                "capacity": manager.capacity,
                "active_sessions": manager.active_count,
                "reserved": manager.reserved_count,
                "live_streams": {sid: call.metrics() for sid, call in streams} if with_metrics else {},
                "live": [call.live_view() for _, call in streams],
                "calls": recent,
                "earlier_calls": earlier,
                "records": self.store is not None,
            }
        )

    def _record(self, call_sid: str) -> dict[str, Any] | None:
        record = self.registry.calls.get(call_sid)
        on_disk = self.store.load(call_sid) if self.store is not None else None
        if record is None:
            return on_disk
        found = record.to_dict()
        if on_disk is not None and not record.live:  # an ended call's transcript is on disk only
            found["transcript"] = on_disk.get("transcript", [])
        return found

    async def call(self, request: Request) -> Response:
        if not self.bridge.authorized(request):
            return _unauthorized()
        call_sid = request.path_params["sid"]
        record = self._record(call_sid) if valid_sid(call_sid) else None
        if record is None:
            return JSONResponse({"error": f"no record of call {call_sid}"}, status_code=404)
        since = request.query_params.get("since", "")
        if since.isdigit():
            record["transcript_from"] = int(since)
            record["transcript"] = record["transcript"][int(since) :]
        return JSONResponse(record)

    async def recording(self, request: Request) -> Response:
        if not self.bridge.authorized(request):
            return _unauthorized()
        call_sid = request.path_params["sid"]
        path = self.store.recording(call_sid) if self.store is not None else None
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


def build_router(bridge: TwilioBridge) -> APIRouter:
    api = CallsApi(bridge)
    router = APIRouter()
    router.add_api_route(VOICE_PATH, bridge.voice, methods=["POST"], include_in_schema=False)
    router.add_api_route(STATUS_PATH, bridge.status, methods=["POST"], include_in_schema=False)
    router.add_api_route(WHISPER_PATH, bridge.whisper, methods=["POST"], include_in_schema=False)
    router.add_api_route("/twilio/call", bridge.place_call, methods=["POST"])
    router.add_api_route("/twilio/calls", api.list_calls, methods=["GET"])
    router.add_api_route("/twilio/calls/{sid}", api.call, methods=["GET"])
    router.add_api_route("/twilio/calls/{sid}/recording", api.recording, methods=["GET"])
    router.add_api_route("/calls", api.page, methods=["GET"], include_in_schema=False)
    router.add_api_route("/calls/{name}", api.page_file, methods=["GET"], include_in_schema=False)
    router.add_api_websocket_route(MEDIA_STREAM_PATH + "/{ticket}", bridge.media_stream)
    router.add_api_websocket_route(MEDIA_STREAM_PATH, bridge.unticketed_stream)
    return router
