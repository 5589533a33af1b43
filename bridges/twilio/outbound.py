"""Twilio's own routes beside the phone call's: outbound calls and the transfer whisper.

| route                  | what                                                              |
| ---------------------- | ----------------------------------------------------------------- |
| `POST /twilio/call`    | place an outbound call (Bearer token); answered at `/twilio/voice` |
| `POST /twilio/whisper` | what a transfer's far end hears first (signed)                    |
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from personaplex_phone.service import read_body
from personaplex_phone.urls import public_base
from pydantic import BaseModel, Field

from personaplex_voice.engine.base import PersonaError
from personaplex_voice.errors import UserError
from personaplex_voice.untrusted import ascii_int_or_none, loads

from . import twiml
from .calls import WHISPER_PATH

if TYPE_CHECKING:
    from personaplex_phone.service import PhoneService

    from .carrier import TwilioCarrier

XML = "application/xml"


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


def twilio_routes(service: PhoneService, carrier: TwilioCarrier) -> APIRouter:
    async def place_call(request: Request) -> Response:
        if not service.authorized(request):
            return JSONResponse({"error": "unauthorized"}, status_code=401)
        raw = await read_body(request, service.body_timeout_s, carrier.name)
        try:
            body = OutboundCall.model_validate(loads(raw))
        except ValueError as exc:  # InputRefused, pydantic's ValidationError
            return JSONResponse({"error": f"bad request: {exc}"}, status_code=400)
        token = None
        persona_name = body.persona or service.book.default
        try:
            spec = service.book.spec(persona_name)
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
            token = service.registry.add_outbound(persona_name, overrides, ttl_s=120.0)
        try:
            call_sid = await carrier.calls.place_call_async(
                body.to,
                body.from_,
                persona=None if token else persona_name,
                outbound_token=token,
                public_url=public_base(service.settings, request),
                variables=body.variables,
            )
        except UserError as exc:
            return JSONResponse({"error": str(exc)}, status_code=502)
        journal = service.registry.status(
            call_sid, carrier.name, "requested", direction="outbound-api", from_=body.from_, to=body.to
        )
        journal.set_persona(persona_name)
        return JSONResponse({"call_sid": call_sid, "persona": persona_name}, status_code=201)

    async def whisper(request: Request) -> Response:
        """What a transfer's far end hears before being connected (its `<Number url>`)."""
        webhook = await service.webhook(carrier, request)
        if webhook is None:
            return Response("invalid Twilio signature", status_code=403, media_type="text/plain")
        spec = service.book.specs.get(request.query_params.get("persona", ""))
        rule_index = request.query_params.get("rule", "")
        message = None
        index = ascii_int_or_none(rule_index, 6)
        if spec is not None and index is not None and index < len(spec.actions):
            message = spec.actions[index].whisper
        return Response(twiml.say_only(message) if message else "<Response/>", media_type=XML)

    router = APIRouter()
    router.add_api_route("/twilio/call", place_call, methods=["POST"])
    router.add_api_route(WHISPER_PATH, whisper, methods=["POST"], include_in_schema=False)
    return router
