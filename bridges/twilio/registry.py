"""What the bridge knows about calls: their stream tickets, live streams, records of recent calls.

Between our webhook answer and Twilio's `start` message (a second or so) the call holds a
reservation ticket of the SessionManager (`manager.reserve`): the slot counts as taken for every
transport, so two webhooks (or a webhook and a browser) cannot both be promised the last slot.
The ticket's one-time id is the last segment of the Stream URL we answer with, so Twilio's
signature of the upgrade covers it and a stream must present it; the manager expires unclaimed
tickets. This registry only remembers which call each ticket was issued for (to check it at
`start` and to cancel it when the call ends before its stream starts).
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from .records import CallRecord

HISTORY = 500  # calls whose records are kept in memory (for /twilio/calls)


@dataclass
class StreamTicket:
    """A reservation ticket issued by our webhook for one call."""

    ticket_id: str
    persona_name: str
    call_sid: str
    expires_at: float
    variables: dict[str, str] = field(default_factory=dict)  # the values the prompt was filled with


@dataclass
class OutboundRequest:
    """A one-off persona of POST /twilio/call (overrides of a named one), picked up when the
    callee answers."""

    persona_name: str
    overrides: dict[str, Any]  # text_prompt (literal), voice, seed
    expires_at: float


class CallRegistry:
    def __init__(self) -> None:
        self._tickets: dict[str, StreamTicket] = {}
        self._outbound: dict[str, OutboundRequest] = {}
        self.live: dict[str, Any] = {}  # stream_sid -> MediaStreamCall
        self.calls: OrderedDict[str, CallRecord] = OrderedDict()

    # --- stream tickets -------------------------------------------------------------------
    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, t in self._tickets.items() if t.expires_at < now]:
            del self._tickets[key]
        for token in [t for t, r in self._outbound.items() if r.expires_at < now]:
            del self._outbound[token]

    def issued(
        self,
        ticket_id: str,
        persona_name: str,
        call_sid: str,
        ttl_s: float,
        variables: dict[str, str] | None = None,
    ) -> None:
        self._expire()
        self._tickets[ticket_id] = StreamTicket(
            ticket_id, persona_name, call_sid, time.monotonic() + ttl_s, dict(variables or {})
        )

    def claim(self, ticket_id: str, call_sid: str) -> StreamTicket | None:
        """What our webhook issued this ticket for, taken once by the call it was issued for;
        None when another process issued it (several front-ends behind one load balancer) or
        it expired. Raises LookupError when it belongs to another call (it stays for its own)."""
        self._expire()
        issued = self._tickets.get(ticket_id)
        if issued is not None and issued.call_sid and issued.call_sid != call_sid:
            raise LookupError(ticket_id)
        return self._tickets.pop(ticket_id, None)

    def tickets_for_call(self, call_sid: str) -> list[str]:
        """Forget and return the tickets of a call (it ended before its stream started)."""
        ids = [k for k, t in self._tickets.items() if t.call_sid == call_sid]
        for key in ids:
            del self._tickets[key]
        return ids

    def add_outbound(self, persona_name: str, overrides: dict[str, Any], ttl_s: float) -> str:
        self._expire()
        token = secrets.token_urlsafe(18)
        self._outbound[token] = OutboundRequest(persona_name, overrides, time.monotonic() + ttl_s)
        return token

    def take_outbound(self, token: str) -> OutboundRequest | None:
        self._expire()
        return self._outbound.pop(token, None)

    # --- lifecycle ----------------------------------------------------------------------
    def record(self, call_sid: str) -> CallRecord:
        record = self.calls.get(call_sid)
        if record is None:
            record = self.calls[call_sid] = CallRecord(call_sid=call_sid)
            while len(self.calls) > HISTORY:
                self.calls.popitem(last=False)
        return record

    def status(self, call_sid: str, status: str, **fields: str) -> CallRecord:
        record = self.record(call_sid)
        record.statuses.append((time.time(), status))
        for key, value in fields.items():
            if value and not getattr(record, key, None):
                setattr(record, key, value)
        return record
