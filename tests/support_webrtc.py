"""A WebRTC caller for the tests and the bench, built on aiortc's own client side.

It speaks as a browser would through WHIP (`POST /api/whip`, RFC 9725) or Pipecat's offer API:
its own RTCPeerConnection with one audio transceiver and a data channel, its audio encoded by
aiortc's Opus encoder (PyAV's libopus at 48 kHz, not the server's encoder), the agent's audio
read back from aiortc's receiver. Nothing here shares code with the server's WebRTC package.

`LossyRelay` is the network between them when a test wants loss: a UDP relay on 127.0.0.1
that forwards every datagram both ways and drops RTP media packets (only those: STUN, DTLS,
SCTP and RTCP pass) with a seeded random choice. The caller is pointed at it by rewriting the
server's candidates in the answer it received (`via_relay`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fractions
import json
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any

import av
import numpy as np
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

SR = 24000


def to_48k(pcm: np.ndarray) -> np.ndarray:
    from scipy.signal import resample_poly

    return resample_poly(np.asarray(pcm, np.float64), 2, 1).astype(np.float32)


def to_24k(pcm: np.ndarray) -> np.ndarray:
    from scipy.signal import resample_poly

    return resample_poly(np.asarray(pcm, np.float64), 1, 2).astype(np.float32)


class SpeakerTrack(MediaStreamTrack):
    """An aiortc audio track that plays `pcm` (24 kHz) in 20 ms frames, paced in real time from
    its first `recv()`, then silence. `start` (an asyncio.Event) holds the audio back (silence
    is sent meanwhile) until it is set."""

    kind = "audio"

    def __init__(self, pcm: np.ndarray, start: asyncio.Event | None = None) -> None:
        super().__init__()
        self.samples = to_48k(pcm)
        self.start = start
        self.sent = 0  # of `samples`
        self.sent_at: float | None = None  # monotonic time the speech began
        self.pts = 0
        self.t0: float | None = None

    async def recv(self) -> av.AudioFrame:
        if self.t0 is None:
            self.t0 = time.monotonic()
        await asyncio.sleep(max(0.0, self.t0 + self.pts / 48000 - time.monotonic()))
        chunk = np.zeros(960, np.float32)
        if self.start is None or self.start.is_set():
            piece = self.samples[self.sent : self.sent + 960]
            if len(piece) and self.sent_at is None:
                self.sent_at = time.monotonic()
            chunk[: len(piece)] = piece
            self.sent += len(piece)
        pcm16 = (np.clip(chunk, -1, 1) * 32767).astype(np.int16).reshape(1, -1)
        frame = av.AudioFrame.from_ndarray(pcm16, format="s16", layout="mono")
        frame.sample_rate = 48000
        frame.pts = self.pts
        frame.time_base = fractions.Fraction(1, 48000)
        self.pts += 960
        return frame


@dataclass
class CallResult:
    status: int = 0
    answer_headers: dict[str, str] = field(default_factory=dict)
    body: str = ""
    metadata: list[dict] = field(default_factory=list)
    handshake_at: float | None = None
    text: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    received: list[tuple[float, np.ndarray]] = field(default_factory=list)  # (arrival, 24 kHz)
    speech_started_at: float | None = None
    rtvi: list[dict] = field(default_factory=list)  # Pipecat: every message, in order
    delete_status: int | None = None

    @property
    def pcm(self) -> np.ndarray:
        parts = [p for _, p in self.received]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def _read_chat_kind(message: Any, result: CallResult) -> None:
    if not isinstance(message, bytes) or not message:
        return
    kind, payload = message[0], message[1:]
    if kind == 0x04:
        result.metadata.append(json.loads(payload))
    elif kind == 0x00:
        result.handshake_at = time.monotonic()
    elif kind == 0x02:
        result.text.append(payload.decode())
    elif kind == 0x05:
        result.errors.append(payload.decode())


async def receive_audio(track: Any, result: CallResult, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            frame = await track.recv()
        except MediaStreamError:
            return
        samples = frame.to_ndarray().astype(np.float32).reshape(-1) / 32768.0
        if frame.layout.name == "stereo":
            samples = samples.reshape(-1, 2).mean(axis=1)
        result.received.append((time.monotonic(), to_24k(samples)))


class LossyRelay(asyncio.DatagramProtocol):
    """See the module docstring. `loss` in [0, 1); `seed` fixes which packets drop."""

    def __init__(self, target: tuple[str, int], loss: float, seed: int = 1) -> None:
        self.target = target
        self.loss = loss
        self.random = random.Random(seed)
        self.client: tuple[str, int] | None = None
        self.transport: Any = None
        self.cut = False  # nothing passes, either way
        self.dropped = {"to_server": 0, "to_client": 0}
        self.forwarded = {"to_server": 0, "to_client": 0}

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if self.cut:
            return
        to_server = addr != self.target
        if to_server:
            self.client = addr
        destination = self.target if to_server else self.client
        if destination is None:
            return
        direction = "to_server" if to_server else "to_client"
        # RTP or RTCP by RFC 7983 (first byte 128-191); RTCP by RFC 5761 (packet type 192-223).
        is_media = 128 <= data[0] <= 191 and len(data) > 1 and not 192 <= data[1] <= 223
        if is_media and self.random.random() < self.loss:
            self.dropped[direction] += 1
            return
        self.forwarded[direction] += 1
        self.transport.sendto(data, destination)

    @property
    def port(self) -> int:
        return self.transport.get_extra_info("sockname")[1]


async def start_relay(target: tuple[str, int], loss: float, seed: int = 1) -> LossyRelay:
    """A relay on the target's own address (this host), forwarding to it."""
    loop = asyncio.get_running_loop()
    _, relay = await loop.create_datagram_endpoint(
        lambda: LossyRelay(target, loss, seed), local_addr=(target[0], 0)
    )
    return relay


