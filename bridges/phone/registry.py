"""What the phone call knows about calls: their tickets and answers, live streams, journals.

Between our answer and the carrier's stream (a second or so) a call holds a reservation ticket
of the SessionManager (`manager.reserve`): the slot counts as taken for every transport, so two
calls (or a call and a browser) cannot both be promised the last slot. The ticket's one-time id
is the last segment of the stream URL we answer with; the manager expires unclaimed tickets.

**One reservation per call.** A call holds at most one outstanding ticket: while it is
outstanding, every answer webhook for that call id gets the very answer it was first given
(same ticket, same stream URL), so a replayed webhook (Twilio's signatures carry no time) cannot
take a second slot. Once the ticket is redeemed or has expired, the next webhook of the call is
answered afresh (a flow may hand the call back to the agent); a call the carrier has told us is
over (a terminal status) is never answered with a stream again.

Journals (journal.py, one per call) are kept for the newest `HISTORY` calls; an ended call's is
only its summary.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from .carrier import Reply
from .journal import CallJournal
from .records import RecordStore

HISTORY = 500  # calls whose journals (summaries, once ended) are kept in memory
ENDED_IDS = 10_000  # ids of calls the carrier said are over: never given a stream again


@dataclass
class StreamTicket:
    """A reservation ticket issued by our answer for one call, and the answer it went out in."""

    ticket_id: str
    carrier: str
    persona_name: str
    call_id: str
    expires_at: float
    answer: Reply
    variables: dict[str, str] = field(default_factory=dict)  # the values the prompt was filled with
    facts: Any = None  # the call's CallFacts (for the stream's call control)
    # Its stream ended before starting and its slot went back: it opens nothing any more, but
    # stays the call's answer (a replayed answer webhook gets it) until it expires.
    spent: bool = False


@dataclass
class OutboundRequest:
    """A one-off persona of an outbound call request (overrides of a named one), picked up when
    the callee answers."""

    persona_name: str
    overrides: dict[str, Any]  # text_prompt (literal), voice, seed
    expires_at: float


class CallRegistry:
    def __init__(self, store: RecordStore | None = None) -> None:
        self.store = store
        self._tickets: dict[str, StreamTicket] = {}
        self._by_call: dict[tuple[str, str], str] = {}  # (carrier, call id) -> outstanding ticket id
        self._outbound: dict[str, OutboundRequest] = {}
        self._ended_ids: OrderedDict[str, None] = OrderedDict()
        self.live: dict[str, Any] = {}  # stream id -> PhoneStream
        self.calls: OrderedDict[str, CallJournal] = OrderedDict()

    # --- stream tickets ---------------------------------------------------------------------------
    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, t in self._tickets.items() if t.expires_at < now]:
            self._forget(key)
        for token in [t for t, r in self._outbound.items() if r.expires_at < now]:
            del self._outbound[token]

    def _forget(self, ticket_id: str) -> StreamTicket | None:
        issued = self._tickets.pop(ticket_id, None)
        if issued is not None and self._by_call.get((issued.carrier, issued.call_id)) == ticket_id:
            del self._by_call[(issued.carrier, issued.call_id)]
        return issued

    def outstanding(self, carrier: str, call_id: str) -> StreamTicket | None:
        """The call's ticket that no stream has redeemed yet (and that has not expired)."""
        self._expire()
        ticket_id = self._by_call.get((carrier, call_id))
        return self._tickets.get(ticket_id) if ticket_id is not None else None

    def issued(self, ticket: StreamTicket) -> None:
        self._expire()
        self._tickets[ticket.ticket_id] = ticket
        if ticket.call_id:
            self._by_call[(ticket.carrier, ticket.call_id)] = ticket.ticket_id

    def claim(self, ticket_id: str, call_id: str) -> StreamTicket | None:
        """What our answer issued this ticket for, taken once by the call it was issued for;
        None when another process issued it (several front-ends behind one load balancer), it
        expired or was spent. Raises LookupError when it belongs to another call (it stays for
        its own)."""
        self._expire()
        issued = self._tickets.get(ticket_id)
        if issued is None or issued.spent:
            return None
        if issued.call_id and issued.call_id != call_id:
            raise LookupError(ticket_id)
        return self._forget(ticket_id)

    def spend(self, ticket_id: str) -> None:
        """The ticket's stream ended before its start (its reservation was given back)."""
        issued = self._tickets.get(ticket_id)
        if issued is not None:
            issued.spent = True

    def tickets_for_call(self, call_id: str) -> list[str]:
        """Forget and return the tickets of a call (it ended before its stream started)."""
        ids = [k for k, t in self._tickets.items() if t.call_id == call_id]
        for key in ids:
            self._forget(key)
        return ids

    def add_outbound(self, persona_name: str, overrides: dict[str, Any], ttl_s: float) -> str:
        self._expire()
        token = secrets.token_urlsafe(18)
        self._outbound[token] = OutboundRequest(persona_name, overrides, time.monotonic() + ttl_s)
        return token

    def take_outbound(self, token: str) -> OutboundRequest | None:
        self._expire()
        return self._outbound.pop(token, None)

    # --- calls the carrier said are over ----------------------------------------------------------
    def mark_ended(self, call_id: str) -> None:
        self._ended_ids[call_id] = None
        self._ended_ids.move_to_end(call_id)
        while len(self._ended_ids) > ENDED_IDS:
            self._ended_ids.popitem(last=False)

    def is_ended(self, call_id: str) -> bool:
        return call_id in self._ended_ids

    # --- journals -----------------------------------------------------------------------------------
    def journal(self, call_id: str, carrier: str) -> CallJournal:
        journal = self.calls.get(call_id)
        if journal is None:
            journal = self.calls[call_id] = CallJournal(call_id, carrier, self.store)
            self._trim()
        return journal

    def find(self, call_id: str) -> CallJournal | None:
        return self.calls.get(call_id)

    def status(self, call_id: str, carrier: str, status: str, **facts: str) -> CallJournal:
        journal = self.journal(call_id, carrier)
        journal.status(status, **facts)
        return journal

    def _trim(self) -> None:
        """Keep the newest HISTORY journals; a live call's is never dropped."""
        while len(self.calls) > HISTORY:
            for call_id, journal in self.calls.items():
                if not journal.live:
                    del self.calls[call_id]
                    break
            else:
                return
