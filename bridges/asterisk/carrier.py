"""Asterisk as a carrier of the phone call: AudioSocket and chan_websocket, one carrier.

Asterisk handles SIP and RTP and streams each call's audio to us, over AudioSocket (TCP, our
listener) or over chan_websocket (a WebSocket Asterisk opens to `/asterisk/media`). Neither
carries credentials we can check, and Asterisk sends no signed webhooks, so every call starts
with the dialplan asking us for it: `POST /asterisk/calls` (API key) does what every carrier's
answer webhook does (persona for the number, template filled from the body's variables and the
context lookup, a slot reserved) and answers a fresh UUID that opens one stream, once (see
tickets.py). Actions continue in the dialplan after our leg (control.py). Everything else is the
phone call's.
"""

from __future__ import annotations

import base64
import hmac
import json
import logging
import re
import secrets
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import JSONResponse, Response
from personaplex_phone import carrier as phone
from personaplex_phone.carrier import (
    CLOSE_POLICY,
    CallFacts,
    CallHandle,
    CallStatus,
    CarrierPaths,
    Reply,
    Webhook,
)
from personaplex_phone.carrier_kit import CarrierDefaults
from personaplex_phone.link import WebSocketLink
from personaplex_phone.urls import public_base
from starlette.requests import HTTPConnection

from personaplex_voice import untrusted

from . import media_ws
from .config import AsteriskSettings
from .control import AsteriskControl
from .listener import AudioSocketLink, AudioSocketListener
from .tickets import AsteriskTicket, NextSteps, TicketBook
from .wire import AudioSocketWire, MediaWebSocketWire

log = logging.getLogger(__name__)

JSON_TYPE = "application/json"
CALLS_PATH = "/asterisk/calls"
MEDIA_PATH = "/asterisk/media"
# Body fields that are facts of the call, not the flow's variables.
FACT_FIELDS = frozenset({"persona", "from", "to", "call_id", "channel_id", "direction", "variables"})
_UNSAFE = re.compile(r"[^A-Za-z0-9.:_-]")


def flatten(body: Mapping[str, Any]) -> dict[str, str]:
    """A JSON body as fields: scalars as text, the `variables` object as `variables.<name>`."""
    fields: dict[str, str] = {}
    for key, value in body.items():
        if key == "variables" and isinstance(value, dict):
            for name, item in value.items():
                if isinstance(item, str | int | float | bool):
                    fields[f"variables.{name}"] = str(item)
        elif isinstance(value, str | int | float | bool):
            fields[str(key)] = str(value)
    return fields


def safe_call_id(value: str) -> str:
    """The dialplan's call id as a record's folder name (`${UNIQUEID}` is one already)."""
    cleaned = _UNSAFE.sub("-", value.strip())[:128].lstrip(".")
    return cleaned if len(cleaned) >= 2 else ""


