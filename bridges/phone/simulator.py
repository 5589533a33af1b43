"""A local caller for every carrier: the carrier's side of a phone call, against a running server.

`PhoneSimulator` does what a carrier does when someone calls a number pointed at the server:
the signed answer webhook, the media stream (signed or with its ticket, as the carrier does),
caller audio paced at real time in the carrier's codec, DTMF, the end (a stop message or a
closed socket), status callbacks. Our audio is "played" by a model of the carrier's playback
buffer: each message plays after the one before (or at once when the buffer ran dry: a late
message), a mark is answered once the audio queued before it has played, `clear` drops the
buffer (what it dropped is measured) and is answered as the carrier answers it.

Each carrier's own side (signing, markup, messages) is its `sim.py` (`CarrierSide`), pure data
like the rest of the carrier; this module does the I/O (aiohttp). `personaplex-voice phone
simulate` and the tests use it. Optional side members: `subprotocols` (offered on the upgrade:
jambonz), `offer(…)` (platforms without an answer webhook, which open the stream themselves:
Genesys) and `respond(offer, stream_id, ours)` (what the carrier says back to one of our other
messages: Genesys's `close` after our `disconnect`).

    side = load_side("plivo", auth_id="MA…", auth_token="…")
    sim = PhoneSimulator(side, "http://127.0.0.1:8998")
    offer = await sim.answer(to="+15550001")          # signed webhook -> the stream we were given
    async with sim.stream(offer) as call:
        await call.answered()                          # line silence until the agent's audio comes
        await call.play(pcm_at_line_rate)
        await call.dtmf("0")
    call.heard()                                       # what the caller heard, float32
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import secrets
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import numpy as np

from .audio_path import codec_for
from .carrier import AudioFormat
from .urls import websocket_base


@dataclass(frozen=True)
class HttpRequest:
    method: str
    path: str  # path and query, as the carrier requests it of PUBLIC_URL
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""


@dataclass(frozen=True)
class StreamOffer:
    """What our answer webhook told the carrier: where to stream, in which formats."""

    call_id: str
    url: str
    params: Mapping[str, str]
    inbound: AudioFormat  # what the caller sends
    outbound: AudioFormat  # what we send
    headers: Mapping[str, str] = field(default_factory=dict)  # the WebSocket upgrade's


@dataclass(frozen=True)
class Ours:
    """One of our stream messages, as the carrier reads it."""

    kind: str  # "media", "mark", "clear", "other"
    payload: bytes = b""
    name: str = ""


class CarrierSide(Protocol):
    name: str
    chunk_ms: int  # how much caller audio one media message of the carrier carries
    marks_on_clear: bool  # after a clear, are the dropped marks answered (Twilio) or forgotten?
    ends_by_close: bool  # the carrier ends a stream by closing it (no stop message)

    def answer_request(
        self, public_url: str, call_id: str, to: str, from_: str, query: str = ""
    ) -> HttpRequest:
        """The signed answer webhook for a new call."""
        ...

    def parse_answer(self, call_id: str, status: int, body: bytes) -> StreamOffer | None:
        """Our answer: the stream offered, or None (busy, refused)."""
        ...

    def upgrade(self, offer: StreamOffer, public_url: str) -> tuple[str, dict[str, str]]:
        """The stream's URL (still public) and its upgrade headers (a signature, credentials)."""
        ...

    def opening(self, offer: StreamOffer, stream_id: str) -> list[str | bytes]:
        """The carrier's first messages (connected, start)."""
        ...

    def media(
        self, offer: StreamOffer, stream_id: str, payload: bytes, chunk: int, ms: int
    ) -> str | bytes: ...

    def dtmf(self, offer: StreamOffer, stream_id: str, digit: str) -> str | bytes: ...

    def stop(self, offer: StreamOffer, stream_id: str) -> str | bytes | None: ...

    def read(self, message: str | bytes) -> Ours: ...

    def mark_played(self, offer: StreamOffer, stream_id: str, name: str) -> str | bytes: ...

    def cleared(self, offer: StreamOffer, stream_id: str) -> str | bytes | None: ...

    def status_request(self, public_url: str, call_id: str, status: str) -> HttpRequest: ...


