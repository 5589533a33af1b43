"""The `/twilio/*` webhooks and the state they share (settings, personas, calls, REST client).

The voice webhook decides who answers and what the agent knows about this caller: the
persona for the number, its prompt template filled with the call's values (context.py), a slot
reserved in the session manager with that rendered persona, and a `<Connect><Stream>` whose URL
ends with the reservation's ticket. The call list, records and the calls page are calls_api.py.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from personaplex_voice.engine.base import CapacityError, Persona, PersonaError
from personaplex_voice.errors import UserError
from personaplex_voice.session_api import SessionHost

from . import twiml
from .calls import MEDIA_STREAM_PATH, VOICE_PATH, CallControl
from .config import TwilioSettings
from .context import CALL_FACTS, facts_body, fetch_context, pick_declared
from .http_out import HttpOut
from .media_stream import CallServices, MediaStreamCall
from .personas import RESERVED_QUERY, PersonaBook, PersonaSpec
from .phone_call import CallOutputs, Parking, PhoneCall
from .records import RecordStore
from .registry import HISTORY, CallRegistry
from .signatures import SignatureChecker, public_base, websocket_base
from .webhooks import PostCallWebhooks, signed_headers
from .wire import CLOSE_POLICY

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
    `voice` / `seed` override it for this call (the endpoint is authenticated); `variables` fill
    the persona's template, as a flow's query parameters would."""

    to: str = Field(min_length=2, max_length=64)
    from_: str = Field(alias="from", min_length=2, max_length=64)
    persona: str | None = Field(None, max_length=64)
    text_prompt: str | None = Field(None, max_length=8000)
    voice: str | None = Field(None, max_length=64)
    seed: int | None = None
    variables: dict[str, str] = Field(default_factory=dict, max_length=64)

    model_config = {"populate_by_name": True}


