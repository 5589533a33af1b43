"""The WebRTC endpoints: WHIP (RFC 9725) and Pipecat's small-WebRTC offer API, on one session API.

- `POST /api/whip?QUERY` (`application/sdp`): a call. `201` with the answer
  (`application/sdp`), `Location: /api/whip/{id}`, `ETag`, `Link: <url>; rel="ice-server"`.
- `DELETE /api/whip/{id}`: hang up (`200`). `PATCH /api/whip/{id}`
  (`application/trickle-ice-sdpfrag`): trickled candidates (`204`); an ICE restart is `422`
  (not supported: start a new call). Other methods: `405`.
- `POST /api/offer?QUERY` with `{sdp, type, pc_id?, restart_pc?, requestData?}` (Pipecat):
  `{sdp, type: "answer", pc_id}`. A known `pc_id` renegotiates that call: on its peer connection,
  or with `restart_pc` on a new one that carries on the same session. `PATCH /api/offer` with
  `{pc_id, candidates}`: trickled candidates, `{"status": "success"}`.
- `POST /start`, then `POST`/`PATCH /sessions/{id}/api/offer`: Pipecat's runner flow (`/start`
  keeps the body, the persona, and answers `{sessionId, iceConfig}`).
- `GET /api/webrtc`: the ICE servers for a browser, and the endpoints.

A call is refused before anything is built, as /api/chat refuses an upgrade, with the same
reasons: the HTTP status, the reason in words (WHIP: `text/plain`; Pipecat: `{"detail"}` as its
FastAPI server answers) and the kind in `X-PersonaPlex-Error`, `Retry-After` on 503.
Pipecat's field names and semantics follow pipecat-ai 1.14's
pipecat/transports/smallwebrtc/request_handler.py and runner/run.py; WHIP's follow RFC 9725.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from personaplex_voice.engine.base import CapacityError, EngineError, PersonaError, SaturatedError
from personaplex_voice.server import access
from personaplex_voice.server.chat import (
    CLOSE_GOING_AWAY,
    CLOSE_POLICY,
    Refusal,
    check_request,
    refusal_headers,
    saturated_refusal,
    session_metadata,
)
from personaplex_voice.server.protocol import QueryError
from personaplex_voice.server.webrtc.dialects import ChatKinds, Dialect, Rtvi
from personaplex_voice.server.webrtc.params import caller_facts, fill_prompt, merged_query
from personaplex_voice.server.webrtc.sdp import (
    MAX_SDP_BYTES,
    SdpError,
    SdpFragment,
    parse_offer,
    parse_sdpfrag,
)
from personaplex_voice.server.webrtc.service import CallNotHere, WebRTCService
from personaplex_voice.session_api import SessionHost

log = logging.getLogger("personaplex_voice.server.webrtc")

WHIP_PATH = "/api/whip"
OFFER_PATH = "/api/offer"
CONFIG_PATH = "/api/webrtc"
EXPOSED = "Location, ETag, Link, X-PersonaPlex-Error, Retry-After"
LOADING_RETRY_S = 5
BODY_TIMEOUT_S = 10.0


class NotHere(Exception):
    """A follow-up request for a call this process does not hold (see service.CallNotHere)."""


def _service(request: Request) -> WebRTCService:
    return request.app.state.webrtc


# -- answers -------------------------------------------------------------------------------------


def _cors(request: Request) -> dict[str, str]:
    origin = request.headers.get("origin")
    if origin is None or not access.origin_ok(request.app.state.settings, request.headers):
        return {}
    return {"access-control-allow-origin": origin, "vary": "Origin", "access-control-expose-headers": EXPOSED}


def _refused(request: Request, refusal: Refusal, as_json: bool) -> Response:
    status = refusal.http_status or 503
    if status == 503 and refusal.retry_after_s is None:
        refusal.retry_after_s = LOADING_RETRY_S if refusal.kind == "loading" else None
    _service(request).metrics.errors.inc(label=refusal.kind)
    client = request.client
    log.info(
        "refused a WebRTC call (%s) from %s: %d %s (%s)",
        request.url.path,
        f"{client.host}:{client.port}" if client else "unknown client",
        status,
        refusal.message,
        refusal.kind,
    )
    headers = {**refusal_headers(refusal), **_cors(request)}
    if as_json:
        return JSONResponse({"detail": refusal.message, "kind": refusal.kind}, status, headers=headers)
    return PlainTextResponse(refusal.message + "\n", status, headers=headers)


def _not_here(request: Request, exc: CallNotHere, as_json: bool) -> Response:
    headers = {"cache-control": "no-store", **_cors(request)}
    if exc.elsewhere:
        message = "this call is held by another server process: retry the request on a new connection"
        status = 421
        headers["connection"] = "close"  # so the retry opens one (and may reach the right process)
    else:
        message = "no such call (it ended, or the id is wrong)"
        status = 404
    if as_json:
        return JSONResponse({"detail": message}, status, headers=headers)
    return PlainTextResponse(message + "\n", status, headers=headers)


async def _body(request: Request, limit: int = MAX_SDP_BYTES) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise Refusal("bad_offer", f"the body is over {limit} bytes", CLOSE_POLICY, http_status=413)
    body = bytearray()

    async def read() -> None:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise Refusal("bad_offer", f"the body is over {limit} bytes", CLOSE_POLICY, http_status=413)

    try:
        await asyncio.wait_for(read(), BODY_TIMEOUT_S)
    except TimeoutError:
        raise Refusal(
            "bad_offer", f"the body did not arrive within {BODY_TIMEOUT_S:g} s", CLOSE_POLICY, http_status=408
        ) from None
    return bytes(body)


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise Refusal("bad_offer", "the body is not valid JSON", CLOSE_POLICY, http_status=400) from None
    if not isinstance(data, dict):
        raise Refusal("bad_offer", "the body must be a JSON object", CLOSE_POLICY, http_status=400)
    return data


def _require_access(request: Request) -> None:
    settings = request.app.state.settings
    if not access.origin_ok(settings, request.headers):
        origin = request.headers.get("origin")
        raise Refusal("origin", f"origin {origin!r} is not allowed", CLOSE_POLICY, http_status=403)
    if not access.key_ok(settings, request.headers, request.query_params):
        raise Refusal("auth", "missing or wrong API key (pass ?token=KEY)", CLOSE_POLICY, http_status=401)


# -- opening a call ------------------------------------------------------------------------------


async def open_call(
    request: Request,
    *,
    endpoint: str,
    dialect: Dialect,
    offer_sdp: str,
    body: dict[str, Any] | None = None,
    query: dict[str, str] | None = None,
) -> Any:
    """Everything /api/chat checks before its upgrade, then the session, then the peer
    connection; raises `Refusal` (nothing is left open then)."""
    from personaplex_voice.server.webrtc.call import CallConfig, WebRTCCall

    state = request.app.state
    service = _service(request)
    if not service.available:
        raise Refusal("unavailable", service.unavailable_reason, CLOSE_GOING_AWAY, http_status=501)
    given = merged_query(query if query is not None else dict(request.query_params), body)
    params = check_request(state, state.settings, request.headers, given)
    try:
        params = fill_prompt(params, caller_facts(given, body), state.settings.max_prompt_chars)
        parse_offer(offer_sdp)
    except QueryError as exc:
        raise Refusal("bad_query", str(exc), CLOSE_POLICY, http_status=400) from None
    except SdpError as exc:
        raise Refusal("bad_offer", str(exc), CLOSE_POLICY, http_status=400) from None
    host: SessionHost = state.host
    try:
        await host.headroom.arrivals.turn(offer=True)  # behind the calls in progress (as /api/chat)
        session = await host.open(params.persona())
    except SaturatedError as exc:
        raise saturated_refusal(exc) from None
    except CapacityError as exc:
        retry = f"; retry in about {exc.retry_after_s:.0f} s" if exc.retry_after_s else ""
        raise Refusal(
            "capacity",
            f"the server is full ({host.capacity} sessions){retry}",
            CLOSE_POLICY,
            http_status=503,
            retry_after_s=exc.retry_after_s or LOADING_RETRY_S,
        ) from None
    except PersonaError as exc:
        raise Refusal("persona", str(exc), CLOSE_POLICY, http_status=400) from None
    except EngineError as exc:
        raise Refusal(
            "unavailable", f"the server is not taking calls ({exc})", CLOSE_GOING_AWAY, http_status=503
        ) from None
    settings = state.settings
    config = CallConfig(
        ice_servers=service.ice_servers,
        peer_timeout_s=settings.webrtc_peer_timeout_s,
        connect_timeout_s=settings.webrtc_connect_timeout_s,
        realtime=host.realtime,
    )
    call = WebRTCCall(
        call_id=service.new_id(),
        endpoint=endpoint,
        session=session,
        params=params,
        dialect=dialect,
        config=config,
        metrics=service.metrics,
        meter=host.headroom.meter(),
        metadata=lambda: {
            **session_metadata(state, settings, params, session),
            "transport": "webrtc",
            "call_id": call.id,
        },
        on_end=service.forget,
    )
    try:
        answer = await call.start(offer_sdp)
    except BaseException as exc:
        await call.abort()
        await session.close(reason="refused")
        if isinstance(exc, TimeoutError):
            raise Refusal(
                "ice",
                "the server could not gather its ICE candidates in time (check --ice-servers)",
                CLOSE_GOING_AWAY,
                http_status=503,
            ) from None
        if isinstance(exc, Exception):
            raise Refusal(
                "bad_offer", f"the offer cannot be answered: {exc}", CLOSE_POLICY, http_status=400
            ) from None
        raise
    service.add(call)
    log.info(
        "webrtc call %s (%s) opened session %s (voice=%s)",
        call.id,
        endpoint,
        session.id,
        params.voice_prompt or "default",
    )
    return call, answer


# -- WHIP ----------------------------------------------------------------------------------------


async def whip_post(request: Request) -> Response:
    try:
        _require_access(request)
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type != "application/sdp":
            raise Refusal(
                "bad_offer",
                "a WHIP offer is sent as Content-Type: application/sdp",
                CLOSE_POLICY,
                http_status=415,
            )
        offer = (await _body(request)).decode("utf-8", errors="replace")
        call, answer = await open_call(request, endpoint="whip", dialect=ChatKinds(), offer_sdp=offer)
    except Refusal as refusal:
        return _refused(request, refusal, as_json=False)
    service = _service(request)
    headers = {
        "location": f"{WHIP_PATH}/{call.id}",
        "etag": f'"{_ice_ufrag(answer)}"',
        "cache-control": "no-store",
        **_cors(request),
    }
    response = Response(answer, 201, media_type="application/sdp", headers=headers)
    for server in service.ice_servers:
        for link in server.link_headers():
            response.headers.append("link", link)
    return response


def _ice_ufrag(sdp: str) -> str:
    return next((line[12:].strip() for line in sdp.splitlines() if line.startswith("a=ice-ufrag:")), "")


async def whip_delete(request: Request) -> Response:
    try:
        _require_access(request)
        call = _service(request).find(request.path_params["call_id"])
    except Refusal as refusal:
        return _refused(request, refusal, as_json=False)
    except CallNotHere as exc:
        return _not_here(request, exc, as_json=False)
    from personaplex_voice.server.webrtc.call import CallEnded

    await call.end(CallEnded("client", "the caller hung up (WHIP DELETE)", tell_client=False))
    return Response(status_code=200, headers=_cors(request))


async def whip_patch(request: Request) -> Response:
    """RFC 9725 §4.3: trickle ICE yes (204), ICE restarts no (422); an `If-Match` that is not
    this session's ETag is 412."""
    try:
        _require_access(request)
        call = _service(request).find(request.path_params["call_id"])
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type != "application/trickle-ice-sdpfrag":
            raise Refusal(
                "bad_offer",
                "PATCH a WHIP session with Content-Type: application/trickle-ice-sdpfrag",
                CLOSE_POLICY,
                http_status=415,
            )
        fragment = parse_sdpfrag((await _body(request)).decode("utf-8", errors="replace"))
    except Refusal as refusal:
        return _refused(request, refusal, as_json=False)
    except CallNotHere as exc:
        return _not_here(request, exc, as_json=False)
    except SdpError as exc:
        return _refused(request, Refusal("bad_offer", str(exc), CLOSE_POLICY, http_status=400), as_json=False)
    if_match = request.headers.get("if-match")
    restart = if_match == "*" or (
        fragment.ice_ufrag is not None
        and call.remote_ice_ufrag is not None
        and fragment.ice_ufrag != call.remote_ice_ufrag
    )
    if restart:
        message = "ICE restarts are not supported here: hang up (DELETE) and start a new session"
        return PlainTextResponse(message + "\n", 422, headers=_cors(request))
    etag = request.headers.get("if-match")
    if etag is not None and etag.strip() != f'"{_ice_ufrag(call.local_sdp)}"':
        return PlainTextResponse("If-Match is not this session's ETag\n", 412, headers=_cors(request))
    await call.add_candidates(fragment)
    return Response(status_code=204, headers=_cors(request))


