"""What a carrier is to a phone call: the interface every carrier module implements.

The phone call (stream.py, service.py) is the same on every line: a ticket from the answer
webhook, the session, caller audio in, paced playout with marks, barge-in, DTMF, actions, the
end, the record. A carrier adds only what is its own, as plain data in and out, never a socket:

- **wire**: one `StreamWire` per media stream turns the carrier's WebSocket messages into the
  call's events (`StreamStart`, `CallerMedia`, `MarkPlayed`, `Digit`, `StreamStop`) and formats
  ours (`media`, `mark`, `clear`);
- **markup**: the answer to its webhooks (TwiML, TeXML, Plivo XML, an NCCO, a URL), for a stream,
  for "busy" and for "say this and hang up";
- **control**: `CallControl.hang_up` and `CallControl.instruct` (a live call gets new `Step`s:
  say, play, dial, hang up, back to the agent) through its REST API;
- **signatures**: `verify` for webhooks and `verify_upgrade` for the stream's WebSocket upgrade.

See docs/phone.md for the walk-through of adding one. A carrier imports this package and
`personaplex_voice.audio`, never another carrier.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from starlette.requests import HTTPConnection

# WebSocket close codes (RFC 6455) a stream ends with.
CLOSE_NORMAL = 1000
CLOSE_INVALID_DATA = 1007
CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009
CLOSE_ERROR = 1011

CHUNK_MS = 20  # most carriers take and send 20 ms of audio per media message (AudioFormat.message_ms)


class ProtocolError(Exception):
    """The carrier's side broke its stream protocol; `code` is the close code to end it with."""

    def __init__(self, message: str, code: int = CLOSE_POLICY):
        super().__init__(message)
        self.code = code


class Refused(Exception):
    """The call gets no stream: `message` is what the caller is told, `busy` when no slot was free."""

    def __init__(self, message: str, busy: bool = False):
        super().__init__(message)
        self.message = message
        self.busy = busy


# --- audio -------------------------------------------------------------------------------------

Codec = Literal["pcmu", "pcma", "l16"]


@dataclass(frozen=True)
class AudioFormat:
    """How a stream carries audio one way: the codec, its rate, and for L16 the byte order."""

    codec: Codec
    rate: int
    big_endian: bool = False  # L16 only: True for RTP payloads (network order)
    # Outbound: the audio of one of our media messages. Carriers that limit how many messages a
    # second they take (Genesys) get fewer, longer ones; the pacer paces in these units.
    message_ms: int = CHUNK_MS

    @property
    def bytes_per_sample(self) -> int:
        return 2 if self.codec == "l16" else 1

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one media message (`message_ms` of audio)."""
        return self.rate * self.message_ms // 1000 * self.bytes_per_sample

    @property
    def message_s(self) -> float:
        return self.message_ms / 1000

    @property
    def wideband(self) -> bool:
        return self.rate > 8000

    def describe(self) -> str:
        name = {"pcmu": "μ-law", "pcma": "A-law"}.get(self.codec, "L16")
        order = (" big-endian" if self.big_endian else " little-endian") if self.codec == "l16" else ""
        return f"{name} {self.rate // 1000 if self.rate % 1000 == 0 else self.rate / 1000:g} kHz{order}"


MULAW_8K = AudioFormat("pcmu", 8000)


# --- what a stream says ------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamStart:
    """The stream is set up: which call it belongs to and how its audio travels each way.

    `params` are the values the carrier carries from our answer to the stream (Twilio's
    `<Parameter>`s, Vonage's headers, ...); `control_id` is the id the carrier's call-control API
    takes when it differs from the call id (Telnyx), `account` the account the call is on when the
    control API needs it in its URLs."""

    stream_id: str
    call_id: str
    inbound: AudioFormat
    outbound: AudioFormat
    params: Mapping[str, str] = field(default_factory=dict)
    control_id: str = ""
    account: str = ""
    # Who calls whom, where the stream itself is the call's arrival (no answer webhook before
    # it: Genesys Audio Connector); elsewhere the answer webhook told us.
    facts: CallFacts | None = None


@dataclass(frozen=True)
class CallerMedia:
    payload: bytes  # the caller's audio in the stream's inbound format
    chunk: int | None = None  # the carrier's running message number, when it sends one


@dataclass(frozen=True)
class MarkPlayed:
    """Our audio up to the mark `name` has played to the caller."""

    name: str


@dataclass(frozen=True)
class Digit:
    digit: str  # one DTMF key: 0-9 * # A-D


@dataclass(frozen=True)
class StreamStop:
    """The carrier ends the stream (the caller hung up, or the call moved on)."""


@dataclass(frozen=True)
class FlowControl:
    """The carrier asks us to stop sending audio (`paused`) or to go on (Asterisk's
    `MEDIA_XOFF`/`MEDIA_XON`). The call stays up either way. Not LinePaused: this pauses ours."""

    paused: bool


@dataclass(frozen=True)
class LinePaused:
    """The carrier stopped (`paused`) or restarted sending the caller's audio on purpose (a hold,
    a secure pause): no caller audio is not an idle line meanwhile. Not FlowControl: this pauses
    the caller's."""

    paused: bool