class TwilioBridge:
    def __init__(
        self,
        app: FastAPI,
        settings: TwilioSettings,
        calls: CallControl,
        book: PersonaBook,
        records_dir: Path | None = None,
    ):
        self.app = app
        self.settings = settings
        self.calls = calls
        self.book = book
        self.registry = CallRegistry()
        self.signatures = SignatureChecker(settings)
        self.http = HttpOut()
        self.webhooks = PostCallWebhooks(
            self.http,
            retry_for_s=settings.webhook_retry_s,
            first_backoff_s=settings.webhook_backoff_s,
            attempt_timeout_s=settings.webhook_timeout_s,
        )
        self.store = (
            RecordStore(
                records_dir,
                max_age_s=settings.records_max_age_days * 86400,
                max_bytes=round(settings.records_max_mb * (1 << 20)),
            )
            if records_dir is not None
            else None
        )
        self.outputs = CallOutputs(
            self.store, self.webhooks, settings.webhook_secret.get_secret_value(), self._live_call_sids
        )
        self._check_personas()
        self.parking = Parking(settings.resume_timeout_s, self._give_up)
        self.services = CallServices(
            settings, lambda: self.manager, self.registry, calls, book, self.outputs, self.parking
        )
        # Records of earlier runs (newest first), for the call list; this run's are in the registry.
        self.past: list[dict[str, Any]] = self.store.recent(HISTORY) if self.store is not None else []
        if self.store is not None:
            self.store.sweep(frozenset())

    def _check_personas(self) -> None:
        for spec in self.book.specs.values():
            if spec.webhook_url and not self.outputs.secret_for(spec):
                where = (
                    f"${spec.webhook_secret_env}"
                    if spec.webhook_secret_env
                    else "PERSONAPLEX_TWILIO_WEBHOOK_SECRET"
                )
                raise UserError(f"persona {spec.name!r}: webhook_url needs a signing secret: set {where}")
            if spec.record and self.store is None:
                log.warning("twilio: persona %r asks for recordings, but no --records-dir is set", spec.name)

    @property
    def manager(self) -> SessionHost | None:
        """The server's session host (None while the engine loads)."""
        return self.app.state.host

    def _live_call_sids(self) -> set[str]:
        return {call.call_sid for call in list(self.registry.live.values())} | self.parking.call_sids

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
        query = dict(request.query_params)
        stream_base = websocket_base(public_base(self.settings, request)) + MEDIA_STREAM_PATH + "/"
        resume = query.get("resume")
        if resume and self.parking.holds(resume, call_sid):
            # Back from a `play … then: resume`: the held session continues on a new stream.
            return Response(
                twiml.connect_stream(stream_base + resume, {"persona": record.persona}), media_type=XML
            )
        try:
            persona_name, spec, overrides = self._persona_for_call(query, form)
        except PersonaError as exc:
            log.warning("twilio: call %s has no usable persona: %s", call_sid, exc)
            record.end_reason = f"persona: {exc}"
            return Response(twiml.say_and_hang_up("Sorry, this line is not configured."), media_type=XML)
        record.persona = persona_name
        manager = self.manager
        if manager is None or manager.available <= 0:  # full: no context lookup for a busy line
            return self._busy(call_sid, record)
        flow = pick_declared({k: v for k, v in query.items() if k not in RESERVED_QUERY}, spec.variables)
        values = await self._call_values(spec, form, flow)
        facts = {"From": form.get("From", ""), "To": form.get("To", ""), "CallSid": call_sid}
        persona = spec.render({**values, **facts})
        if overrides:
            persona = Persona(
                text_prompt=overrides.get("text_prompt", persona.text_prompt),
                voice=overrides.get("voice", persona.voice),
                sampling=persona.sampling,
                seed=overrides.get("seed", persona.seed),
            )
        try:
            ttl_s = self.settings.stream_connect_timeout_s
            ticket = manager.reserve(ttl_s=ttl_s, persona=persona)
        except CapacityError:
            return self._busy(call_sid, record)
        self.registry.issued(ticket.id, persona_name, call_sid, ttl_s, variables=values)
        # The ticket is the Stream URL's last segment: Twilio signs the upgrade over it. The
        # flow's values travel beside it, so a stream served by another front-end knows them.
        answer = twiml.connect_stream(stream_base + ticket.id, {"persona": persona_name, **flow})
        return Response(answer, media_type=XML)

    def _busy(self, call_sid: str, record: Any) -> Response:
        record.end_reason = "busy"
        self.registry.status(call_sid, "busy")
        return Response(twiml.say_and_hang_up(self.settings.busy_message), media_type=XML)

    def _persona_for_call(
        self, query: dict[str, str], form: dict[str, str]
    ) -> tuple[str, PersonaSpec, dict[str, Any]]:
        outbound = query.get("outbound")
        if outbound:  # a one-off persona from POST /twilio/call (the URL is part of the signature)
            found = self.registry.take_outbound(outbound)
            if found is None:
                raise PersonaError("the outbound call request expired")
            return found.persona_name, self.book.spec(found.persona_name), found.overrides
        name = query.get("persona") or self.book.for_number(form.get("To", ""))
        return name, self.book.spec(name), {}

    async def _call_values(
        self, spec: PersonaSpec, form: dict[str, str], flow: dict[str, str]
    ) -> dict[str, str]:
        """The declared variables for this call: defaults < the flow's < the context lookup's."""
        values = {**spec.variables, **flow}
        if spec.context_url:
            body = facts_body(
                {
                    "call_sid": form.get("CallSid", ""),
                    "from": form.get("From", ""),
                    "to": form.get("To", ""),
                    "direction": form.get("Direction", "inbound"),
                    "persona": spec.name,
                    "variables": values,
                }
            )
            headers = signed_headers(self.outputs.secret_for(spec), body, "call.context")
            fetched = await fetch_context(self.http, spec.context_url, body, spec.context_timeout_s, headers)
            values.update(pick_declared(fetched, spec.variables))
        return {k: v for k, v in values.items() if k not in CALL_FACTS}

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
            held = self.parking.release(call_sid)
            if held is not None:  # the caller hung up during a message, before coming back
                await self._close_held(held, f"caller hung up ({status}) during a message")
        if form.get("CallDuration"):
            record.metrics.setdefault("call_duration_s", form["CallDuration"])
        log.info("twilio: call %s status %s", call_sid, status)
        return Response(status_code=204)

    async def whisper(self, request: Request) -> Response:
        """What a transfer's far end hears before being connected (its `<Number url>`)."""
        form = await read_form(request)
        if not self.signatures.check_webhook(request, form):
            return Response("invalid Twilio signature", status_code=403, media_type="text/plain")
        spec = self.book.specs.get(request.query_params.get("persona", ""))
        rule_index = request.query_params.get("rule", "")
        message = None
        if spec is not None and rule_index.isdigit() and int(rule_index) < len(spec.actions):
            message = spec.actions[int(rule_index)].whisper
        return Response(twiml.say_only(message) if message else "<Response/>", media_type=XML)

    def _cancel(self, ticket_id: str) -> bool:
        manager = self.manager
        return manager is not None and manager.cancel(ticket_id)

    async def _give_up(self, call: PhoneCall, reason: str) -> None:
        """A held call that did not come back: end it for good."""
        await self._close_held(call, reason)
        await self.calls.hang_up_async(call.call_sid)

    async def _close_held(self, call: PhoneCall, reason: str) -> None:
        if call.session is not None:
            with contextlib.suppress(Exception):
                await call.session.close(reason="client")
        await call.finish(reason, call.record.metrics)

    async def media_stream(self, ws: WebSocket) -> None:
        ticket = ws.path_params.get("ticket", "")
        if not self.signatures.check_upgrade(ws):
            await ws.close(code=CLOSE_POLICY)  # before accept: the client gets HTTP 403
            return
        await ws.accept()
        await MediaStreamCall(ws, ticket, self.services, public_base(self.settings, ws)).run()

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
            spec = self.book.spec(persona_name)
        except PersonaError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        undeclared = sorted(set(body.variables) - set(spec.variables))
        if undeclared:
            return JSONResponse(
                {"error": f"persona {persona_name!r} declares no variable(s) {', '.join(undeclared)}"},
                status_code=400,
            )
        overrides = {
            key: value
            for key, value in (("text_prompt", body.text_prompt), ("voice", body.voice), ("seed", body.seed))
            if value is not None
        }
        if overrides:
            # Kept until the callee answers (Twilio's ring timeout is 60 s at most).
            token = self.registry.add_outbound(persona_name, overrides, ttl_s=120.0)
        try:
            call_sid = await self.calls.place_call_async(
                body.to,
                body.from_,
                persona=None if token else persona_name,
                outbound_token=token,
                public_url=public_base(self.settings, request),
                variables=body.variables,
            )
        except UserError as exc:
            return JSONResponse({"error": str(exc)}, status_code=502)
        self.registry.status(call_sid, "requested", direction="outbound-api", from_=body.from_, to=body.to)
        self.registry.record(call_sid).persona = persona_name
        return JSONResponse({"call_sid": call_sid, "persona": persona_name}, status_code=201)


def records_dir_for(settings: TwilioSettings, app: FastAPI) -> Path | None:
    """The bridge's own setting, else the server's `--records-dir`."""
    server = getattr(app.state, "settings", None)
    chosen = settings.records_dir or getattr(server, "records_dir", None)
    return Path(os.path.expanduser(str(chosen))) if chosen else None
