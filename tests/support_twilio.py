"""A Twilio simulator for tests and benchmarks: webhooks and Media Streams as Twilio documents them.

- Webhooks are form POSTs signed with `X-Twilio-Signature` (twilio's `RequestValidator`) over the
  public URL + path, like Twilio signs them.
- The Media Streams socket is opened with a signed upgrade (signature over the Stream URL), then
  speaks the documented JSON: `connected`; `start` (string `sequenceNumber`, `streamSid`,
  `callSid`, `tracks`, `customParameters`, `mediaFormat`); `media` every 20 ms (string
  `sequenceNumber`, `chunk`, `timestamp`; base64 μ-law 8 kHz); `dtmf`; `stop`.
- What the server sends back is "played" by a model of Twilio's buffer: each 20 ms `media` plays
  after the previous one (or at once when the buffer ran dry: an underrun, a *late frame*); a
  `mark` is echoed once the audio queued before it has played; `clear` drops the buffer and
  echoes its pending marks.

    sim = TwilioSimulator(base_url="http://127.0.0.1:PORT", auth_token="...")
    twiml = sim.voice_webhook(to="+15550001", from_="+15550002")      # httpx response
    stream_url, params = parse_stream_twiml(twiml.text)
    async with sim.media_stream(stream_url, params) as call:
        await call.play(tone_8k)          # paced at real time
        ...
    call.played_audio()                   # float32 at 8 kHz on the inbound timeline
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import secrets
import time
import xml.etree.ElementTree as ET
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
from twilio.http import HttpClient
from twilio.http.response import Response
from twilio.request_validator import RequestValidator
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from personaplex_voice.audio.mulaw import ulaw_decode, ulaw_encode

RATE = 8000
CHUNK = 160  # bytes = samples = 20 ms
CHUNK_S = 0.020
ACCOUNT_SID = "AC" + "0" * 32


# A `media` message as Twilio sends it (field order included), up to its `streamSid`.
_MEDIA_TEMPLATE = (
    '{"event":"media","sequenceNumber":"%d","media":{"track":"inbound","chunk":"%d",'
    '"timestamp":"%d","payload":"%s"}'
)


def sid(prefix: str) -> str:
    return prefix + secrets.token_hex(16)


def parse_stream_twiml(xml: str) -> tuple[str, dict[str, str]]:
    """`<Response><Connect><Stream url=…><Parameter …/>` -> (url, parameters)."""
    root = ET.fromstring(xml)
    stream = root.find("./Connect/Stream")
    if stream is None:
        raise AssertionError(f"no <Connect><Stream> in TwiML: {xml}")
    params = {p.get("name", ""): p.get("value", "") for p in stream.findall("Parameter")}
    return stream.get("url", ""), params


@dataclass
class Played:
    arrival: float
    start: float  # when Twilio starts playing it
    payload: bytes
    late: bool  # the buffer had run dry before it arrived
    gap_s: float = 0.0  # how long the caller heard nothing of ours before it (when late)


@dataclass
class SimulatedCall:
    ws: ClientConnection
    stream_sid: str
    call_sid: str
    seq: int = 0
    chunk: int = 0
    t0: float = 0.0  # monotonic time of the first inbound media (the call's timeline origin)
    played: list[Played] = field(default_factory=list)
    play_end: float = 0.0
    max_queued_s: float = 0.0
    marks_echoed: list[str] = field(default_factory=list)
    pending_marks: list[tuple[str, asyncio.TimerHandle]] = field(default_factory=list)
    _tasks: set[asyncio.Future[None]] = field(default_factory=set)
    clears: int = 0
    others: list[dict[str, Any]] = field(default_factory=list)  # anything else the server sent
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    close_code: int | None = None
    send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _sid_tail: str = ""  # `,"streamSid":"MZ…"}`, the end of every media message
    keep_sent: bool = False  # keep every μ-law byte sent in `sent` (tests of recordings)
    sent: bytearray = field(default_factory=bytearray)

    # --- sending, as Twilio does -----------------------------------------------------------
    def _next_seq(self) -> str:
        self.seq += 1
        return str(self.seq)

    async def send(self, message: dict[str, Any]) -> None:
        async with self.send_lock:
            await self.ws.send(json.dumps(message))

    async def send_raw(self, data: str | bytes) -> None:
        async with self.send_lock:
            await self.ws.send(data)

    async def send_media(self, payload: bytes | str) -> None:
        """One 20 ms `media` message; `payload` is μ-law bytes or their base64 text already
        (a load test encodes its audio once). Formatted from a template, not `json.dumps`: the
        same JSON, at a fraction of the simulator's CPU when hundreds of calls share a core."""
        now = time.monotonic()
        if not self.t0:
            self.t0 = now
        self.chunk += 1
        self.seq += 1
        if self.keep_sent:
            self.sent += payload if isinstance(payload, bytes) else base64.b64decode(payload)
        if isinstance(payload, bytes):
            payload = base64.b64encode(payload).decode("ascii")
        text = _MEDIA_TEMPLATE % (self.seq, self.chunk, round((now - self.t0) * 1000), payload)
        if not self._sid_tail:
            self._sid_tail = f',"streamSid":{json.dumps(self.stream_sid)}}}'
        await self.send_raw(text + self._sid_tail)

    async def play(self, pcm_8k: np.ndarray) -> None:
        """Send audio as 20 ms media messages on an absolute real-time schedule."""
        data = ulaw_encode(np.asarray(pcm_8k, np.float32))
        data += b"\xff" * (-len(data) % CHUNK)
        start = time.monotonic() if not self.t0 else self.t0 + self.chunk * CHUNK_S
        for i in range(0, len(data), CHUNK):
            due = start + (i // CHUNK) * CHUNK_S
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if self.closed.is_set():
                return
            await self.send_media(data[i : i + CHUNK])

    async def answered(self, timeout: float = 10.0) -> int:
        """Send the caller's line silence, as Twilio does from the start of every stream, until
        the agent's audio comes back (the engine answers input frame by frame). Returns the
        samples sent, so a test can place what it plays next on the inbound timeline."""
        sent = 0
        deadline = time.monotonic() + timeout
        while not self.played and not self.closed.is_set():
            if time.monotonic() > deadline:
                raise AssertionError("no outbound audio")
            await self.play(np.zeros(CHUNK, np.float32))
            sent += CHUNK
        return sent

    async def dtmf(self, digit: str) -> None:
        await self.send(
            {
                "event": "dtmf",
                "streamSid": self.stream_sid,
                "sequenceNumber": self._next_seq(),
                "dtmf": {"track": "inbound_track", "digit": digit},
            }
        )

    async def stop(self) -> None:
        with contextlib.suppress(ConnectionClosed):
            await self.send(
                {
                    "event": "stop",
                    "sequenceNumber": self._next_seq(),
                    "stop": {"accountSid": ACCOUNT_SID, "callSid": self.call_sid},
                    "streamSid": self.stream_sid,
                }
            )

    # --- receiving and "playing" -----------------------------------------------------------
    def _on_media(self, payload: bytes) -> None:
        now = time.monotonic()
        late = bool(self.played) and now > self.play_end
        gap = now - self.play_end if late else 0.0
        start = max(now, self.play_end)
        self.play_end = start + len(payload) / RATE
        self.max_queued_s = max(self.max_queued_s, self.play_end - now - len(payload) / RATE)
        self.played.append(Played(now, start, payload, late, gap))

    def _schedule_mark(self, name: str) -> None:
        """Echo `name` once everything received before it has played (a timer, not a poll)."""
        loop = asyncio.get_running_loop()
        delay = max(0.0, self.play_end - time.monotonic())
        handle = loop.call_later(delay, self._mark_due, name)
        self.pending_marks.append((name, handle))

    def _mark_due(self, name: str) -> None:
        self.pending_marks = [(n, h) for n, h in self.pending_marks if n != name]
        self._tasks.add(task := asyncio.ensure_future(self._send_mark(name)))
        task.add_done_callback(self._tasks.discard)

    async def _send_mark(self, name: str) -> None:
        self.marks_echoed.append(name)
        with contextlib.suppress(ConnectionClosed):
            await self.send(
                {
                    "event": "mark",
                    "sequenceNumber": self._next_seq(),
                    "streamSid": self.stream_sid,
                    "mark": {"name": name},
                }
            )

    async def receive_loop(self) -> None:
        try:
            async for raw in self.ws:
                message = json.loads(raw)
                event = message.get("event")
                if message.get("streamSid") != self.stream_sid:
                    self.others.append(message)
                elif event == "media":
                    self._on_media(base64.b64decode(message["media"]["payload"]))
                elif event == "mark":
                    self._schedule_mark(message["mark"]["name"])
                elif event == "clear":
                    self.clears += 1
                    now = time.monotonic()
                    self.play_end = min(self.play_end, now)
                    self.played = [p for p in self.played if p.start <= now]
                    pending, self.pending_marks = self.pending_marks, []
                    for name, handle in pending:
                        handle.cancel()
                        await self._send_mark(name)
                else:
                    self.others.append(message)
        except ConnectionClosed:
            pass
        finally:
            self.close_code = self.ws.close_code
            self.closed.set()

    # --- results -----------------------------------------------------------------------------
    @property
    def late_frames(self) -> int:
        return sum(p.late for p in self.played)

    def played_audio(self) -> np.ndarray:
        """What the caller heard, float32 8 kHz; sample 0 = when our first media was sent."""
        if not self.played:
            return np.zeros(0, np.float32)
        origin = self.t0 or self.played[0].start
        end = max(p.start for p in self.played) - origin + CHUNK_S
        out = np.zeros(max(0, round(end * RATE)) + CHUNK, np.float32)
        for p in self.played:
            pos = round((p.start - origin) * RATE)
            if pos < 0:
                continue
            pcm = ulaw_decode(p.payload)
            out[pos : pos + len(pcm)] = pcm[: len(out) - pos]
        return out

    def underrun_s(self, before: float | None = None) -> float:
        """Silence the caller heard mid-stream (our audio came late), up to `before` (timeline s)."""
        origin = self.t0 or (self.played[0].start if self.played else 0.0)
        return sum(p.gap_s for p in self.played if before is None or p.start - origin <= before)

    def message_gaps_s(self) -> np.ndarray:
        arrivals = np.array([p.arrival for p in self.played])
        return np.diff(arrivals) if len(arrivals) > 1 else np.zeros(0)


class TwilioSimulator:
    """Twilio's side of a number pointed at `base_url` (the server's PUBLIC_URL is `public_url`)."""

    def __init__(self, base_url: str, auth_token: str, public_url: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.public_url = (public_url or base_url).rstrip("/")
        self.validator = RequestValidator(auth_token)

    def sign(self, url: str, params: Mapping[str, str] | None = None) -> str:
        return self.validator.compute_signature(url, dict(params or {}))

    def post_webhook(
        self, path: str, form: Mapping[str, str], *, signature: str | None = "sign", timeout: float = 10.0
    ) -> httpx.Response:
        headers = {}
        if signature == "sign":
            headers["X-Twilio-Signature"] = self.sign(self.public_url + path, form)
        elif signature is not None:
            headers["X-Twilio-Signature"] = signature
        return httpx.post(self.base_url + path, data=dict(form), headers=headers, timeout=timeout)

    def voice_webhook(
        self, to: str = "+15550100001", from_: str = "+15550100002", *, query: str = "", **kw: Any
    ) -> httpx.Response:
        """The signed incoming-call webhook; `query` (e.g. "customer_name=Omar%20Torres") is what
        a Studio flow or `<Redirect>` adds to the URL, signed with it."""
        form = {
            "AccountSid": ACCOUNT_SID,
            "CallSid": kw.pop("call_sid", None) or sid("CA"),
            "From": from_,
            "To": to,
            "CallStatus": "ringing",
            "Direction": "inbound",
            "ApiVersion": "2010-04-01",
        }
        return self.post_webhook("/twilio/voice" + (f"?{query}" if query else ""), form, **kw)

    def answer(
        self, to: str = "+15550100001", from_: str = "+15550100002", *, query: str = "", timeout: float = 10.0
    ) -> tuple[str, str, dict[str, str]]:
        """An incoming call: the signed voice webhook, then the Stream it answered with.
        Returns (call_sid, stream_url, parameters); fails on anything but `<Connect><Stream>`."""
        call_sid = sid("CA")
        response = self.voice_webhook(to=to, from_=from_, call_sid=call_sid, query=query, timeout=timeout)
        assert response.status_code == 200, response.text
        url, params = parse_stream_twiml(response.text)
        return call_sid, url, params

    def follow(self, url: str, call_sid: str, to: str = "+15550100001") -> httpx.Response:
        """Twilio fetching a URL of ours that it was told to go to (a `<Redirect>`), signed."""
        parts = urlsplit(url)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        form = {"AccountSid": ACCOUNT_SID, "CallSid": call_sid, "To": to, "CallStatus": "in-progress"}
        return self.post_webhook(path, form)

    def status_callback(self, call_sid: str, status: str, **extra: str) -> httpx.Response:
        form = {"AccountSid": ACCOUNT_SID, "CallSid": call_sid, "CallStatus": status, **extra}
        return self.post_webhook("/twilio/status", form)

    @contextlib.asynccontextmanager
    async def media_stream(
        self,
        stream_url: str,
        params: Mapping[str, str],
        *,
        call_sid: str | None = None,
        signature: str | None = "sign",
        send_start: bool = True,
    ) -> AsyncIterator[SimulatedCall]:
        """Open the stream like Twilio: signed upgrade, `connected`, `start`; `stop` at the end."""
        headers = {}
        if signature == "sign":
            headers["X-Twilio-Signature"] = self.sign(stream_url, {})
        elif signature is not None:
            headers["X-Twilio-Signature"] = signature
        # Twilio dials the public URL; the test reaches the same server at base_url.
        target = stream_url.replace(_ws(self.public_url), _ws(self.base_url), 1)
        ws = await connect(target, additional_headers=headers, compression=None, proxy=None, max_size=None)
        call = SimulatedCall(ws=ws, stream_sid=sid("MZ"), call_sid=call_sid or sid("CA"))
        receiver = asyncio.create_task(call.receive_loop())
        try:
            await call.send({"event": "connected", "protocol": "Call", "version": "1.0.0"})
            if send_start:
                await call.send(
                    {
                        "event": "start",
                        "sequenceNumber": call._next_seq(),
                        "start": {
                            "accountSid": ACCOUNT_SID,
                            "streamSid": call.stream_sid,
                            "callSid": call.call_sid,
                            "tracks": ["inbound"],
                            "customParameters": dict(params),
                            "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
                        },
                        "streamSid": call.stream_sid,
                    }
                )
            yield call
        finally:
            if not call.closed.is_set():
                await call.stop()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(call.closed.wait(), 5.0)
            with contextlib.suppress(Exception):
                await ws.close()
            receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await receiver
            for _, handle in call.pending_marks:
                handle.cancel()


def _ws(url: str) -> str:
    return (
        "wss://" + url[8:]
        if url.startswith("https://")
        else "ws://" + url[7:]
        if url.startswith("http://")
        else url
    )


def tone(freq: float, seconds: float, amplitude: float = 0.5, rate: int = RATE) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    return (amplitude * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def sine_fit_snr_db(x: np.ndarray, freq: float, rate: int = RATE) -> float:
    """SNR of `x` as a sinusoid at `freq` (any phase/amplitude): fitted power over residual power."""
    t = np.arange(len(x)) / rate
    basis = np.stack([np.sin(2 * np.pi * freq * t), np.cos(2 * np.pi * freq * t)], axis=1)
    coef, *_ = np.linalg.lstsq(basis, x.astype(np.float64), rcond=None)
    fitted = basis @ coef
    noise = np.mean((x - fitted) ** 2)
    return float(10 * np.log10(np.mean(fitted**2) / max(noise, 1e-20)))


# --- Twilio's REST cloud, faked at its HTTP boundary ------------------------------------------------


@dataclass
class Sent:
    method: str
    url: str
    data: dict
    auth: tuple | None


class FakeTwilioCloud(HttpClient):
    """Twilio's REST cloud at its HTTP boundary (a `twilio.http.HttpClient` handed to the
    bridge): answers Calls create (201) and update (200) like api.twilio.com, records every
    request. `refuse_updates` makes every call update a 400 (Twilio refusing new TwiML)."""

    def __init__(self) -> None:
        super().__init__(logger=None, is_async=False)
        self.requests: list[Sent] = []
        self.created = 0
        self.refuse_updates = False

    def request(self, method, uri, params=None, data=None, headers=None, auth=None, timeout=None, **kw):
        self.requests.append(Sent(method, uri, dict(data or {}), auth))
        path = urlsplit(uri).path
        if method == "POST" and path.endswith("/Calls.json"):
            self.created += 1
            sid = "CA" + f"{self.created:032x}"
            body = {"sid": sid, "account_sid": ACCOUNT_SID, "status": "queued", "to": data["To"]}
            return Response(201, json.dumps(body))
        if method == "POST" and "/Calls/CA" in path:
            sid = path.rsplit("/", 1)[1].removesuffix(".json")
            if self.refuse_updates:
                return Response(400, json.dumps({"code": 21220, "message": "not in progress", "status": 400}))
            return Response(200, json.dumps({"sid": sid, "account_sid": ACCOUNT_SID, "status": "completed"}))
        return Response(404, json.dumps({"code": 20404, "message": "not found", "status": 404}))

    def hangups(self) -> list[str]:
        return [
            urlsplit(r.url).path.rsplit("/", 1)[1].removesuffix(".json")
            for r in self.requests
            if "/Calls/CA" in r.url and r.data.get("Status") == "completed"
        ]

    def updates(self) -> list[Sent]:
        """Call updates carrying new instructions (TwiML or a URL), in order."""
        return [r for r in self.requests if "/Calls/CA" in r.url and ("Twiml" in r.data or "Url" in r.data)]


# --- an in-process server, for tests that must reach inside (a fake Twilio REST cloud) -------------


@dataclass
class InProcessServer:
    url: str
    app: Any
    server: Any


@contextlib.contextmanager
def running_app(app: Any) -> Any:
    """Serve `app` with a real uvicorn on a free port, in a thread with its own event loop."""
    import uvicorn
    from support_server import free_port, uvicorn_thread

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    with uvicorn_thread(server, name=f"uvicorn-{port}"):
        yield InProcessServer(f"http://127.0.0.1:{port}", app, server)


def speechlike(seconds: float, seed: int, rate: int = RATE) -> np.ndarray:
    """A caller's "speech" of its own: telephone-band noise (300-3400 Hz) with a syllable-rate
    envelope that never falls silent, so every second of it can be found in the echo, at one
    delay only (a tone would match at every period)."""
    n = round(seconds * rate)
    spectrum = np.fft.rfft(np.random.default_rng(seed).standard_normal(n))
    freqs = np.fft.rfftfreq(n, 1 / rate)
    spectrum[(freqs < 300) | (freqs > 3400)] = 0
    band = np.fft.irfft(spectrum, n)
    band /= np.max(np.abs(band)) or 1.0
    t = np.arange(n) / rate
    envelope = 0.65 + 0.35 * np.sin(2 * np.pi * 3.7 * t + seed)
    return (0.5 * band * envelope).astype(np.float32)


@dataclass(frozen=True)
class EchoQuality:
    """How well each second of what a caller said came back (the echo engine's answer):
    `correlations[k]` is second k's best normalized correlation with what the caller heard,
    `delays_s[k]` the delay it was found at."""

    correlations: list[float]
    delays_s: list[float]

    @property
    def delay_growth_s(self) -> float:
        return max((d - self.delays_s[0] for d in self.delays_s), default=0.0)

    def clean(self, min_correlation: float = 0.8, max_growth_s: float = 0.2) -> bool:
        """The per-second rule: every second comes back (r >= 0.8) and the delay does not
        grow by more than 200 ms."""
        return (
            bool(self.correlations)
            and min(self.correlations) >= min_correlation
            and self.delay_growth_s <= max_growth_s
        )


def echo_quality(
    sent: np.ndarray,
    heard: np.ndarray,
    *,
    start_s: float = 0.0,
    max_delay_s: float = 2.0,
    min_delay_room_s: float = 1.0,
    rate: int = RATE,
) -> EchoQuality:
    """Each whole second of `sent` from `start_s` on (both on the caller's timeline: sample 0 =
    its first message), found in `heard` at the delay (0..max_delay_s) where it correlates best.
    Seconds whose echo `heard` does not hold at least `min_delay_room_s` of delays for (the call
    ended first) are left out."""
    sent = np.asarray(sent, np.float64)
    heard = np.asarray(heard, np.float64)
    correlations, delays = [], []
    first = round(start_s * rate)
    for begin in range(first, len(sent) - rate + 1, rate):
        x = sent[begin : begin + rate]
        window = heard[begin : begin + rate + round(max_delay_s * rate)]
        span = len(window) - rate  # the delays this second can be looked for at
        if span < round(min_delay_room_s * rate) or not np.any(x):
            break
        size = 1 << int(np.ceil(np.log2(len(window) + rate)))
        dots = np.fft.irfft(np.fft.rfft(window, size) * np.conj(np.fft.rfft(x, size)), size)[: span + 1]
        energy = np.concatenate([[0.0], np.cumsum(window**2)])
        norms = np.sqrt(np.maximum(energy[rate : rate + span + 1] - energy[: span + 1], 1e-12))
        r = dots / (norms * np.linalg.norm(x))
        best = int(np.argmax(r))
        correlations.append(float(r[best]))
        delays.append(best / rate)
    return EchoQuality(correlations, delays)


def blockwise_snr_db(x: np.ndarray, freq: float, block_s: float = 0.1, rate: int = RATE) -> np.ndarray:
    """`sine_fit_snr_db` of each block: one glitch spoils its block only, and a shift of the
    whole echo (a frame of silence inserted by a late tick) does not spoil the rest."""
    n = round(block_s * rate)
    return np.array([sine_fit_snr_db(x[i : i + n], freq, rate) for i in range(0, len(x) - n + 1, n)])


# --- the bridge in this process, with the fake REST cloud --------------------------------------------

API_TOKEN = "bridge-test-api-token"


@dataclass
class BridgeHarness:
    url: str
    cloud: FakeTwilioCloud
    manager: Any
    sim: TwilioSimulator
    app: Any

    @property
    def bridge(self) -> Any:
        return self.app.state.twilio

    api_token: str = API_TOKEN

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, headers={"Authorization": f"Bearer {self.api_token}"}, timeout=10)

    def record(self, call_sid: str) -> dict[str, Any]:
        response = self.get(f"/twilio/calls/{call_sid}")
        assert response.status_code == 200, response.text
        return response.json()


@contextlib.contextmanager
def bridge_harness(
    personas_yaml: str,
    tmp_path: Any,
    *,
    engine: Any = None,
    manager_options: Mapping[str, Any] | None = None,
    auth_token: str = "harness-auth-token",
    api_token: str = API_TOKEN,
    **settings: Any,
) -> Any:
    """A real server app (echo engine unless given) under a real uvicorn in this process, the
    bridge mounted with `personas_yaml` and `settings`, Twilio's REST cloud faked."""
    from personaplex_twilio import mount
    from personaplex_twilio.config import TwilioSettings

    from personaplex_voice.engine.headroom import DISABLED
    from personaplex_voice.engine.loopback import LoopbackEngine
    from personaplex_voice.process.settings import ServerSettings
    from personaplex_voice.server.app import create_app
    from personaplex_voice.sessions import SessionManager

    personas = tmp_path / "personas.yaml"
    personas.write_text(personas_yaml)
    # Admission by slots only unless a test asks for the headroom policy (conftest.py says why).
    options = {"idle_timeout_s": None, "headroom": DISABLED, **(manager_options or {})}
    manager = SessionManager(engine or LoopbackEngine(num_slots=2), **options)
    app = create_app(ServerSettings(engine="echo", tune_runtime=False), host=manager)
    cloud = FakeTwilioCloud()
    with running_app(app) as server:
        twilio_settings = TwilioSettings(
            account_sid=ACCOUNT_SID,
            auth_token=auth_token,
            public_url=server.url,
            api_token=api_token,
            personas_file=personas,
            **settings,
        )
        mount(app, twilio_settings, http_client=cloud)
        yield BridgeHarness(
            server.url, cloud, manager, TwilioSimulator(server.url, auth_token), app, api_token
        )


# --- a plain local HTTP server: a CRM's context lookup, a post-call webhook sink ---------------------


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


class HttpSink:
    """An HTTP server on 127.0.0.1 in a thread. Each POST is recorded, then answered by
    `answer(request_number) -> (status, json body)`, after `delay_s` (a server that hangs)."""

    def __init__(self, answer: Any = None, delay_s: float = 0.0):
        import http.server
        import threading

        sink = self
        self.answer = answer or (lambda n: (200, {}))
        self.delay_s = delay_s
        self.received: list[Received] = []
        self.got = threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                sink.received.append(
                    Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                )
                sink.got.set()
                if sink.delay_s:
                    time.sleep(sink.delay_s)
                status, payload = sink.answer(len(sink.received))
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass  # the client gave up waiting

            def log_message(self, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> HttpSink:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
