"""The `/twilio/*` routes and the state they share (settings, personas, calls, REST client)."""

from __future__ import annotations

import hmac
import logging
from typing import Any
from urllib.parse import parse_qsl

from fastapi import APIRouter, FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from personaplex_voice.engine.base import CapacityError, Persona, PersonaError, Sampling
from personaplex_voice.errors import UserError

from . import twiml
from .calls import MEDIA_STREAM_PATH, STATUS_PATH, VOICE_PATH, CallControl
from .config import TwilioSettings
from .media_stream import CLOSE_POLICY, MediaStreamCall, ProtocolError
from .personas import PersonaBook
from .registry import CallRegistry
from .signatures import SignatureChecker, public_base, websocket_base

log = logging.getLogger(__name__)

XML = "application/xml"
TERMINAL_STATUSES = {"completed", "busy", "failed", "no-answer", "canceled"}


MAX_FORM_BYTES = 64 * 1024


async def read_form(request: Request) -> dict[str, str]:
    """Twilio posts `application/x-www-form-urlencoded`; parsed here without python-multipart."""
    body = b""
    async for piece in request.stream():
        body += piece
        if len(body) > MAX_FORM_BYTES:
            return {}  # no signature can match an empty form for a real webhook: rejected
    return dict(parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True))


class OutboundCall(BaseModel):
    """Body of POST /twilio/call. `persona` names one from the personas file; `text_prompt` /
    `voice` define a one-off persona instead (the endpoint is authenticated)."""

    to: str = Field(min_length=2, max_length=64)
    from_: str = Field(alias="from", min_length=2, max_length=64)
    persona: str | None = Field(None, max_length=64)
    text_prompt: str | None = Field(None, max_length=8000)
    voice: str | None = Field(None, max_length=64)
    seed: int | None = None

    model_config = {"populate_by_name": True}


