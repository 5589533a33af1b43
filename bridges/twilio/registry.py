"""What the bridge knows about calls: slot reservations, live streams, lifecycle history.

Between our webhook answer and Twilio's `start` message (a second or so) the call holds a
*reservation*: it counts against capacity, so two simultaneous webhooks cannot both be promised
the last slot. The `start` message must present the reservation's one-time token (sent to
Twilio as a `<Parameter>`); unclaimed reservations expire.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from personaplex_voice.engine.base import Persona

HISTORY = 500  # finished calls kept for /twilio/calls


@dataclass
class Reservation:
    token: str
    persona_name: str
    persona: Persona
    call_sid: str
    expires_at: float


@dataclass
class CallRecord:
    call_sid: str
    direction: str = "inbound"
    from_: str = ""
    to: str = ""
    persona: str = ""
    stream_sid: str = ""
    session_id: str = ""
    statuses: list[tuple[float, str]] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)  # DTMF and other session events
    end_reason: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "call_sid": self.call_sid,
            "direction": self.direction,
            "from": self.from_,
            "to": self.to,
            "persona": self.persona,
            "stream_sid": self.stream_sid,
            "session_id": self.session_id,
            "statuses": [{"t": t, "status": s} for t, s in self.statuses],
            "events": [{"t": t, "event": e} for t, e in self.events],
            "end_reason": self.end_reason,
            "metrics": self.metrics,
        }


@dataclass
class OutboundRequest:
    """A persona chosen by POST /twilio/call, picked up when the callee answers."""

    persona_name: str
    persona: Persona
    expires_at: float


class CallRegistry:
    def __init__(self) -> None:
        self._reservations: dict[str, Reservation] = {}
        self._outbound: dict[str, OutboundRequest] = {}
        self.live: dict[str, Any] = {}  # stream_sid -> MediaStreamCall
        self.calls: OrderedDict[str, CallRecord] = OrderedDict()

    # --- reservations -------------------------------------------------------------------
    def _expire(self) -> None:
        now = time.monotonic()
        for token in [t for t, r in self._reservations.items() if r.expires_at < now]:
            del self._reservations[token]
        for token in [t for t, r in self._outbound.items() if r.expires_at < now]:
            del self._outbound[token]

    @property
    def reserved(self) -> int:
        self._expire()
        return len(self._reservations)

    def reserve(self, persona_name: str, persona: Persona, call_sid: str, ttl_s: float) -> Reservation:
        self._expire()
        token = secrets.token_urlsafe(18)
        reservation = Reservation(token, persona_name, persona, call_sid, time.monotonic() + ttl_s)
        self._reservations[token] = reservation
        return reservation

    def claim(self, token: str) -> Reservation | None:
        """Take a reservation (once). None when unknown or expired."""
        self._expire()
        return self._reservations.pop(token, None)

    def release_for_call(self, call_sid: str) -> int:
        """Drop the reservations of a call that ended before its stream started."""
        tokens = [t for t, r in self._reservations.items() if r.call_sid == call_sid]
        for token in tokens:
            del self._reservations[token]
        return len(tokens)

    def add_outbound(self, persona_name: str, persona: Persona, ttl_s: float) -> str:
        self._expire()
        token = secrets.token_urlsafe(18)
        self._outbound[token] = OutboundRequest(persona_name, persona, time.monotonic() + ttl_s)
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
