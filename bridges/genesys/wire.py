"""The Genesys Cloud Audio Connector (AudioHook protocol, version 2): its messages, both ways.

Genesys opens the WebSocket and speaks first. Text messages are JSON objects, `{"version": "2",
"type": …, "seq": n, "id": <session id>, "parameters": {…}}`; Genesys's also carry `serverseq`
(the last of ours it saw) and `position`, ours `clientseq` (the last of its we saw). Each side
counts its `seq` up from 1, one by one.

    Genesys                                  us
    open (conversationId, participant,   ->
          media offers, inputVariables)
                                         <-  opened (the media we take: PCMU 8 kHz, external)
                                             or disconnect (reason error: busy, unknown persona)
    binary: the caller's audio, PCMU     ->  <-  binary: ours, PCMU 8 kHz
    ping                                 ->  <-  pong
    update (language)                    ->  <-  updated
    dtmf (digit)                         ->
    paused / resumed (a hold)            ->
                                         <-  event (entities: [{"type": "barge_in"}]): drop what
                                             you still hold of ours
                                         <-  disconnect (reason completed, outputVariables): the
                                             agent is done (a transfer, a hang-up, ...); reason
                                             error when it failed (its engine was lost)
    close (reason)                       ->  <-  closed (outputVariables)

The outcome reaches the Architect flow as the output variables of our `disconnect`, repeated on
`closed` (control.py fills them: `action`, `target`, `say`, ...; see docs/genesys.md). Genesys
has no marks: `mark` says nothing.

Checked against the protocol's published types (Genesys's AudioHook reference implementation,
github.com/purecloudlabs/audiohook-reference-implementation, app/audiohook/src/protocol/
message.ts): `update` (client, a language change) is answered `updated`; an `open` whose
`organizationId` is not the one the upgrade's `audiohook-organization-id` header named (the
header the HTTP signature covers) is refused with `disconnect` reason `unauthorized`; an `open`
that asks for `supportedLanguages` gets them in `opened` (the persona's language only).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, MutableMapping
from typing import Any

from personaplex_phone import wire_json
from personaplex_phone.carrier import (
    CLOSE_INVALID_DATA,
    AudioFormat,
    CallerMedia,
    CallFacts,
    CallOutcome,
    Digit,
    LinePaused,
    Outgoing,
    ProtocolError,
    StreamEvent,
    StreamStart,
    StreamStop,
)

log = logging.getLogger(__name__)

VERSION = "2"
SUPPORTED_LANGUAGES = ("en-US",)  # PersonaPlex speaks English
PCMU = {"type": "audio", "format": "PCMU", "channels": ["external"], "rate": 8000}
DTMF_KEYS = frozenset("0123456789*#ABCD")
VALUE_CHARS = 400  # an output variable's value, at most (the summary: SUMMARY_CHARS)
SUMMARY_CHARS = 2000
# Our end reasons after which the flow should not simply carry on: the agent failed.
FAILED = ("session ended: engine_lost", "bridge error", "protocol error", "session failed", "no free slot")


def one_line(value: Any, limit: int = VALUE_CHARS) -> str:
    return " ".join(str(value).split())[:limit]


def _number(address: Any) -> str:
    """Genesys writes numbers as `tel:+1555…`: the number, as the personas file has it."""
    text = str(address or "")
    return text[4:] if text.startswith("tel:") else text


class GenesysWire:
    """One Audio Connector session. `live` is the carrier's index of sessions (session id ->
    wire) through which call control reaches it (control.py)."""

    def __init__(self, live: MutableMapping[str, GenesysWire], message_ms: int = 100, organization: str = ""):
        self.live = live
        self.message_ms = message_ms
        self.organization = organization  # the upgrade's audiohook-organization-id ("": not given)
        self.languages = False  # the `open` asked for our supported languages
        self.replies: list[Outgoing] = []
        self.session_id = ""
        self.client_seq = 0  # Genesys's last seq
        self.server_seq = 0  # our last seq
        self.opened = False  # we said `opened`
        self.ended = False  # we said `disconnect`, or Genesys `close`: the session is winding up
        self.closed = False  # we said `closed`
        self.digits = ""
        self.outputs: dict[str, str] = {}  # what call control decided (control.py)
        self._sent: dict[str, str] | None = None  # the output variables our disconnect carried

    # --- Genesys's messages ----------------------------------------------------------------------
    def parse(self, raw: Mapping[str, Any]) -> StreamEvent | None:
        data = raw.get("bytes")
        if raw.get("text") is None and data is not None:
            if not self.session_id:
                raise ProtocolError("audio before `open`")
            return CallerMedia(bytes(data)) if not self.closed else None
        text = raw.get("text")
        if text is None:
            return None
        message = self._message(text)
        kind = message["type"]
        parameters = message["parameters"]
        if kind == "open":
            return self._open(message["id"], parameters)
        if kind == "ping":
            self.replies.append(self._say("pong", {}))
        elif kind == "update":
            # A language change: the agent keeps its persona's language; the protocol still
            # wants the update acknowledged.
            log.info("genesys %s: update %s", self.session_id, one_line(parameters, 120))
            if self.opened and not self.ended:
                self.replies.append(self._say("updated", {}))
        elif kind == "close":
            return self._close(parameters)
        elif kind == "paused":
            return LinePaused(True)
        elif kind == "resumed":
            return LinePaused(False)
        elif kind == "dtmf":
            digit = parameters.get("digit")
            if not isinstance(digit, str) or len(digit) != 1 or digit not in DTMF_KEYS:
                raise ProtocolError(
                    f"`dtmf` needs one key (0-9 * # A-D), got {digit!r:.40}", CLOSE_INVALID_DATA
                )
            self.digits = (self.digits + digit)[-64:]
            return Digit(digit)
        elif kind == "error":
            # Genesys's own complaint (e.g. 429: we send too many messages): for the log.
            log.warning(
                "genesys %s: Genesys reports error %s: %s",
                self.session_id,
                parameters.get("code"),
                one_line(parameters.get("message", "")),
            )
        return None  # discarded, playback_started/completed, and anything new

    def _message(self, text: str) -> dict[str, Any]:
        message = wire_json.json_value(text)
        if not isinstance(message, dict) or not isinstance(message.get("type"), str):
            raise ProtocolError("a message that is not a JSON object with a `type`", CLOSE_INVALID_DATA)
        if str(message.get("version")) != VERSION:
            raise ProtocolError(
                f"AudioHook version {message.get('version')!r}, not {VERSION}", CLOSE_INVALID_DATA
            )
        seq = message.get("seq")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq != self.client_seq + 1:
            raise ProtocolError(f"`{message['type']}` with seq {seq!r}, not {self.client_seq + 1}")
        serverseq = message.get("serverseq", 0)
        if isinstance(serverseq, int) and serverseq > self.server_seq:
            raise ProtocolError(f"serverseq {serverseq} is ahead of ours ({self.server_seq})")
        session = message.get("id")
        if not isinstance(session, str) or not session:
            raise ProtocolError("a message without the session's `id`", CLOSE_INVALID_DATA)
        if self.session_id and session != self.session_id:
            raise ProtocolError("a message of another session")
        if not self.session_id and message["type"] != "open":
            raise ProtocolError(f"`{message['type']}` before `open`")
        parameters = message.get("parameters", {})
        if not isinstance(parameters, dict):
            raise ProtocolError("`parameters` must be an object", CLOSE_INVALID_DATA)
        self.client_seq = seq
        message["parameters"] = parameters
        return message

    def _open(self, session: str, parameters: dict[str, Any]) -> StreamStart | None:
        if self.session_id:
            raise ProtocolError("a second `open` on one session")
        self.session_id = session
        self.live[session] = self
        offers = parameters.get("media")
        if not isinstance(offers, list) or not any(self._takes(m) for m in offers):
            self.ended = True
            info = "no media we take: PCMU 8 kHz, the external channel"
            self.replies.append(self._say("disconnect", {"reason": "error", "info": info}))
            return None
        call_id = parameters.get("conversationId")
        if not isinstance(call_id, str) or not call_id:
            raise ProtocolError("`open` without a conversationId", CLOSE_INVALID_DATA)
        organization = str(parameters.get("organizationId", ""))
        if self.organization and organization.lower() != self.organization.lower():
            log.warning(
                "genesys %s: `open` names organization %r, the connection %r: refused",
                session,
                organization[:40],
                self.organization[:40],
            )
            self.ended = True
            info = "organizationId does not match the audiohook-organization-id header"
            self.replies.append(self._say("disconnect", {"reason": "unauthorized", "info": info}))
            return None
        self.languages = parameters.get("supportedLanguages") is True
        participant = parameters.get("participant")
        participant = participant if isinstance(participant, dict) else {}
        variables = parameters.get("inputVariables")
        params = (
            {str(k): one_line(v) for k, v in variables.items() if isinstance(v, str | int | float)}
            if isinstance(variables, dict)
            else {}
        )
        line = AudioFormat("pcmu", 8000)
        return StreamStart(
            session,
            call_id,
            line,
            AudioFormat("pcmu", 8000, message_ms=self.message_ms),
            params=params,
            control_id=session,
            account=organization,
            facts=CallFacts(
                call_id,
                from_=_number(participant.get("ani")),
                to=_number(participant.get("dnis")),
                direction="inbound",
                account=organization,
            ),
        )

    @staticmethod
    def _takes(offer: Any) -> bool:
        return (
            isinstance(offer, dict)
            and offer.get("format") == "PCMU"
            and offer.get("rate") == 8000
            and offer.get("channels") == ["external"]
        )

    def _close(self, parameters: dict[str, Any]) -> StreamStop:
        self.ended = True
        if not self.closed:
            outputs = (
                self._sent
                if self._sent is not None
                else self.output_variables(
                    CallOutcome(
                        f"Genesys closed the session ({one_line(parameters.get('reason', 'end'), 40)})"
                    )
                )
            )
            self.replies.append(self._say("closed", {"outputVariables": outputs}))
            self.closed = True
            self.live.pop(self.session_id, None)
        return StreamStop()

    # --- ours --------------------------------------------------------------------------------------
    def _say(self, kind: str, parameters: dict[str, Any]) -> str:
        self.server_seq += 1
        message = {
            "version": VERSION,
            "type": kind,
            "seq": self.server_seq,
            "clientseq": self.client_seq,
            "id": self.session_id,
            "parameters": parameters,
        }
        return json.dumps(message, separators=(",", ":"))

    def accept(self) -> Outgoing:
        self.opened = True
        parameters: dict[str, Any] = {"media": [PCMU], "startPaused": False}
        if self.languages:
            parameters["supportedLanguages"] = list(SUPPORTED_LANGUAGES)
        return self._say("opened", parameters)

    def refuse(self, message: str, busy: bool) -> Outgoing:
        self.ended = True
        outputs = {"action": "busy" if busy else "error", "say": one_line(message)}
        return self._say(
            "disconnect", {"reason": "error", "info": one_line(message), "outputVariables": outputs}
        )

    def media(self, payload: bytes) -> bytes:
        return payload

    def mark(self, name: str) -> None:
        return None  # the AudioHook protocol has no marks

    def clear(self) -> Outgoing | None:
        if not self.opened or self.ended:
            return None
        return self._say("event", {"entities": [{"type": "barge_in", "data": {}}]})

    def farewell(self, outcome: CallOutcome) -> list[Outgoing]:
        """Our `disconnect` with the call's outcome (none once the session is winding up)."""
        if not self.opened or self.ended:
            return []
        self.ended = True
        self._sent = self.output_variables(outcome)
        # A failure takes the action's failure path in the flow (its errorType / errorMessage).
        failed = self._sent["action"] == "error"
        parameters = {"reason": "error" if failed else "completed", "outputVariables": self._sent}
        if failed:
            parameters["info"] = one_line(outcome.reason)
        return [self._say("disconnect", parameters)]

    def output_variables(self, outcome: CallOutcome) -> dict[str, str]:
        """What the Architect flow gets: call control's decision, else what the end says."""
        outputs = dict(self.outputs)
        if "action" not in outputs:
            failed = outcome.reason.startswith(FAILED)
            outputs["action"] = "error" if failed else "completed"
        outputs["reason"] = one_line(outcome.reason)
        if self.digits:
            outputs["dtmf"] = self.digits
        if outcome.agent_said:
            outputs["summary"] = outcome.agent_said[-SUMMARY_CHARS:]
        return outputs