class TwilioBridge:
    def __init__(self, app: FastAPI, settings: TwilioSettings, calls: CallControl, book: PersonaBook):
        self.app = app
        self.settings = settings
        self.calls = calls
        self.book = book
        self.registry = CallRegistry()
        self.signatures = SignatureChecker(settings)

    @property
    def manager(self) -> Any:
        return self.app.state.manager

    def stream_persona_name(self, ticket_id: str, params: dict[str, Any], call_sid: str) -> str:
        """Check a stream's ticket against the call our webhook issued it for; returns the
        persona's name (for the record). The persona itself travels with the manager's ticket,
        so a stream that reaches another front-end than its webhook still gets it."""
        try:
            issued = self.registry.claim(ticket_id, call_sid)
        except LookupError:
            raise ProtocolError("the stream ticket belongs to another call") from None
        if issued is None:
            return str(params.get("persona") or "")
        return issued.persona_name

    def authorized(self, request: Request) -> bool:
        """Bearer token: the bridge's PERSONAPLEX_TWILIO_API_TOKEN or the server's API key."""
        keys = [self.settings.api_token.get_secret_value()]
        server_settings = getattr(self.app.state, "settings", None)
        server_key = getattr(server_settings, "api_key", None)
        if server_key is not None:
            keys.append(server_key.get_secret_value())
        header = request.headers.get("authorization", "")
        given = header[7:].strip() if header.lower().startswith("bearer ") else ""
        return bool(given) and any(k and hmac.compare_digest(given, k) for k in keys)

    # --- webhooks ---------------------------------------------------------------------------
    async def voice(self, request: Request) -> Response:
        form = await read_form(request)
        if not self.signatures.check_webhook(request, form):
            return Response("invalid Twilio signature", status_code=403, media_type="text/plain")
        call_sid = form.get("CallSid", "")
        direction = form.get("Direction", "inbound")
        record = self.registry.status(
            call_sid, "webhook", direction=direction, from_=form.get("From", ""), to=form.get("To", "")
        )
        try:
            persona_name, persona = self._persona_for_call(request, form)
        except PersonaError as exc:
            log.warning("twilio: call %s has no usable persona: %s", call_sid, exc)
            record.end_reason = f"persona: {exc}"
            return Response(twiml.say_and_hang_up("Sorry, this line is not configured."), media_type=XML)
        record.persona = persona_name
        manager = self.manager
        try:
            if manager is None:  # the engine is still loading
                raise CapacityError("the engine is still loading")
            ttl_s = self.settings.stream_connect_timeout_s
            ticket = manager.reserve(ttl_s=ttl_s, persona=persona)
        except CapacityError:
            record.end_reason = "busy"
            self.registry.status(call_sid, "busy")
            return Response(twiml.say_and_hang_up(self.settings.busy_message), media_type=XML)
        self.registry.issued(ticket.id, persona_name, call_sid, ttl_s)
        base = public_base(self.settings, request)
        # The ticket is the Stream URL's last segment: Twilio signs the upgrade over it.
        answer = twiml.connect_stream(
            websocket_base(base) + MEDIA_STREAM_PATH + "/" + ticket.id, {"persona": persona_name}
        )
        return Response(answer, media_type=XML)

    def _persona_for_call(self, request: Request, form: dict[str, str]) -> tuple[str, Persona]:
        outbound = request.query_params.get("outbound")
        if outbound:  # a one-off persona from POST /twilio/call (the URL is part of the signature)
            found = self.registry.take_outbound(outbound)
            if found is None:
                raise PersonaError("the outbound call request expired")
            return found.persona_name, found.persona
        name = request.query_params.get("persona") or self.book.for_number(form.get("To", ""))
        return name, self.book.get(name)

    async def status(self, request: Request) -> Response:
        form = await read_form(request)
        if not self.signatures.check_webhook(request, form):
            return Response("invalid Twilio signature", status_code=403, media_type="text/plain")
        call_sid = form.get("CallSid", "")
        status = form.get("CallStatus", "unknown")
        record = self.registry.status(
            call_sid,
            status,
            direction=form.get("Direction", ""),
            from_=form.get("From", ""),
            to=form.get("To", ""),
        )
        if status in TERMINAL_STATUSES:
            cancelled = [t for t in self.registry.tickets_for_call(call_sid) if self._cancel(t)]
            if cancelled:
                log.info("twilio: call %s ended (%s) before its stream started", call_sid, status)
        if form.get("CallDuration"):
            record.metrics.setdefault("call_duration_s", form["CallDuration"])
        log.info("twilio: call %s status %s", call_sid, status)
        return Response(status_code=204)

    def _cancel(self, ticket_id: str) -> bool:
        manager = self.manager
        return manager is not None and manager.cancel(ticket_id)

    async def media_stream(self, ws: WebSocket) -> None:
        ticket = ws.path_params.get("ticket", "")
        if not self.signatures.check_upgrade(ws):
            await ws.close(code=CLOSE_POLICY)  # before accept: the client gets HTTP 403
            return
        await ws.accept()
        await MediaStreamCall(ws, self, ticket).run()

    async def unticketed_stream(self, ws: WebSocket) -> None:
        """The bare stream URL: refused. Its signature never changes, so anyone who saw one
        upgrade could open streams at will; every stream comes from our webhook's ticketed URL."""
        log.warning("twilio: refused a media stream without a ticket (point the number at %s)", VOICE_PATH)
        await ws.close(code=CLOSE_POLICY)

    # --- call control -----------------------------------------------------------------------
    async def place_call(self, request: Request) -> Response:
        if not self.authorized(request):
            return JSONResponse({"error": "unauthorized"}, status_code=401)
        try:
            body = OutboundCall.model_validate(await request.json())
        except Exception as exc:
            return JSONResponse({"error": f"bad request: {exc}"}, status_code=400)
        token = None
        persona_name = body.persona or self.book.default
        try:
            if body.text_prompt is not None or body.voice is not None or body.seed is not None:
                base = self.book.get(persona_name)
                persona = Persona(
                    text_prompt=body.text_prompt if body.text_prompt is not None else base.text_prompt,
                    voice=body.voice if body.voice is not None else base.voice,
                    sampling=base.sampling if isinstance(base.sampling, Sampling) else Sampling(),
                    seed=body.seed if body.seed is not None else base.seed,
                )
                # Kept until the callee answers (Twilio's ring timeout is 60 s at most).
                token = self.registry.add_outbound(persona_name, persona, ttl_s=120.0)
            else:
                self.book.get(persona_name)
        except PersonaError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        try:
            call_sid = await self.calls.place_call_async(
                body.to,
                body.from_,
                persona=None if token else persona_name,
                outbound_token=token,
                public_url=public_base(self.settings, request),
            )
        except UserError as exc:
            return JSONResponse({"error": str(exc)}, status_code=502)
        self.registry.status(call_sid, "requested", direction="outbound-api", from_=body.from_, to=body.to)
        self.registry.record(call_sid).persona = persona_name
        return JSONResponse({"call_sid": call_sid, "persona": persona_name}, status_code=201)

    async def list_calls(self, request: Request) -> Response:
        if not self.authorized(request):
            return JSONResponse({"error": "unauthorized"}, status_code=401)
        manager = self.manager
        if manager is None:
            return JSONResponse({"error": "the engine is still loading"}, status_code=503)
        live = {sid: call.metrics() for sid, call in list(self.registry.live.items())}
        return JSONResponse(
            {
                "capacity": manager.capacity,
                "active_sessions": manager.active_count,
                "reserved": manager.reserved_count,
                "live_streams": live,
                "calls": [r.to_dict() for r in list(self.registry.calls.values())[-100:]],
            }
        )


def build_router(bridge: TwilioBridge) -> APIRouter:
    router = APIRouter()
    router.add_api_route(VOICE_PATH, bridge.voice, methods=["POST"], include_in_schema=False)
    router.add_api_route(STATUS_PATH, bridge.status, methods=["POST"], include_in_schema=False)
    router.add_api_route("/twilio/call", bridge.place_call, methods=["POST"])
    router.add_api_route("/twilio/calls", bridge.list_calls, methods=["GET"])
    router.add_api_websocket_route(MEDIA_STREAM_PATH + "/{ticket}", bridge.media_stream)
    router.add_api_websocket_route(MEDIA_STREAM_PATH, bridge.unticketed_stream)
    return router