async def whip_other(request: Request) -> Response:
    return PlainTextResponse(
        "a WHIP session takes DELETE (hang up) and PATCH (trickle ICE)\n",
        405,
        headers={"allow": "DELETE, PATCH, OPTIONS", **_cors(request)},
    )


async def preflight(request: Request) -> Response:
    """CORS preflight for a page on another origin (the allow-list of --allowed-origins)."""
    headers = _cors(request)
    if headers:
        headers.update(
            {
                "access-control-allow-methods": "POST, PATCH, DELETE, OPTIONS",
                "access-control-allow-headers": "Authorization, Content-Type, If-Match, X-API-Key",
                "access-control-max-age": "600",
            }
        )
    return Response(status_code=204, headers={"allow": "POST, PATCH, DELETE, OPTIONS", **headers})


# -- Pipecat small WebRTC ------------------------------------------------------------------------


def _pipecat_offer(data: dict[str, Any]) -> tuple[str, str | None, bool, dict[str, Any] | None]:
    sdp, kind = data.get("sdp"), data.get("type")
    if not isinstance(sdp, str) or kind != "offer":
        raise Refusal("bad_offer", 'send {"sdp": "...", "type": "offer"}', CLOSE_POLICY, http_status=400)
    pc_id = data.get("pc_id")
    request_data = data.get("requestData", data.get("request_data"))
    if request_data is not None and not isinstance(request_data, dict):
        raise Refusal("bad_query", "requestData must be a JSON object", CLOSE_POLICY, http_status=400)
    return (
        sdp,
        pc_id if isinstance(pc_id, str) and pc_id else None,
        bool(data.get("restart_pc")),
        request_data,
    )