def load_side(carrier: str, **secrets_: Any) -> CarrierSide:
    """The named carrier's side (its package's `sim.side(**secrets)`)."""
    from . import CARRIERS

    module = importlib.import_module(CARRIERS[carrier] + ".sim")
    return module.side(**secrets_)


@dataclass
class Played:
    arrival: float
    start: float  # when the carrier starts playing it
    pcm: np.ndarray
    late: bool  # the buffer had run dry before it arrived


class SimulatedStream:
    """One stream of a simulated call; see the module docstring."""

    def __init__(self, side: CarrierSide, offer: StreamOffer, ws: aiohttp.ClientWebSocketResponse):
        self.side = side
        self.offer = offer
        self.ws = ws
        self.stream_id = "SS" + secrets.token_hex(12)
        self.line_in = codec_for(offer.inbound)
        self.line_out = codec_for(offer.outbound)
        self.chunk = 0
        self.t0 = 0.0  # monotonic time of the first caller audio (the call's timeline origin)
        self.played: list[Played] = []
        self.play_end = 0.0
        self.max_queued_s = 0.0
        self.marks_echoed: list[str] = []
        self._pending_marks: list[tuple[str, asyncio.TimerHandle]] = []
        self._tasks: set[asyncio.Future[Any]] = set()
        self.clears = 0
        self.dropped_by_clear_s: list[float] = []  # what each clear dropped from the buffer
        self.others: list[Ours] = []
        self.closed = asyncio.Event()
        self.close_code: int | None = None
        self._lock = asyncio.Lock()
        self.sent_pcm: list[np.ndarray] = []

    # --- the carrier sending ----------------------------------------------------------------------
    async def send(self, message: str | bytes | None) -> None:
        if message is None or self.ws.closed:
            return
        async with self._lock:
            with contextlib.suppress(ConnectionError, RuntimeError):
                if isinstance(message, bytes):
                    await self.ws.send_bytes(message)
                else:
                    await self.ws.send_str(message)

    async def play(self, pcm: np.ndarray) -> None:
        """Caller audio (float32 at the line's rate), sent in the carrier's messages at real time."""
        fmt = self.offer.inbound
        step = fmt.rate * self.side.chunk_ms // 1000
        pcm = np.asarray(pcm, np.float32)
        pcm = np.concatenate([pcm, np.zeros(-len(pcm) % step, np.float32)])
        start = time.monotonic() if not self.t0 else self.t0 + self.chunk * self.side.chunk_ms / 1000
        for i in range(0, len(pcm), step):
            delay = start + (i // step) * self.side.chunk_ms / 1000 - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if self.closed.is_set():
                return
            await self.send_pcm(pcm[i : i + step])

    async def send_pcm(self, pcm: np.ndarray) -> None:
        self.sent_pcm.append(pcm)
        await self.send_payload(self.line_in.encode(pcm))

    async def send_payload(self, payload: bytes) -> None:
        """One media message of already-encoded caller audio (a load test encodes its audio once)."""
        now = time.monotonic()
        if not self.t0:
            self.t0 = now
        self.chunk += 1
        ms = round((now - self.t0) * 1000)
        await self.send(self.side.media(self.offer, self.stream_id, payload, self.chunk, ms))

    async def answered(self, timeout: float = 10.0) -> int:
        """Line silence (carriers send the line's audio from the start) until the agent's audio
        comes back. Returns the samples of it sent."""
        step = self.offer.inbound.rate * self.side.chunk_ms // 1000
        sent = 0
        deadline = time.monotonic() + timeout
        while not self.played and not self.closed.is_set():
            if time.monotonic() > deadline:
                raise TimeoutError("no audio from the server")
            await self.play(np.zeros(step, np.float32))
            sent += step
        return sent

    async def dtmf(self, digit: str) -> None:
        await self.send(self.side.dtmf(self.offer, self.stream_id, digit))

    async def hang_up(self) -> None:
        """The caller hangs up: the carrier's stop message, or its socket closing."""
        stop = self.side.stop(self.offer, self.stream_id)
        if stop is not None:
            await self.send(stop)
        if self.side.ends_by_close or stop is None:
            await self.ws.close()

    # --- the carrier receiving and "playing" -------------------------------------------------------
    def _on_media(self, payload: bytes) -> None:
        now = time.monotonic()
        pcm = self.line_out.decode(payload)
        seconds = len(pcm) / self.offer.outbound.rate
        late = bool(self.played) and now > self.play_end
        start = max(now, self.play_end)
        self.play_end = start + seconds
        self.max_queued_s = max(self.max_queued_s, self.play_end - now - seconds)
        self.played.append(Played(now, start, pcm, late))

    def _on_mark(self, name: str) -> None:
        delay = max(0.0, self.play_end - time.monotonic())
        handle = asyncio.get_running_loop().call_later(delay, self._mark_due, name)
        self._pending_marks.append((name, handle))

    def _mark_due(self, name: str) -> None:
        self._pending_marks = [(n, h) for n, h in self._pending_marks if n != name]
        self.marks_echoed.append(name)
        task = asyncio.ensure_future(self.send(self.side.mark_played(self.offer, self.stream_id, name)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _on_clear(self) -> None:
        self.clears += 1
        now = time.monotonic()
        self.dropped_by_clear_s.append(max(0.0, self.play_end - now))
        self.play_end = min(self.play_end, now)
        self.played = [p for p in self.played if p.start <= now]
        pending, self._pending_marks = self._pending_marks, []
        for name, handle in pending:
            handle.cancel()
            if self.side.marks_on_clear:
                self.marks_echoed.append(name)
                await self.send(self.side.mark_played(self.offer, self.stream_id, name))
        await self.send(self.side.cleared(self.offer, self.stream_id))

    async def receive_loop(self) -> None:
        try:
            async for message in self.ws:
                if message.type not in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
                    break
                ours = self.side.read(message.data)
                if ours.kind == "media":
                    self._on_media(ours.payload)
                elif ours.kind == "mark":
                    self._on_mark(ours.name)
                elif ours.kind == "clear":
                    await self._on_clear()
                else:
                    self.others.append(ours)
                    await self._respond(ours)
        finally:
            self.close_code = self.ws.close_code
            self.closed.set()

    # --- results ---------------------------------------------------------------------------------
    async def _respond(self, ours: Ours) -> None:
        respond = getattr(self.side, "respond", None)
        if respond is not None:
            for message in respond(self.offer, self.stream_id, ours):
                await self.send(message)

    @property
    def late_messages(self) -> int:
        return sum(p.late for p in self.played)

    def heard(self) -> np.ndarray:
        """What the caller heard (float32 at our outbound rate); sample 0 = the caller's first audio."""
        rate = self.offer.outbound.rate
        if not self.played:
            return np.zeros(0, np.float32)
        origin = self.t0 or self.played[0].start
        end = max(p.start + len(p.pcm) / rate for p in self.played) - origin
        out = np.zeros(max(0, round(end * rate)) + rate // 50, np.float32)
        for p in self.played:
            pos = round((p.start - origin) * rate)
            if pos >= 0:
                n = min(len(p.pcm), len(out) - pos)
                out[pos : pos + n] = p.pcm[:n]
        return out

    def sent(self) -> np.ndarray:
        """What the caller said (float32 at the inbound rate), from its first audio on."""
        return np.concatenate(self.sent_pcm) if self.sent_pcm else np.zeros(0, np.float32)


class PhoneSimulator:
    """A carrier pointed at `base_url` (the server's PUBLIC_URL is `public_url`)."""

    def __init__(
        self, side: CarrierSide, base_url: str, public_url: str | None = None, timeout_s: float = 10.0
    ):
        self.side = side
        self.base_url = base_url.rstrip("/")
        self.public_url = (public_url or base_url).rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def request(self, request: HttpRequest) -> tuple[int, bytes]:
        async with (
            aiohttp.ClientSession(timeout=self.timeout) as session,
            session.request(
                request.method,
                self.base_url + request.path,
                headers=dict(request.headers),
                data=request.body or None,
                allow_redirects=False,
            ) as response,
        ):
            return response.status, await response.read()

    async def webhook(
        self,
        call_id: str | None = None,
        to: str = "+15550100001",
        from_: str = "+15550100002",
        query: str = "",
    ) -> tuple[str, int, bytes]:
        """The signed answer webhook of a call; returns (call id, status, body)."""
        call_id = call_id or self.new_call_id()
        status, body = await self.request(
            self.side.answer_request(self.public_url, call_id, to, from_, query)
        )
        return call_id, status, body

    async def answer(self, call_id: str | None = None, **kwargs: Any) -> StreamOffer:
        """An incoming call: the signed answer webhook, and the stream it was answered with."""
        offer = getattr(self.side, "offer", None)
        if offer is not None:  # no answer webhook: the platform opens the stream itself
            return offer(self.public_url, call_id or self.new_call_id(), **kwargs)
        call_id, status, body = await self.webhook(call_id, **kwargs)
        offer = self.side.parse_answer(call_id, status, body)
        if offer is None:
            raise RuntimeError(f"{self.side.name}: no stream offered ({status}): {body[:300]!r}")
        return offer

    async def status(self, call_id: str, status: str) -> int:
        code, _ = await self.request(self.side.status_request(self.public_url, call_id, status))
        return code

    def new_call_id(self) -> str:
        return getattr(self.side, "new_call_id", lambda: "call" + secrets.token_hex(12))()

    @contextlib.asynccontextmanager
    async def stream(self, offer: StreamOffer, *, hang_up: bool = True) -> AsyncIterator[SimulatedStream]:
        """Open the offered stream as the carrier does; the caller hangs up at the end."""
        url, headers = self.side.upgrade(offer, self.public_url)
        target = websocket_base(self.public_url)
        if url.startswith(target):
            url = websocket_base(self.base_url) + url[len(target) :]
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=10))
        try:
            protocols = tuple(getattr(self.side, "subprotocols", ()))
            ws = await session.ws_connect(
                url, headers=headers, autoping=True, max_msg_size=0, protocols=protocols
            )
            call = SimulatedStream(self.side, offer, ws)
            receiver = asyncio.create_task(call.receive_loop())
            try:
                for message in self.side.opening(offer, call.stream_id):
                    await call.send(message)
                yield call
            finally:
                if hang_up and not call.closed.is_set():
                    await call.hang_up()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(call.closed.wait(), 5.0)
                await ws.close()
                receiver.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await receiver
                for _, handle in call._pending_marks:
                    handle.cancel()
        finally:
            await session.close()


class Caller(Protocol):
    """What `say_with_keys` needs of a simulated call (SimulatedStream, or a carrier's own)."""

    async def play(self, pcm: np.ndarray) -> None: ...

    async def dtmf(self, digit: str) -> None: ...


async def say_with_keys(call: Caller, line: np.ndarray, rate: int, digits: list[tuple[float, str]]) -> None:
    """The caller says `line` (at `rate`) at real time, pressing each key at its time ((seconds
    into it, key), in order), then keeps half a second of silence for the agent's last words."""
    cursor = 0
    for at, key in digits:
        upto = min(len(line), round(at * rate))
        if upto > cursor:
            await call.play(line[cursor:upto])
            cursor = upto
        await call.dtmf(key)
    if cursor < len(line):
        await call.play(line[cursor:])
    await call.play(np.zeros(rate // 2, np.float32))