_CANDIDATE = re.compile(r"^a=candidate:(\S+) (\d) (\w+) (\d+) (\S+) (\d+) typ host.*$")


def host_candidate(answer: str) -> tuple[str, int]:
    """The server's first IPv4 UDP host candidate (aioice leaves out loopback addresses)."""
    for line in answer.splitlines():
        m = _CANDIDATE.match(line.strip())
        if m and m.group(3).lower() == "udp" and ":" not in m.group(5):
            return m.group(5), int(m.group(6))
    raise AssertionError(f"no IPv4 UDP host candidate in the answer:\n{answer}")


def via_relay(answer: str, relay: LossyRelay) -> str:
    """The answer with one candidate left: the relay's."""
    host, port = relay.transport.get_extra_info("sockname")[:2]
    target = f" {relay.target[0]} {relay.target[1]} "
    out = []
    for line in answer.replace("\r\n", "\n").split("\n"):
        if line.startswith("a=candidate:"):
            if target in line:
                out.append(line.replace(target, f" {host} {port} "))
            continue
        out.append(line)
    return "\r\n".join(out)


class WebRTCCaller:
    """One call from a WHIP client (`endpoint="whip"`: /api/chat kinds on its data channel) or
    from Pipecat's small-WebRTC client (`endpoint="pipecat"`: `POST /api/offer` with
    `{sdp, type, pc_id, restart_pc, requestData}`, a data channel named "chat" carrying
    `ping: <ms>` every second, `client-ready`, and RTVI messages back, as
    pipecat-ai/pipecat-client-web-transports transports/small-webrtc-transport/src/
    smallWebRTCTransport.ts does)."""

    def __init__(
        self,
        base_url: str,
        speech: np.ndarray | None = None,
        *,
        endpoint: str = "whip",
        query: dict[str, str] | None = None,
        request_data: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        loss: float = 0.0,
        seed: int = 1,
        offer_path: str | None = None,
    ) -> None:
        self.base_url = base_url
        self.endpoint = endpoint
        self.query = query or {}
        self.request_data = request_data
        self.headers = headers or {}
        self.loss, self.seed = loss, seed
        self.offer_path = offer_path or ("/api/whip" if endpoint == "whip" else "/api/offer")
        self.result = CallResult()
        self.speech = np.zeros(0, np.float32) if speech is None else speech
        self.start = asyncio.Event()
        self.handshake = asyncio.Event()
        self.stop = asyncio.Event()
        self.relay: LossyRelay | None = None
        self.want_relay = False
        self.location: str | None = None
        self.pc_id: str | None = None
        self.pc: Any = None
        self.channel: Any = None
        self.speaker: SpeakerTrack | None = None
        self._tasks: list[asyncio.Task] = []

    def _new_peer(self) -> Any:
        from aiortc import RTCPeerConnection

        pc = RTCPeerConnection()
        self.speaker = SpeakerTrack(self.speech, self.start)
        pc.addTransceiver(self.speaker, direction="sendrecv")
        if self.endpoint == "pipecat":
            pc.addTransceiver("video", direction="sendrecv")  # the JS client always offers one
        self.channel = pc.createDataChannel("chat" if self.endpoint == "pipecat" else "personaplex")
        self.channel.on("message", self._on_message)
        self.channel.on("open", self._on_open)

        @pc.on("track")
        def on_track(track: Any) -> None:
            if track.kind == "audio":
                self._tasks.append(asyncio.create_task(receive_audio(track, self.result, self.stop)))

        return pc

    def _on_open(self) -> None:
        if self.endpoint != "pipecat":
            return
        self.channel.send(
            json.dumps({"id": "ready-1", "label": "rtvi-ai", "type": "client-ready", "data": {}})
        )

        async def keepalive() -> None:
            while self.channel.readyState == "open":
                self.channel.send(f"ping: {int(time.time() * 1000)}")
                await asyncio.sleep(1.0)

        self._tasks.append(asyncio.create_task(keepalive()))

    def _on_message(self, message: Any) -> None:
        result = self.result
        if self.endpoint == "whip":
            _read_chat_kind(message, result)
        else:
            data = json.loads(message)
            result.rtvi.append(data)
            kind = data.get("type")
            if kind == "bot-ready" and result.handshake_at is None:
                result.handshake_at = time.monotonic()
            elif kind == "bot-transcription":
                result.text.append(data["data"]["text"])
            elif kind == "server-message":
                result.metadata.append(data["data"]["metadata"])
            elif kind == "error":
                result.errors.append(data["data"]["message"])
        if result.handshake_at is not None or result.errors:
            self.handshake.set()

    async def _exchange(self, http: Any, restart: bool = False) -> bool:
        from aiortc import RTCSessionDescription

        await self.pc.setLocalDescription(await self.pc.createOffer())
        sdp = self.pc.localDescription.sdp
        if self.endpoint == "whip":
            response = await http.post(
                self.offer_path,
                params=self.query,
                content=sdp,
                headers={"content-type": "application/sdp", **self.headers},
            )
            ok = response.status_code == 201
            answer = response.text
            self.location = response.headers.get("location")
        else:
            payload: dict[str, Any] = {
                "sdp": sdp,
                "type": "offer",
                "pc_id": self.pc_id,
                "restart_pc": restart,
            }
            if self.request_data is not None:
                payload["requestData"] = self.request_data
            response = await http.post(self.offer_path, params=self.query, json=payload, headers=self.headers)
            ok = response.status_code == 200
            answer = response.json().get("sdp", "") if ok else ""
            if ok:
                self.pc_id = response.json()["pc_id"]
        self.result.status = response.status_code
        self.result.answer_headers = dict(response.headers)
        self.result.body = response.text
        if not ok:
            return False
        if self.loss > 0 or self.want_relay:
            if self.relay is not None:
                self.relay.transport.close()
            self.relay = await start_relay(host_candidate(answer), self.loss, self.seed)
            answer = via_relay(answer, self.relay)
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=answer, type="answer"))
        return True

    async def connect(self, handshake_timeout: float = 60.0, relay: bool = False) -> CallResult:
        """Offer, answer, and wait for the handshake (or an error). `relay`: through a
        LossyRelay even without loss (a test can then cut the network)."""
        import httpx

        self.pc = self._new_peer()
        async with httpx.AsyncClient(base_url=self.base_url, timeout=30) as http:
            self.want_relay = relay
            if not await self._exchange(http):
                await self.pc.close()
                return self.result
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.handshake.wait(), handshake_timeout)
        return self.result

    async def restart(self, handshake_timeout: float = 30.0) -> CallResult:
        """Pipecat's reconnection: a new peer connection, the same pc_id, `restart_pc: true`."""
        import httpx

        old = self.pc
        self.stop.set()
        self.stop = asyncio.Event()
        self.handshake = asyncio.Event()
        self.pc = self._new_peer()
        async with httpx.AsyncClient(base_url=self.base_url, timeout=30) as http:
            await self._exchange(http, restart=True)
        await old.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wait_open(), handshake_timeout)
        return self.result

    async def _wait_open(self) -> None:
        while self.channel.readyState != "open":
            await asyncio.sleep(0.02)

    async def speak(self, tail_s: float = 1.5) -> None:
        """The speech, then `tail_s` of silence."""
        self.start.set()
        await asyncio.sleep(len(self.speech) / SR + tail_s)
        self.result.speech_started_at = self.speaker.sent_at if self.speaker else None

    async def hang_up(self, how: str = "delete") -> None:
        """`delete` (WHIP DELETE, then close), `close` (the peer connection only: a DTLS close),
        `disconnect-bot` (Pipecat's RTVI message, then close), or `cut` (the network goes
        silent both ways and nothing is closed: a vanished peer)."""
        import httpx

        if how == "cut":
            assert self.relay is not None, "connect(relay=True) first"
            self.relay.loss = 1.0
            self.relay.cut = True
            return
        if how == "delete" and self.location:
            async with httpx.AsyncClient(base_url=self.base_url, timeout=30) as http:
                response = await http.delete(self.location, headers=self.headers)
                self.result.delete_status = response.status_code
        if how == "disconnect-bot":
            self.channel.send(
                json.dumps({"id": "bye", "label": "rtvi-ai", "type": "disconnect-bot", "data": {}})
            )
            await asyncio.sleep(0.3)
        await self.close()

    async def close(self) -> None:
        self.stop.set()
        if self.pc is not None:
            await self.pc.close()
        for task in self._tasks:
            task.cancel()
        if self.relay is not None and self.relay.transport is not None:
            self.relay.transport.close()


async def whip_call(
    base_url: str, query: dict[str, str], speech: np.ndarray, *, tail_s: float = 1.5, **options: Any
) -> CallResult:
    """A whole WHIP call: connect, speak, hang up with DELETE."""
    caller = WebRTCCaller(base_url, speech, query=query, **options)
    result = await caller.connect()
    if result.handshake_at is not None and not result.errors:
        await caller.speak(tail_s)
        await caller.hang_up("delete")
    else:
        await caller.close()
    return result