async def _offer(
    request: Request, start_body: dict[str, Any] | None, start_query: dict[str, str] | None
) -> Response:
    service = _service(request)
    try:
        _require_access(request)
        data = _json_object(await _body(request))
        sdp, pc_id, restart, request_data = _pipecat_offer(data)
        if pc_id is not None:
            try:
                call = service.find(pc_id)
            except CallNotHere as exc:
                if exc.elsewhere:
                    return _not_here(request, exc, as_json=True)
                call = None  # unknown or ended: a new call, as Pipecat's handler does
            if call is not None:
                try:
                    answer = await call.renegotiate(sdp, restart)
                except SdpError as exc:
                    raise Refusal("bad_offer", str(exc), CLOSE_POLICY, http_status=400) from None
                return JSONResponse(
                    {"sdp": answer, "type": "answer", "pc_id": call.id}, headers=_cors(request)
                )
        query = {**(start_query or {}), **dict(request.query_params)}
        call, answer = await open_call(
            request,
            endpoint="pipecat",
            dialect=Rtvi(),
            offer_sdp=sdp,
            body=request_data if request_data is not None else start_body,
            query=query,
        )
    except Refusal as refusal:
        return _refused(request, refusal, as_json=True)
    return JSONResponse({"sdp": answer, "type": "answer", "pc_id": call.id}, headers=_cors(request))


