"""What most carriers' `Carrier` classes and factories share, written once (carrier.py is the
interface; this is the common part of its implementations):

- `CarrierDefaults`: the members most carriers answer alike (settings checked with whether
  signatures are, an unsigned stream upgrade, `<ws_base>/<ticket>` stream URLs, the apology then
  a hang-up when the engine is lost); a carrier overrides what is its own.
- `FactFields`: which webhook fields carry a call's facts (`TWIML_FIELDS`: the TwiML-style form
  that Twilio sends and TeXML mirrors).
- `json_fields`: a JSON webhook body as the call's fields.
- `with_publisher`: the factory step that gives a carrier's controls `service.publish` bound to
  the carrier itself.
- `resume_url`: the answer webhook's URL that brings a parked call back to the agent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlencode

from starlette.requests import HTTPConnection

from personaplex_voice import untrusted

from .carrier import CallFacts, Hangup, Publish, Reply, Resume, Say, Step

C = TypeVar("C")


class CarrierDefaults:
    """Carrier members most carriers share. Needs `settings` (with `check(validate)`) and `validate`."""

    settings: Any
    validate: bool

    def check(self) -> None:
        self.settings.check(self.validate)

    def verify_upgrade(self, conn: HTTPConnection) -> bool:
        return True  # unsigned by the carrier: the ticket in the URL is what the stream must present

    def stream_url(self, ws_base: str, ticket: str) -> str:
        return f"{ws_base}/{ticket}"

    def engine_lost(self, apology: str) -> list[Step]:
        return [Say(apology), Hangup()]


@dataclass(frozen=True)
class FactFields:
    """The names of the webhook fields that carry a call's facts."""

    call_id: str
    from_: str
    to: str
    direction: str
    account: str = ""  # empty: the carrier's webhooks name no account

    def facts(self, values: Mapping[str, str]) -> CallFacts:
        """An answer webhook's call (an inbound one unless it says otherwise)."""
        return CallFacts(
            call_id=values.get(self.call_id, ""),
            from_=values.get(self.from_, ""),
            to=values.get(self.to, ""),
            direction=values.get(self.direction, "inbound"),
            account=values.get(self.account, "") if self.account else "",
        )

    def status_facts(self, values: Mapping[str, str]) -> CallFacts:
        """A status webhook's call, as far as it says (no account, no direction assumed)."""
        return CallFacts(
            values.get(self.call_id, ""),
            values.get(self.from_, ""),
            values.get(self.to, ""),
            values.get(self.direction, ""),
        )


TWIML_FIELDS = FactFields("CallSid", "From", "To", "Direction", "AccountSid")


def json_fields(body: bytes, carrier: str) -> dict[str, str]:
    """A JSON object body's plain values as strings; untrusted.InputRefused (a ValueError: the
    webhook is refused) for anything but a JSON object within bounds."""
    data = untrusted.loads_object(body, what=f"a {carrier} webhook body")
    return {
        k: str(v) for k, v in data.items() if isinstance(v, str | int | float) and not isinstance(v, bool)
    }


def with_publisher(service: Any, build: Callable[[Publish], C]) -> C:
    """`build(publish)`, where `publish(reply, base)` serves a document of ours to the carrier
    being built (`service.publish` names the carrier, which exists only once built)."""
    carrier: C

    def publish(reply: Reply, base: str) -> str:
        return service.publish(carrier, reply, base)

    carrier = build(publish)
    return carrier


def resume_url(public_base: str, answer_path: str, step: Resume) -> str:
    """The answer webhook's URL that connects a parked call back to the agent (`?resume=<token>`)."""
    return f"{public_base}{answer_path}?{urlencode({'persona': step.persona, 'resume': step.token})}"
