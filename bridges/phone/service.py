"""The phone service: one per server, shared by every carrier mounted on it.

It holds what calls share (settings, personas, the call registry, records, post-call webhooks,
calls on hold) and answers each carrier's webhooks the same way: check the carrier's signature,
decide who answers and what the agent knows about this caller (the persona for the number and
carrier, its prompt template filled with the call's values, context.py), reserve a slot in the
session manager with that rendered persona, and answer with the carrier's markup for a stream
whose URL ends with the reservation's ticket. Where the platform sends no answer webhook (the
stream itself is the call's arrival: Genesys), the stream's start is admitted the same way
(`admit_stream`) and its ticket never leaves the server. The stream itself is stream.py; the
call list, records and the calls page are calls_api.py.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import hmac
import logging
import os
import secrets
import shutil
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from fastapi import FastAPI, HTTPException, Request, WebSocket
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from personaplex_voice.engine.base import CapacityError, Persona, PersonaError, SaturatedError
from personaplex_voice.errors import UserError
from personaplex_voice.metrics import LabelledSnapshot
from personaplex_voice.session_api import SessionHost
from personaplex_voice.untrusted import InputRefused, ascii_int

from .audio_path import InboundAudio, OutboundAudio
from .carrier import (
    CLOSE_POLICY,
    AudioFormat,
    CallFacts,
    Carrier,
    Refused,
    Reply,
    StreamStart,
    StreamWire,
    Webhook,
)
from .config import PhoneSettings
from .context import CALL_FACTS, facts_body, fetch_context, pick_declared
from .http_out import HttpOut
from .link import StreamLink, WebSocketLink
from .metrics import PhoneMetrics
from .personas import RESERVED_QUERY, PersonaBook, PersonaSpec
from .phone_call import CallOutputs, Parking, PhoneCall
from .records import RecordStore
from .registry import HISTORY, CallRegistry, StreamTicket
from .rest import RestClient
from .stream import CallServices, PhoneStream
from .urls import public_base, public_url_of, websocket_base
from .webhooks import PostCallWebhooks, signed_headers

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024
# How long a webhook's body may take to arrive once its head has: the server's
# PERSONAPLEX_HTTP_REQUEST_TIMEOUT_S (the head's limit, and /api/prompts' body's), else this.
BODY_TIMEOUT_S = 10.0
# What a carrier's parsing or signature check may raise on input it cannot read: the peer's
# fault (a refusal and one WARNING line), never a 500.
UNREADABLE = (ValueError, OverflowError, RecursionError)
# A signature check that raises at all has not verified anything (TypeError too: a str compared
# with one that has non-ASCII characters in it).
UNVERIFIABLE = (*UNREADABLE, TypeError)
ENDED_MESSAGE = "This call has ended."
UNCONFIGURED_MESSAGE = "Sorry, this line is not configured."
# The line rates calls come at: their resampling filters are designed when the service starts
# (tens of ms each), not while the first caller's audio waits.
LINE_RATES = (8000, 16000)


class _TooLarge(Exception):
    pass


async def read_body(request: Request, timeout_s: float = BODY_TIMEOUT_S, who: str = "phone") -> bytes:
    """The request's whole body, within MAX_BODY_BYTES and `timeout_s`; HTTPException otherwise:
    413 (too large), 408 (it stopped coming), 400 (the client left half way: INFO, not an error)."""
    declared = request.headers.get("content-length")
    try:
        too_large = declared is not None and ascii_int(declared.strip()) > MAX_BODY_BYTES
    except InputRefused:
        too_large = True  # the HTTP parser takes only digits here; a number too long is too large
    if too_large:
        log.warning("%s: refused a webhook of %s bytes (at most %d)", who, declared, MAX_BODY_BYTES)
        raise HTTPException(413, f"a webhook body is at most {MAX_BODY_BYTES} bytes")
    body = bytearray()

    async def read() -> None:
        async for piece in request.stream():
            body.extend(piece)
            if len(body) > MAX_BODY_BYTES:
                raise _TooLarge

    try:
        await asyncio.wait_for(read(), timeout_s)
    except _TooLarge:
        log.warning("%s: refused a webhook body over %d bytes", who, MAX_BODY_BYTES)
        raise HTTPException(413, f"a webhook body is at most {MAX_BODY_BYTES} bytes") from None
    except TimeoutError:
        log.warning(
            "%s: refused a webhook whose body did not arrive within %g s (%d bytes came)",
            who,
            timeout_s,
            len(body),
        )
        raise HTTPException(408, f"the body did not arrive within {timeout_s:g} s") from None
    except ClientDisconnect:
        log.info("%s: a webhook's client left before its body arrived", who)
        raise HTTPException(400, "the body did not arrive") from None
    return bytes(body)


def form_fields(body: bytes) -> dict[str, str]:
    """`application/x-www-form-urlencoded`, parsed without python-multipart."""
    return dict(parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True))


def plain(text: str, status: int) -> Response:
    return Response(text, status_code=status, media_type="text/plain")


def as_response(reply: Reply) -> Response:
    return Response(reply.body, status_code=reply.status, media_type=reply.media_type)


class InstructionDocs:
    """Documents of ours a carrier fetches by URL (what a live call is told to do next, on
    carriers that take a URL rather than the document itself), kept a while under random tokens."""

    TTL_S = 600.0
    MAX_DOCS = 1000

    def __init__(self) -> None:
        self._docs: OrderedDict[str, tuple[str, Reply, float]] = OrderedDict()

    def publish(self, carrier: str, reply: Reply) -> str:
        """Keep `reply` for `carrier`; returns its token."""
        now = time.monotonic()
        while self._docs and (len(self._docs) >= self.MAX_DOCS or next(iter(self._docs.values()))[2] < now):
            self._docs.popitem(last=False)
        token = secrets.token_urlsafe(18)
        self._docs[token] = (carrier, reply, now + self.TTL_S)
        return token

    def get(self, carrier: str, token: str) -> Reply | None:
        found = self._docs.get(token)
        if found is None or found[0] != carrier or found[2] < time.monotonic():
            return None
        return found[1]


@dataclass(frozen=True)
class _Admission:
    """A call admitted: its reservation and who answers it, knowing what."""

    ticket_id: str
    persona_name: str
    flow: dict[str, str]  # the flow's own values (they travel with the stream)
    values: dict[str, str]  # every value the prompt was filled with
    expires_at: float

    def ticket(self, carrier: str, call_id: str, answer: Reply, facts: CallFacts) -> StreamTicket:
        return StreamTicket(
            self.ticket_id,
            carrier,
            self.persona_name,
            call_id,
            self.expires_at,
            answer,
            variables=self.values,
            facts=facts,
        )


class PhoneService:
    def __init__(self, app: FastAPI, settings: PhoneSettings, book: PersonaBook, records_dir: Path | None):
        self.app = app
        self.settings = settings
        self.book = book
        self.carriers: dict[str, Carrier] = {}
        self.http = HttpOut()
        self.rest = RestClient(settings.rest_timeout_s)
        self.docs = InstructionDocs()
        self.metrics = PhoneMetrics.create()
        sources = getattr(app.state, "metric_sources", None)
        if sources is not None:  # the server's /metrics exports ours too
            sources.append(lambda: [LabelledSnapshot({}, self.metrics.snapshot())])
        self.webhooks = PostCallWebhooks(
            self.http,
            retry_for_s=settings.webhook_retry_s,
            first_backoff_s=settings.webhook_backoff_s,
            attempt_timeout_s=settings.webhook_timeout_s,
        )
        self.store, recordings = self._record_store(records_dir)
        self.registry = CallRegistry(self.store)
        self.outputs = CallOutputs(
            self.store,
            self.webhooks,
            settings.webhook_secret.get_secret_value(),
            self._live_call_sids,
            recordings=recordings,
        )
        self._check_personas()
        self.parking = Parking(settings.resume_timeout_s, self._give_up)
        self.services = CallServices(
            settings,
            lambda: self.manager,
            self.registry,
            book,
            self.outputs,
            self.parking,
            admit=self.admit_stream,
            metrics=self.metrics,
        )
        # Records of earlier runs (newest first), for the call list; this run's are in the registry.
        self.past: list[dict[str, Any]] = self.store.recent(HISTORY) if recordings else []
        self.store.sweep(frozenset())
        self._answering: dict[tuple[str, str], asyncio.Future[Reply]] = {}
        for rate in LINE_RATES:
            InboundAudio(AudioFormat("l16", rate))
            OutboundAudio(AudioFormat("l16", rate))

    def _record_store(self, records_dir: Path | None) -> tuple[RecordStore, bool]:
        """The records folder, or a private temporary one (records, no recordings) without one:
        an ended call's record is on disk either way, only its summary in memory."""
        settings = self.settings
        if records_dir is not None:
            store = RecordStore(
                records_dir,
                max_age_s=settings.records_max_age_days * 86400,
                max_bytes=round(settings.records_max_mb * (1 << 20)),
            )
            return store, True
        folder = Path(tempfile.mkdtemp(prefix="personaplex-calls-"))
        atexit.register(shutil.rmtree, folder, True)
        temp_bytes = round(settings.temp_records_mb * (1 << 20))
        return RecordStore(folder, max_age_s=86400, max_bytes=temp_bytes), False

    def _check_personas(self) -> None:
        for spec in self.book.specs.values():
            if spec.webhook_url and not self.outputs.secret_for(spec):
                where = (
                    f"${spec.webhook_secret_env}"
                    if spec.webhook_secret_env
                    else "PERSONAPLEX_TWILIO_WEBHOOK_SECRET (or PERSONAPLEX_PHONE_WEBHOOK_SECRET)"
                )
                raise UserError(f"persona {spec.name!r}: webhook_url needs a signing secret: set {where}")
            if spec.record and not self.outputs.recordings:
                log.warning("phone: persona %r asks for recordings, but no --records-dir is set", spec.name)

    @property
    def manager(self) -> SessionHost | None:
        """The server's session host (None while the engine loads)."""
        return self.app.state.host

    def _live_call_sids(self) -> set[str]:
        return {call.call_sid for call in list(self.registry.live.values())} | self.parking.call_sids

    def authorized(self, request: Request) -> bool:
        """Bearer token: the phone API token or the server's API key."""
        keys = [self.settings.api_token.get_secret_value()]
        server_settings = getattr(self.app.state, "settings", None)
        server_key = getattr(server_settings, "api_key", None)
        if server_key is not None:
            keys.append(server_key.get_secret_value())
        header = request.headers.get("authorization", "")
        given = header[7:].strip() if header.lower().startswith("bearer ") else ""
        # Bytes: comparing a str with non-ASCII characters (a forged header's) raises TypeError.
        return bool(given) and any(k and hmac.compare_digest(given.encode(), k.encode()) for k in keys)

    # --- reading the carrier's requests ------------------------------------------------------
    @property
    def body_timeout_s(self) -> float:
        server = getattr(self.app.state, "settings", None)
        return float(getattr(server, "http_request_timeout_s", BODY_TIMEOUT_S))

    async def webhook(self, carrier: Carrier, request: Request) -> Webhook | None:
        """The request as the carrier sent it, or None when it is not one of its (signature).
        A body that does not arrive whole, or that the carrier's format cannot read, raises
        HTTPException (408, 413, 400) with one log line."""
        body = await read_body(request, self.body_timeout_s, carrier.name)
        query = dict(request.query_params)
        content_type = request.headers.get("content-type", "")
        try:
            fields = carrier.fields(request.method, query, body, content_type)
        except UNREADABLE as exc:
            log.warning("%s: refused a webhook whose body is unreadable: %s", carrier.name, str(exc)[:200])
            raise HTTPException(400, f"the body is not a {carrier.name} webhook's") from None
        webhook = Webhook(
            method=request.method,
            url=public_url_of(self.settings, request),
            query=query,
            headers={k.lower(): v for k, v in request.headers.items()},
            body=body,
            fields=fields,
        )
        try:
            if not self.settings.validate_signatures or carrier.verify(webhook):
                return webhook
        except UNVERIFIABLE as exc:
            log.warning(
                "%s: rejected a webhook with an unreadable signature for %s: %s",
                carrier.name,
                webhook.url,
                str(exc)[:200],
            )
            return None
        log.warning(
            "%s: rejected a webhook with a missing or wrong signature for %s", carrier.name, webhook.url
        )
        return None

    # --- the answer webhook --------------------------------------------------------------------
    async def answer(self, carrier: Carrier, request: Request) -> Response:
        webhook = await self.webhook(carrier, request)
        if webhook is None:
            return plain(f"invalid {carrier.name} signature", 403)
        facts = carrier.facts(webhook)
        # Concurrent copies of one call's webhook share one decision (the first one's): the
        # context lookup awaits, and a second reservation must not slip in meanwhile.
        key = (carrier.name, facts.call_id)
        pending = self._answering.get(key) if facts.call_id else None
        if pending is not None:
            return as_response(await asyncio.shield(pending))
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        if facts.call_id:
            self._answering[key] = future
        try:
            reply = await self._answer(carrier, webhook, facts, request)
            future.set_result(reply)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: a lone failure is not "never retrieved"
            raise
        finally:
            if self._answering.get(key) is future:
                del self._answering[key]
        return as_response(reply)

    async def _answer(self, carrier: Carrier, webhook: Webhook, facts: CallFacts, request: Request) -> Reply:
        call_id = facts.call_id
        journal = self.registry.status(
            call_id, carrier.name, "webhook", direction=facts.direction, from_=facts.from_, to=facts.to
        )
        # The flow's values (persona, template variables): in the query string (Twilio Studio's
        # URL), or where the carrier says (Asterisk's POST /asterisk/calls has them in its body).
        flow_values = getattr(carrier, "flow_values", None)
        query = dict(flow_values(webhook)) if callable(flow_values) else dict(webhook.query)
        base = public_base(self.settings, request)
        stream_base = websocket_base(base) + carrier.paths.media
        resume = query.get("resume")
        if resume and self.parking.holds(resume, call_id):
            # Back from a `play … then: resume`: the held session continues on a new stream.
            return carrier.answer_stream(
                carrier.stream_url(stream_base, resume), {"persona": journal.record.persona}, facts
            )
        outstanding = self.registry.outstanding(carrier.name, call_id) if call_id else None
        if outstanding is not None:
            # A copy of a webhook already answered (a replay, or the carrier retrying): the same
            # answer, the same ticket; no second reservation.
            log.info("%s: call %s: answer webhook repeated: same stream, same ticket", carrier.name, call_id)
            return outstanding.answer
        if call_id and self.registry.is_ended(call_id):
            log.warning("%s: call %s is over: its answer webhook gets no stream", carrier.name, call_id)
            self.metrics.refusals.inc(label="ended")
            return carrier.answer_refusal(ENDED_MESSAGE, busy=False)
        try:
            admission = await self._admit(carrier, facts, query, journal)
        except Refused as refusal:
            return carrier.answer_refusal(refusal.message, busy=refusal.busy)
        # The ticket is the stream URL's last segment (carriers that sign the upgrade sign over
        # it). The flow's values travel beside it, so a stream served by another front-end
        # knows them.
        reply = carrier.answer_stream(
            carrier.stream_url(stream_base, admission.ticket_id),
            {"persona": admission.persona_name, **admission.flow},
            facts,
        )
        self.registry.issued(admission.ticket(carrier.name, call_id, reply, facts))
        return reply

    async def admit_stream(self, carrier: Carrier, start: StreamStart) -> str:
        """A stream that is the call's arrival (no answer webhook: Genesys) gets the admission an
        answer webhook would: the persona for its numbers, its flow's values (the platform's
        input variables) and the context lookup in the prompt, a reserved slot. Returns the
        ticket the stream redeems; raises Refused."""
        facts = start.facts or CallFacts(start.call_id)
        call_id = facts.call_id
        journal = self.registry.status(
            call_id, carrier.name, "stream-open", direction=facts.direction, from_=facts.from_, to=facts.to
        )
        if call_id and self.registry.is_ended(call_id):
            self.metrics.refusals.inc(label="ended")
            raise Refused(ENDED_MESSAGE)
        # The platform's values choose the persona (`persona`) and fill its template; the
        # outbound/resume tokens are our own answers' and cannot come this way.
        values = {k: v for k, v in start.params.items() if k not in ("outbound", "resume")}
        admission = await self._admit(carrier, facts, values, journal)
        self.registry.issued(admission.ticket(carrier.name, call_id, Reply("", "text/plain"), facts))
        return admission.ticket_id

    async def _admit(
        self, carrier: Carrier, facts: CallFacts, query: dict[str, str], journal: Any
    ) -> _Admission:
        """Who answers this call, knowing what, in a reserved slot; raises Refused."""
        call_id = facts.call_id
        try:
            persona_name, spec, overrides = self._persona_for_call(carrier.name, query, facts)
        except PersonaError as exc:
            log.warning("%s: call %s has no usable persona: %s", carrier.name, call_id, exc)
            journal.refused(f"persona: {exc}")
            self.metrics.refusals.inc(label="unconfigured")
            raise Refused(UNCONFIGURED_MESSAGE) from None
        journal.set_persona(persona_name)
        manager = self.manager
        if manager is None:
            raise self._busy(carrier.name, call_id, "loading")
        try:  # set-up waits for its turn on the loop, behind the calls in progress
            await manager.headroom.arrivals.turn(offer=True)
        except SaturatedError:
            raise self._busy(carrier.name, call_id, "saturated") from None
        if manager.headroom.refusing:  # no real-time headroom: the calls it carries come first
            raise self._busy(carrier.name, call_id, "saturated")
        if manager.available <= 0:  # full: no context lookup for a busy line
            raise self._busy(carrier.name, call_id, "full")
        flow = pick_declared({k: v for k, v in query.items() if k not in RESERVED_QUERY}, spec.variables)
        values = await self._call_values(spec, facts, flow)
        persona = spec.render({**values, "From": facts.from_, "To": facts.to, "CallSid": call_id})
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
        except SaturatedError:
            raise self._busy(carrier.name, call_id, "saturated") from None
        except CapacityError:
            raise self._busy(carrier.name, call_id, "full") from None
        return _Admission(ticket.id, persona_name, flow, values, time.monotonic() + ttl_s)

    def _busy(self, carrier: str, call_id: str, why: str) -> Refused:
        """The carrier's busy answer. `why`: `full` (every slot taken), `saturated` (slots free,
        but the server cannot carry another call in real time), `loading`; in the record and in
        `phone_refusals_total`."""
        self.registry.status(call_id, carrier, "busy").refused("busy" if why == "full" else f"busy ({why})")
        self.metrics.refusals.inc(label=why)
        if why == "saturated":
            log.info("%s: call %s answered busy: no real-time headroom left", carrier, call_id)
        return Refused(self.settings.busy_message, busy=True)

    def _persona_for_call(
        self, carrier: str, query: dict[str, str], facts: CallFacts
    ) -> tuple[str, PersonaSpec, dict[str, Any]]:
        outbound = query.get("outbound")
        if outbound:  # a one-off persona of an outbound call request (the URL is signed)
            found = self.registry.take_outbound(outbound)
            if found is None:
                raise PersonaError("the outbound call request expired")
            return found.persona_name, self.book.spec(found.persona_name), found.overrides
        name = query.get("persona") or self.book.for_number(facts.to, carrier)
        return name, self.book.spec(name), {}

    async def _call_values(self, spec: PersonaSpec, facts: CallFacts, flow: dict[str, str]) -> dict[str, str]:
        """The declared variables for this call: defaults < the flow's < the context lookup's."""
        values = {**spec.variables, **flow}
        if spec.context_url:
            body = facts_body(
                {
                    "call_sid": facts.call_id,
                    "from": facts.from_,
                    "to": facts.to,
                    "direction": facts.direction,
                    "persona": spec.name,
                    "variables": values,
                }
            )
            headers = signed_headers(self.outputs.secret_for(spec), body, "call.context")
            fetched = await fetch_context(self.http, spec.context_url, body, spec.context_timeout_s, headers)
            values.update(pick_declared(fetched, spec.variables))
        return {k: v for k, v in values.items() if k not in CALL_FACTS}

    # --- status events ---------------------------------------------------------------------------
    async def status(self, carrier: Carrier, request: Request) -> Response:
        webhook = await self.webhook(carrier, request)
        if webhook is None:
            return plain(f"invalid {carrier.name} signature", 403)
        news = carrier.status(webhook)
        if news is None or not news.call_id:
            return Response(status_code=204)
        journal = self.registry.find(news.call_id)
        if journal is not None or news.facts is not None:
            facts = news.facts or CallFacts(news.call_id)
            journal = self.registry.status(
                news.call_id,
                carrier.name,
                news.status,
                direction=facts.direction,
                from_=facts.from_,
                to=facts.to,
            )
            if news.duration_s:
                journal.note_metric("call_duration_s", news.duration_s)
        if news.terminal:
            self.registry.mark_ended(news.call_id)
            cancelled = [t for t in self.registry.tickets_for_call(news.call_id) if self._cancel(t)]
            if cancelled:
                log.info(
                    "%s: call %s ended (%s) before its stream started",
                    carrier.name,
                    news.call_id,
                    news.status,
                )
            held = self.parking.release(news.call_id)
            if held is not None:  # the caller hung up during a message, before coming back
                await self._close_held(held, f"caller hung up ({news.status}) during a message")
            if journal is not None and not journal.live and journal.ended is None:
                journal.close()  # the call never streamed: it is over all the same
        log.info("%s: call %s status %s", carrier.name, news.call_id, news.status)
        return Response(status_code=204)

    def _cancel(self, ticket_id: str) -> bool:
        manager = self.manager
        return manager is not None and manager.cancel(ticket_id)

    async def _give_up(self, call: PhoneCall, reason: str) -> None:
        """A held call that did not come back: end it for good."""
        await self._close_held(call, reason)
        carrier = self.carriers.get(call.record.carrier)
        if carrier is not None:
            await carrier.control.hang_up(call.handle)

    async def _close_held(self, call: PhoneCall, reason: str) -> None:
        if call.session is not None:
            with contextlib.suppress(Exception):
                await call.session.close(reason="client")
        await call.finish(reason, call.record.metrics)

    # --- the stream ------------------------------------------------------------------------------
    async def media_stream(self, carrier: Carrier, ws: WebSocket) -> None:
        ticket = ws.path_params.get("ticket", "")
        try:
            verified = not self.settings.validate_signatures or carrier.verify_upgrade(ws)
        except UNVERIFIABLE as exc:
            log.warning(
                "%s: rejected a media stream upgrade with an unreadable signature: %s", carrier.name, exc
            )
            verified = False
        else:
            if not verified:
                log.warning(
                    "%s: rejected a media stream upgrade with a missing or wrong signature", carrier.name
                )
        if not verified:
            await ws.close(code=CLOSE_POLICY)  # before accept: the client gets HTTP 403
            return
        # The carrier's subprotocol when it offers it (jambonz opens with `audio.jambonz.org`).
        link = await WebSocketLink.accept(ws, getattr(carrier, "subprotocol", None))
        # A carrier whose protocol checks what its upgrade said (Genesys: the organization
        # header against the `open`) builds the stream's wire from the connection.
        wire_for = getattr(carrier, "wire_for", None)
        wire = wire_for(ws) if callable(wire_for) else None
        await self.run_stream(carrier, link, ticket, public_base(self.settings, ws), wire)

    async def run_stream(
        self,
        carrier: Carrier,
        link: StreamLink,
        ticket: str,
        base: str,
        wire: StreamWire | None = None,
    ) -> PhoneStream:
        """One media stream of `carrier` on an accepted link, presenting `ticket` (a reservation
        of our answer, or a resume token; empty where the stream is the call's arrival and is
        admitted at its start: `admit_stream`), to its end. `wire`: the stream's own, when the
        carrier builds it with what it already knows of the call (else `carrier.new_wire()`)."""
        stream = PhoneStream(link, ticket, self.services, carrier, base, wire)
        await stream.run()
        return stream

    async def unticketed_stream(self, carrier: Carrier, ws: WebSocket) -> None:
        """The bare stream URL: refused. Every stream comes from our answer's ticketed URL (a
        fixed URL would let anyone who saw it open streams at will)."""
        log.warning(
            "%s: refused a media stream without a ticket (point the number at %s)",
            carrier.name,
            carrier.paths.answer,
        )
        await ws.close(code=CLOSE_POLICY)

    # --- documents carriers fetch ------------------------------------------------------------------
    def publish(self, carrier: Carrier, reply: Reply, base: str) -> str:
        """Serve `reply` to `carrier` (signed requests only) at a URL of its own; returns the URL."""
        token = self.docs.publish(carrier.name, reply)
        return f"{base}/{carrier.name}/instructions/{token}"

    async def instructions(self, carrier: Carrier, request: Request) -> Response:
        webhook = await self.webhook(carrier, request)
        if webhook is None:
            return plain(f"invalid {carrier.name} signature", 403)
        reply = self.docs.get(carrier.name, request.path_params.get("token", ""))
        if reply is None:
            return plain("no such document (expired?)", 404)
        return as_response(reply)


def records_dir_for(settings: PhoneSettings, app: FastAPI) -> Path | None:
    """The phone settings' own folder, else the server's `--records-dir`."""
    server = getattr(app.state, "settings", None)
    chosen = settings.records_dir or getattr(server, "records_dir", None)
    return Path(os.path.expanduser(str(chosen))) if chosen else None