async def _candidates(request: Request) -> Response:
    try:
        _require_access(request)
        data = _json_object(await _body(request))
        pc_id = data.get("pc_id")
        call = _service(request).find(pc_id if isinstance(pc_id, str) else "")
        fragment = SdpFragment()
        for entry in data.get("candidates") or []:
            if not isinstance(entry, dict):
                continue
            line = entry.get("candidate") or ""
            if not line:  # RFC 8840 end-of-candidates (Firefox sends one per media line)
                fragment.end_of_candidates = True
                continue
            index = entry.get("sdp_mline_index")
            fragment.candidates.append(
                (str(line), entry.get("sdp_mid"), index if isinstance(index, int) else 0)
            )
    except Refusal as refusal:
        return _refused(request, refusal, as_json=True)
    except CallNotHere as exc:
        if not exc.elsewhere:
            return JSONResponse({"detail": "Peer connection not found"}, 404, headers=_cors(request))
        return _not_here(request, exc, as_json=True)
    try:
        await call.add_candidates(fragment)
    except (ValueError, IndexError) as exc:
        return JSONResponse({"detail": f"a candidate cannot be used: {exc}"}, 400, headers=_cors(request))
    return JSONResponse({"status": "success"}, headers=_cors(request))


async def offer_post(request: Request) -> Response:
    return await _offer(request, None, None)