StreamEvent = StreamStart | CallerMedia | MarkPlayed | Digit | StreamStop | FlowControl | LinePaused
Outgoing = str | bytes  # a WebSocket text or binary message (or a link's own framing of bytes)


@dataclass(frozen=True)
class CallOutcome:
    """How a stream ended, for carriers whose protocol says it to them when we end it (Genesys's
    `disconnect` carries the outcome to the flow that routes the call next)."""

    reason: str  # the record's end reason ("stop", "action transfer to … (dtmf 0)", …)
    agent_said: str = ""  # the agent's words in this call (its latest, bounded)


class StreamWire(Protocol):
    """One stream's messages, both ways. Stateful: it knows its stream once started, and raises
    ProtocolError for anything the carrier's protocol does not allow (bounded work per message).

    `mark` and `clear` return None where the carrier has no such message (AudioSocket: Asterisk
    holds nothing of ours, so there is nothing to clear and no mark to echo; Genesys has no
    marks). A wire whose carrier plays our audio the moment it arrives, with no buffer of its
    own, says so with a true `plays_on_arrival` attribute: the playout then sends each message
    at its time (one message ahead at most), and a barge-in stops it by no longer sending what
    it still holds.

    Optional members, for protocols that talk back (the phone call uses them when present):

    - `replies: list[Outgoing]`: messages the protocol owes the carrier after a `parse` (a pong, a
      `closed`); the stream sends and empties it after each message;
    - `accept() -> Outgoing` / `refuse(message, busy) -> Outgoing`: where the stream is the call's
      arrival (`Carrier.answers_in_stream`), what tells the carrier we take it or not;
    - `farewell(outcome: CallOutcome) -> list[Outgoing]`: what we say when we end the stream;
      the stream then reads on (a few seconds at most) until the carrier closes its side.
    """

    def parse(self, message: Mapping[str, Any]) -> StreamEvent | None:
        """An ASGI `websocket.receive` message -> the event it carries, or None (acks, keepalives,
        events the call has no use for)."""
        ...

    def media(self, payload: bytes) -> Outgoing:
        """One message of our audio (`message_ms`, 20 ms on most carriers), already in the stream's
        outbound format."""
        ...

    def mark(self, name: str) -> Outgoing | None:
        """Ask to be told (MarkPlayed) once everything sent so far has played."""
        ...

    def clear(self) -> Outgoing | None:
        """Drop whatever the carrier still holds of ours (the caller barged in, or the end)."""
        ...


# --- webhooks ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Webhook:
    """One HTTP request of the carrier, read once: the public URL it was sent to (what carriers
    sign), its raw body and its fields (form, JSON or query, as the carrier sends them)."""

    method: str
    url: str  # public: PUBLIC_URL + path + query as received
    query: Mapping[str, str]
    headers: Mapping[str, str]  # lower-case names
    body: bytes
    fields: Mapping[str, str]


@dataclass(frozen=True)
class CallFacts:
    """Who calls whom, as the carrier's answer webhook tells it."""

    call_id: str
    from_: str = ""
    to: str = ""
    direction: str = "inbound"
    account: str = ""


@dataclass(frozen=True)
class CallStatus:
    """A status event of a call (Twilio's status callback, Vonage's event, Plivo's hangup URL...)."""

    call_id: str
    status: str
    terminal: bool
    facts: CallFacts | None = None
    duration_s: str = ""


@dataclass(frozen=True)
class Reply:
    """An HTTP answer to the carrier."""

    body: str | bytes
    media_type: str
    status: int = 200


# --- instructions for a live call (actions, goodbyes) ----------------------------------------------


@dataclass(frozen=True)
class Say:
    text: str


@dataclass(frozen=True)
class Play:
    url: str


@dataclass(frozen=True)
class Dial:
    """Connect the caller to a number (E.164) or a SIP URI. `whisper` is said to whoever answers
    before the two are connected; `rule` names the persona's rule it came from (persona, index)."""

    target: str
    caller_id: str | None = None
    whisper: str | None = None
    rule: tuple[str, int] | None = None


@dataclass(frozen=True)
class Hangup:
    pass


@dataclass(frozen=True)
class Redirect:
    """Hand the call to the user's own document at `url` (in the carrier's markup)."""

    url: str


@dataclass(frozen=True)
class Resume:
    """Back to the agent: the call's held session continues on a new stream, found by `token`."""

    token: str
    persona: str


@dataclass(frozen=True)
class Markup:
    """A document in the carrier's own markup, given whole (a configured fallback)."""

    text: str


Step = Say | Play | Dial | Hangup | Redirect | Resume | Markup


@dataclass(frozen=True)
class CallHandle:
    """What call control needs to reach one live call."""

    call_id: str
    control_id: str = ""  # the call-control id when it differs from the call id (Telnyx)
    account: str = ""
    public_base: str = ""  # https://host[:port][/prefix] the carrier reaches us at


@dataclass(frozen=True)
class Outcome:
    """What a control request came to; `detail` says why when it did not go through."""

    ok: bool
    detail: str = ""