class AsteriskCarrier(CarrierDefaults):
    name = "asterisk"
    paths = CarrierPaths(answer=CALLS_PATH, answer_methods=("POST",), status=None, media=MEDIA_PATH)
    stream_ends_on_close = True  # Asterisk ends a call's leg by closing the socket
    # A caller who starts talking over the agent clears it: AudioSocket by no longer sending
    # (Asterisk holds nothing of ours), chan_websocket with FLUSH_MEDIA.
    barge_in = True

    def __init__(self, service: Any, settings: AsteriskSettings, listen: tuple[str, int] | None = None):
        self.service = service
        self.settings = settings
        self.tickets = TicketBook()
        self.steps = NextSteps()
        self.control = AsteriskControl(settings, self.steps, service.rest.send, self._mint_resume)
        self.listener = (
            AudioSocketListener(listen[0], listen[1], settings.audiosocket_uuid_timeout_s, self._audiosocket)
            if listen is not None
            else None
        )
        if self.listener is not None:
            self.listener.bind()

    # --- checks ---------------------------------------------------------------------------------
    def _keys(self) -> list[str]:
        keys = [self.service.settings.api_token.get_secret_value()]
        server_key = getattr(getattr(self.service.app.state, "settings", None), "api_key", None)
        if server_key is not None:
            keys.append(server_key.get_secret_value())
        return [k for k in keys if k]

    def check(self) -> None:
        from personaplex_voice.errors import UserError

        if self.service.settings.validate_signatures and not self._keys():
            raise UserError(
                "asterisk: POST /asterisk/calls needs an API key: set PERSONAPLEX_PHONE_API_TOKEN "
                "(or the server's --api-key)"
            )

    def authorized(self, headers: Mapping[str, str]) -> bool:
        """Bearer token or X-API-Key: the phone API token or the server's API key."""
        if not self.service.settings.validate_signatures:
            return True
        auth = headers.get("authorization", "")
        given = auth[7:].strip() if auth.lower().startswith("bearer ") else headers.get("x-api-key", "")
        # Bytes: comparing a str with non-ASCII characters (a forged header's) raises TypeError.
        return bool(given) and any(hmac.compare_digest(given.encode(), key.encode()) for key in self._keys())

    # --- the answer: POST /asterisk/calls -------------------------------------------------------
    def fields(self, method: str, query: Mapping[str, str], body: bytes, content_type: str) -> dict[str, str]:
        """JSON (`variables` an object) or a form (what the dialplan's CURL() posts); ValueError
        for anything else (a JSON body out of bounds too: untrusted.loads), so the request is
        refused."""
        if not body.strip():
            return dict(query)
        if "json" in content_type.lower() or body.lstrip()[:1] == b"{":
            return flatten(untrusted.loads_object(body, what="the body"))
        return dict(parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True))

    def verify(self, webhook: Webhook) -> bool:
        return self.authorized(webhook.headers)

    def verify_upgrade(self, conn: HTTPConnection) -> bool:
        return False  # streams come to /asterisk/media with a UUID (routes below), never elsewhere

    def facts(self, webhook: Webhook) -> CallFacts:
        fields = webhook.fields
        call_id = safe_call_id(fields.get("call_id") or fields.get("channel_id") or "")
        if not call_id:  # no id from the dialplan: one of ours (replays then cannot be recognised)
            call_id = "ast-" + secrets.token_hex(12)
        return CallFacts(
            call_id=call_id,
            from_=fields.get("from", ""),
            to=fields.get("to", ""),
            direction=fields.get("direction") or "inbound",
        )

    def flow_values(self, webhook: Webhook) -> dict[str, str]:
        """The persona and the template's variables, from the body (the persona's declared
        variables are picked from these by the phone call)."""
        values: dict[str, str] = {}
        for key, value in webhook.fields.items():
            if key.startswith("variables."):
                values[key[len("variables.") :]] = value
            elif key not in FACT_FIELDS:
                values[key] = value
        if webhook.fields.get("persona"):
            values["persona"] = webhook.fields["persona"]
        return values

    def status(self, webhook: Webhook) -> CallStatus | None:
        return None  # Asterisk sends no status webhooks

    def stream_url(self, ws_base: str, ticket: str) -> str:
        # A UUID stands for the reservation: AudioSocket can carry nothing else.
        http_base = ws_base.removesuffix(MEDIA_PATH).replace("ws", "http", 1)
        ttl = self.service.settings.stream_connect_timeout_s
        entry = self.tickets.issue(ticket, ttl, public_base=http_base)
        return f"{ws_base}?ticket={entry.uuid}"

    def answer_stream(self, stream_url: str, params: Mapping[str, str], facts: CallFacts) -> Reply:
        uuid = dict(parse_qsl(urlsplit(stream_url).query)).get("ticket", "")
        entry = self.tickets.find(uuid)
        if entry is not None:
            entry.call_id, entry.persona = facts.call_id, params.get("persona", "")
        self.steps.link(uuid, facts.call_id)
        body = {
            "uuid": uuid,
            "call_id": facts.call_id,
            "persona": params.get("persona", ""),
            "media_url": stream_url,
            "expires_in_s": self.service.settings.stream_connect_timeout_s,
        }
        return Reply(json.dumps(body), JSON_TYPE)

    def answer_refusal(self, message: str, busy: bool) -> Reply:
        body = {"uuid": "", "error": "busy" if busy else "refused", "say": message}
        return Reply(json.dumps(body), JSON_TYPE, status=503 if busy else 403)

    def new_wire(self) -> MediaWebSocketWire:
        # Unused: each stream's wire is built with its call (routes below); kept for the protocol.
        return MediaWebSocketWire(AsteriskTicket("", "", 0.0))

    # --- streams --------------------------------------------------------------------------------
    def _mint_resume(self, call: CallHandle, resume: phone.Resume) -> str:
        """The UUID a parked call comes back to the agent with (a `play … then: resume`)."""
        ttl = self.service.settings.resume_timeout_s
        entry = self.tickets.issue(resume.token, ttl, public_base=call.public_base, resume=True)
        entry.call_id, entry.persona = call.call_id, resume.persona
        self.steps.link(entry.uuid, call.call_id)
        return entry.uuid

    async def _run(self, link: Any, entry: AsteriskTicket, base: str, wire: Any) -> None:
        # A leg that ends before its audio begins gives its reservation back (the phone call's
        # stream does, as on every carrier).
        await self.service.run_stream(self, link, entry.ticket, entry.public_base or base, wire)

    async def _audiosocket(self, link: AudioSocketLink, uuid: str, peer: str) -> None:
        entry = self.tickets.take(uuid)
        if entry is None:
            if self.listener is not None:
                self.listener.refused += 1
            log.warning("asterisk: refused an AudioSocket call from %s: unknown or used UUID %s", peer, uuid)
            await link.close()
            return
        base = self.service.settings.public_url
        await self._run(link, entry, base, AudioSocketWire(entry, self.settings.rate_0x11))

    def media_credentials_ok(self, headers: Mapping[str, str]) -> bool:
        """websocket_client.conf's username/password, when configured here (HTTP Basic)."""
        user, password = self.settings.media_username, self.settings.media_password.get_secret_value()
        if not user and not password:
            return True
        expected = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
        return hmac.compare_digest(headers.get("authorization", "").encode(), expected.encode())

    async def media_socket(self, ws: WebSocket) -> None:
        """`WS /asterisk/media?ticket=UUID` (or `/asterisk/media/UUID`): a chan_websocket leg."""
        if not self.media_credentials_ok(ws.headers):
            log.warning("asterisk: refused a media WebSocket with wrong or missing credentials")
            await ws.close(code=CLOSE_POLICY)
            return
        key = ws.path_params.get("ticket") or ws.query_params.get("ticket", "")
        entry = self.tickets.take(key)
        if entry is None:
            log.warning("asterisk: refused a media WebSocket without a valid ticket")
            await ws.close(code=CLOSE_POLICY)  # before accept: the client gets HTTP 403
            return
        link = await WebSocketLink.accept(ws, media_ws.SUBPROTOCOL)
        base = public_base(self.service.settings, ws)
        await self._run(link, entry, base, MediaWebSocketWire(entry))

    async def next_step(self, request: Request) -> Response:
        """`GET /asterisk/calls/{key}/next`: what the dialplan does after our leg (control.py)."""
        if not self.authorized({k.lower(): v for k, v in request.headers.items()}):
            return JSONResponse({"error": "unauthorized"}, status_code=401)
        call_id = self.steps.call_of(request.path_params["key"])
        if call_id is None:
            return JSONResponse({"error": "no such call"}, status_code=404)
        live = any(s.call_sid == call_id for s in list(self.service.registry.live.values()))
        step = self.steps.get(call_id) or {"action": "agent" if live else "hangup"}
        journal = self.service.registry.find(call_id)
        reason = getattr(getattr(journal, "record", None), "end_reason", "") or ""
        return JSONResponse({**step, "call_id": call_id, "reason": reason})

    def routes(self, service: Any) -> APIRouter:
        router = APIRouter(lifespan=self._lifespan if self.listener is not None else None)
        router.add_api_route(f"{CALLS_PATH}/{{key}}/next", self.next_step, methods=["GET"])
        router.add_api_websocket_route(MEDIA_PATH, self.media_socket)
        router.add_api_websocket_route(MEDIA_PATH + "/{ticket}", self.media_socket)
        return router

    def _lifespan(self, app: Any) -> Any:
        import contextlib

        @contextlib.asynccontextmanager
        async def run(_app: Any) -> Any:
            assert self.listener is not None
            await self.listener.start()
            try:
                yield
            finally:
                await self.listener.stop()

        return run(app)