async def offer_patch(request: Request) -> Response:
    return await _candidates(request)


async def start_post(request: Request) -> Response:
    """Pipecat's runner `POST /start` ({transport, body, enableDefaultIceServers}): keeps the body
    (the persona) for the offer that follows, answers the session id and the ICE servers."""
    service = _service(request)
    try:
        _require_access(request)
        raw = await _body(request)
        data = _json_object(raw) if raw.strip() else {}
        transport = data.get("transport", "webrtc")
        if transport != "webrtc":
            raise Refusal(
                "bad_query",
                f"transport {transport!r} is not served here (only webrtc)",
                CLOSE_POLICY,
                http_status=400,
            )
        body = data.get("body") or {}
        if not isinstance(body, dict):
            raise Refusal("bad_query", "body must be a JSON object", CLOSE_POLICY, http_status=400)
    except Refusal as refusal:
        return _refused(request, refusal, as_json=True)
    start_id = service.remember_start(body, dict(request.query_params))
    ice = [server.as_json() for server in service.ice_servers]
    return JSONResponse({"sessionId": start_id, "iceConfig": {"iceServers": ice}}, headers=_cors(request))


async def session_offer(request: Request) -> Response:
    start = _service(request).start_for(request.path_params["start_id"])
    if start is None:
        return JSONResponse({"detail": "Invalid or not-yet-ready session_id"}, 404, headers=_cors(request))
    if request.method == "PATCH":
        return await _candidates(request)
    return await _offer(request, start.body, start.query)


async def config_get(request: Request) -> Response:
    try:
        _require_access(request)
    except Refusal as refusal:
        return _refused(request, refusal, as_json=True)
    service = _service(request)
    settings = request.app.state.settings
    body: dict[str, Any] = {
        "available": bool(service.available),
        "ice_servers": [server.as_json() for server in service.ice_servers],
        "whip": WHIP_PATH,
        "offer": OFFER_PATH,
        "peer_timeout_s": settings.webrtc_peer_timeout_s,
        "connect_timeout_s": settings.webrtc_connect_timeout_s,
    }
    if not service.available:
        body["reason"] = service.unavailable_reason
    return JSONResponse(body, headers={"cache-control": "no-store", **_cors(request)})


def router(lifespan: Any) -> APIRouter:
    r = APIRouter(lifespan=lifespan)
    r.add_api_route(CONFIG_PATH, config_get, methods=["GET"])
    r.add_api_route(WHIP_PATH, whip_post, methods=["POST"])
    r.add_api_route(WHIP_PATH, preflight, methods=["OPTIONS"])
    r.add_api_route(WHIP_PATH + "/{call_id}", whip_delete, methods=["DELETE"])
    r.add_api_route(WHIP_PATH + "/{call_id}", whip_patch, methods=["PATCH"])
    r.add_api_route(WHIP_PATH + "/{call_id}", preflight, methods=["OPTIONS"])
    r.add_api_route(WHIP_PATH + "/{call_id}", whip_other, methods=["GET", "HEAD", "POST", "PUT"])
    r.add_api_route(OFFER_PATH, offer_post, methods=["POST"])
    r.add_api_route(OFFER_PATH, offer_patch, methods=["PATCH"])
    r.add_api_route(OFFER_PATH, preflight, methods=["OPTIONS"])
    r.add_api_route("/start", start_post, methods=["POST"])
    r.add_api_route("/start", preflight, methods=["OPTIONS"])
    r.add_api_route("/sessions/{start_id}/api/offer", session_offer, methods=["POST", "PATCH"])
    r.add_api_route("/sessions/{start_id}/api/offer", preflight, methods=["OPTIONS"])
    return r