class CallControl(Protocol):
    """The carrier's REST API for live calls. Never raises: a refusal is an Outcome(False)."""

    @property
    def available(self) -> bool:
        """False without the credentials the API needs (then every request is refused, logged)."""
        ...

    async def hang_up(self, call: CallHandle) -> Outcome: ...

    async def instruct(self, call: CallHandle, steps: Sequence[Step]) -> Outcome:
        """Give the live call new instructions: the carrier stops our stream and follows them."""
        ...


# --- the carrier itself ------------------------------------------------------------------------


@dataclass(frozen=True)
class CarrierPaths:
    """Where the carrier reaches us (all under `/<name>/`)."""

    answer: str  # the answer webhook (the number's "a call comes in" URL)
    answer_methods: tuple[str, ...]
    status: str | None  # call status events, when the carrier sends them
    media: str  # the stream's WebSocket; `/{ticket}` is appended
    status_methods: tuple[str, ...] = ("POST",)


# A document of ours and the public base -> the URL the carrier fetches it at (service.publish,
# bound to the carrier: carrier_kit.with_publisher).
Publish = Callable[[Reply, str], str]
SendRequest = Callable[["RestRequest"], Awaitable["RestAnswer"]]


@dataclass(frozen=True)
class RestRequest:
    """One request to a carrier's REST API, built by the carrier and sent by the phone call's
    HTTP client (rest.py), so carrier modules stay free of sockets and easy to test."""

    method: str
    url: str
    headers: Mapping[str, str] = field(default_factory=dict)
    json: Any = None
    form: Mapping[str, str] | None = None


@dataclass(frozen=True)
class RestAnswer:
    status: int  # 0: no answer (timeout, refused connection)
    body: bytes = b""
    error: str = ""

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def outcome(self, api: str) -> Outcome:
        """What the request came to, for a call's record; `api` names who answered ("Plivo")."""
        return Outcome(True) if self.ok else Outcome(False, f"{api} answered {self.status or self.error}")


class Carrier(Protocol):
    """A carrier as the phone call uses it. See the module docstring and docs/phone.md."""

    name: str  # "twilio": the URL prefix, the `--carriers` name, the records' `carrier`
    paths: CarrierPaths
    control: CallControl
    # True where closing the socket is how the carrier ends a stream (Plivo, Vonage): the call
    # ends as with a stop message. Elsewhere a close without one is a lost socket.
    stream_ends_on_close: bool
    # Optional (read with getattr): `subprotocol`, the WebSocket subprotocol accepted when the
    # carrier offers it (jambonz's `audio.jambonz.org`); `answers_in_stream`, True where no
    # answer webhook comes first: the stream's start is the call's arrival (Genesys), admitted
    # then, with `paths.answer` empty and any path under `paths.media` taken for the stream;
    # `wire_for(conn) -> StreamWire`, where the stream's wire must know what its upgrade said
    # (Genesys compares the upgrade's organization header with its `open`).

    def check(self) -> None:
        """Refuse to start (UserError) when the settings cannot work (no key to check signatures)."""
        ...

    def fields(self, method: str, query: Mapping[str, str], body: bytes, content_type: str) -> dict[str, str]:
        """The request's fields as this carrier sends them (form, JSON or query)."""
        ...

    def verify(self, webhook: Webhook) -> bool:
        """The request really comes from the carrier (its signature, fresh where it carries a time)."""
        ...

    def verify_upgrade(self, conn: HTTPConnection) -> bool:
        """The stream's WebSocket upgrade may be accepted (its ticket is checked separately)."""
        ...

    def facts(self, webhook: Webhook) -> CallFacts:
        """The call an answer webhook is about."""
        ...

    def status(self, webhook: Webhook) -> CallStatus | None:
        """A status webhook's news, or None when it is about nothing the call tracks."""
        ...

    def stream_url(self, ws_base: str, ticket: str) -> str:
        """The WebSocket URL our answer sends the stream to (`ws_base` = wss://host/<name>/...)."""
        ...

    def answer_stream(self, stream_url: str, params: Mapping[str, str], facts: CallFacts) -> Reply:
        """The answer that connects the call to `stream_url`; `params` travel to StreamStart."""
        ...

    def answer_refusal(self, message: str, busy: bool) -> Reply:
        """The answer that tells the caller `message` and ends the call (busy, misconfigured)."""
        ...

    def engine_lost(self, apology: str) -> list[Step]:
        """What a call whose engine died is given (the apology, or the carrier's own fallback)."""
        ...

    def new_wire(self) -> StreamWire: ...

    # Optional: `barge_in = True` to drop the agent's unheard audio when the caller starts
    # talking over it (barge_in.py; PERSONAPLEX_PHONE_BARGE_IN overrides it for every carrier);
    # `flow_values(webhook) -> Mapping[str, str]`, where the answer webhook carries the
    # flow's values (persona, template variables) when not in its query string (Asterisk's
    # POST /asterisk/calls has them in its body); `routes(service) -> APIRouter`, the carrier's
    # own routes (they take precedence over the generic ones, and an APIRouter's lifespan runs
    # with the server's: a listener of its own, like AudioSocket's).
