"""What the Asterisk carrier remembers of its calls: the UUIDs it handed out, and what each call's
dialplan is to do once our media leg ends.

AudioSocket carries no credentials at all, and chan_websocket only what Asterisk's fixed URI and
`v(...)` parameters add, so the only proof a stream belongs to a call we answered is a UUID we
minted for it: `POST /asterisk/calls` reserves the slot (a SessionManager ticket) and returns a
fresh random UUID standing for that ticket. The UUID opens one stream, once, before it expires;
anything else is refused. A `play … then: resume` mints another for the same call's way back.

When our leg ends (an action, a hang-up of ours, a limit) the dialplan goes on after
`AudioSocket()` / `Dial()` and asks `GET /asterisk/calls/{uuid}/next` what to do (or, with ARI,
finds the same as channel variables): `NextSteps` keeps that answer a while per call.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_TICKETS = 10_000  # unused UUIDs held at once (each also holds a slot, so far fewer in practice)
MAX_CALLS = 10_000  # calls whose next step is kept
NEXT_TTL_S = 3600.0


@dataclass
class AsteriskTicket:
    uuid: str
    ticket: str  # the SessionManager reservation, or a parked call's resume token
    expires_at: float
    public_base: str = ""  # https://host[:port] the answer was asked for at (records' URLs)
    call_id: str = ""
    persona: str = ""
    resume: bool = False  # `ticket` is a parked call's resume token, not a reservation


class TicketBook:
    def __init__(self) -> None:
        self._by_uuid: OrderedDict[str, AsteriskTicket] = OrderedDict()

    def _expire(self, now: float) -> None:
        while self._by_uuid:
            first = next(iter(self._by_uuid.values()))
            if first.expires_at >= now and len(self._by_uuid) <= MAX_TICKETS:
                break
            self._by_uuid.popitem(last=False)

    def issue(self, ticket: str, ttl_s: float, public_base: str = "", resume: bool = False) -> AsteriskTicket:
        """A new random UUID standing for `ticket` for `ttl_s`."""
        now = time.monotonic()
        self._expire(now)
        entry = AsteriskTicket(str(uuid.uuid4()), ticket, now + ttl_s, public_base, resume=resume)
        self._by_uuid[entry.uuid] = entry
        return entry

    def find(self, value: str) -> AsteriskTicket | None:
        entry = self._by_uuid.get(normal_uuid(value))
        if entry is None or entry.expires_at < time.monotonic():
            return None
        return entry

    def take(self, value: str) -> AsteriskTicket | None:
        """The UUID's ticket, once: a second stream with the same UUID is refused."""
        entry = self.find(value)
        if entry is not None:
            del self._by_uuid[entry.uuid]
        return entry

    def __len__(self) -> int:
        return len(self._by_uuid)


def normal_uuid(value: str) -> str:
    """The canonical text of a UUID (lower case, dashes), or "" for anything else."""
    try:
        return str(uuid.UUID(value.strip()))
    except (ValueError, AttributeError):
        return ""


class NextSteps:
    """What each call's dialplan is to do after our leg, by call id (and by its UUIDs)."""

    def __init__(self) -> None:
        self._steps: OrderedDict[str, tuple[float, dict[str, Any]]] = OrderedDict()
        self._calls: OrderedDict[str, str] = OrderedDict()  # uuid -> call id

    def link(self, uuid_text: str, call_id: str) -> None:
        self._calls[uuid_text] = call_id
        self._calls.move_to_end(uuid_text)
        while len(self._calls) > MAX_CALLS:
            self._calls.popitem(last=False)

    def call_of(self, key: str) -> str | None:
        """The call a UUID or a call id names, if it is one of ours."""
        as_uuid = normal_uuid(key)
        if as_uuid and as_uuid in self._calls:
            return self._calls[as_uuid]
        return key if key in self._calls.values() or key in self._steps else None

    def set(self, call_id: str, step: dict[str, Any]) -> None:
        self._steps[call_id] = (time.monotonic() + NEXT_TTL_S, step)
        self._steps.move_to_end(call_id)
        while len(self._steps) > MAX_CALLS or next(iter(self._steps.values()))[0] < time.monotonic():
            self._steps.popitem(last=False)
            if not self._steps:
                break

    def get(self, call_id: str) -> dict[str, Any] | None:
        found = self._steps.get(call_id)
        if found is None or found[0] < time.monotonic():
            return None
        return found[1]
