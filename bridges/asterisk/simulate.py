"""An Asterisk to call the server with, written from Asterisk's published protocols: for
`personaplex-voice phone simulate --carrier asterisk --audiosocket HOST:PORT` (`simulate_call`),
`python -m personaplex_asterisk.simulate` (every knob), the tests and `bench/phone_load.py`.

It does what a dialplan and Asterisk do for one call:

1. `POST /asterisk/calls` with the API key (what `CURL()` does; JSON or a form), for a UUID;
2. the media leg, either
   - **AudioSocket** (`AudioSocketCall`): a TCP connection to the listener, the UUID message,
     then the caller's audio in 20 ms messages of the kind for its rate (8 kHz `0x10`; 16 kHz
     `0x12`, or `0x11` in the first numbering), DTMF (`0x03`), hang-up (`0x00`) or an error
     (`0xff`). What comes back is played the moment it arrives (Asterisk has no jitter buffer);
   - **chan_websocket** (`MediaWebSocketCall`): a WebSocket to `/asterisk/media?ticket=UUID`
     (or `/asterisk/media/UUID`) offering the `media` subprotocol, `MEDIA_START` in plain text
     or JSON, the caller's audio as BINARY frames, `DTMF_END`. What comes back goes into a frame
     queue played one frame every 20 ms (silence when empty), as chan_websocket does:
     `MARK_MEDIA` is answered with `MEDIA_MARK_PROCESSED` when it reaches the queue's front,
     `FLUSH_MEDIA` empties the queue (marks included), `HANGUP` ends the call; `xoff()`/`xon()`
     send `MEDIA_XOFF`/`MEDIA_XON` as a full queue would;
3. `GET /asterisk/calls/{uuid}/next`, what the dialplan does after the leg.

Both kinds of call keep what the caller heard on the call's timeline (`heard_audio`): sample 0
is when the caller's first audio was sent. Network I/O is aiohttp's (the phone extra), so the
command works wherever the server does.

Sources: docs.asterisk.org ("AudioSocket"; "WebSocket channel driver") and the AudioSocket
protocol's README (github.com/CyCoreSystems/audiosocket); both protocols through sim_wire.py,
written from them, never through the bridge's audiosocket.py or media_ws.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import secrets
import time
import uuid as uuidlib
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
from personaplex_phone.simulator import say_with_keys
from personaplex_phone.urls import websocket_base

from personaplex_voice.audio.mulaw import ulaw_decode, ulaw_encode
from personaplex_voice.audio.telephony import alaw_decode, alaw_encode, l16_decode, l16_encode

from . import sim_wire as wire

CHUNK_S = 0.020
_CALLS = itertools.count(1)
KIND_FOR_RATE = {rate: kind for kind, rate in wire.RATE_KINDS.items()}


def encode_pcm(pcm: np.ndarray, codec: str) -> bytes:
    if codec == "pcmu":
        return ulaw_encode(pcm)
    if codec == "pcma":
        return alaw_encode(pcm)
    return l16_encode(pcm, big_endian=False)


def decode_pcm(data: bytes, codec: str) -> np.ndarray:
    if codec == "pcmu":
        return ulaw_decode(data)
    if codec == "pcma":
        return alaw_decode(data)
    return l16_decode(data[: len(data) - len(data) % 2], big_endian=False)


@dataclass
class SimCall:
    """What both kinds of call share: pacing the caller's audio, the timeline of what was heard."""

    rate: int
    codec: str = "l16"
    t0: float = 0.0  # monotonic time of the caller's first audio (the timeline's origin)
    sent_chunks: int = 0
    heard: list[tuple[float, np.ndarray]] = field(default_factory=list)
    received_bytes: int = 0
    received_messages: int = 0
    arrivals: list[float] = field(default_factory=list)  # when each audio message of ours came
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    hung_up_by_server: bool = False

    @property
    def chunk_bytes(self) -> int:
        return self.rate * 20 // 1000 * (1 if self.codec in ("pcmu", "pcma") else 2)

    async def send_chunk(self, data: bytes) -> None:
        raise NotImplementedError

    async def play(self, pcm: np.ndarray | bytes) -> None:
        """The caller's audio (float samples at the call's rate, or encoded bytes) in 20 ms
        messages on an absolute real-time schedule."""
        data = encode_pcm(np.asarray(pcm, np.float32), self.codec) if isinstance(pcm, np.ndarray) else pcm
        size = self.chunk_bytes
        data += bytes(-len(data) % size)
        if not self.t0:
            self.t0 = time.monotonic()
        for i in range(0, len(data), size):
            due = self.t0 + self.sent_chunks * CHUNK_S
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if self.closed.is_set():
                return
            await self.send_chunk(data[i : i + size])
            self.sent_chunks += 1

    async def answered(self, timeout: float = 15.0) -> int:
        """Silence on the line (Asterisk sends the channel's audio all along) until the agent's
        audio comes back. Returns the samples sent meanwhile."""
        deadline = time.monotonic() + timeout
        silence = bytes(self.chunk_bytes) if self.codec == "l16" else encode_pcm(np.zeros(160), self.codec)
        while not self.received_messages and not self.closed.is_set():
            if time.monotonic() > deadline:
                raise TimeoutError("no audio from the agent")
            await self.play(silence)
        return self.sent_chunks * self.rate // 50

    def _heard(self, at: float, payload: bytes) -> None:
        self.heard.append((at, decode_pcm(payload, self.codec)))

    def heard_audio(self) -> np.ndarray:
        """What the caller heard, float32 at the call's rate; sample 0 = the caller's first audio."""
        if not self.heard:
            return np.zeros(0, np.float32)
        origin = self.t0 or self.heard[0][0]
        last_at, last = self.heard[-1]
        out = np.zeros(max(0, round((last_at - origin) * self.rate)) + len(last) + 1, np.float32)
        for at, pcm in self.heard:
            pos = round((at - origin) * self.rate)
            if 0 <= pos < len(out):
                out[pos : pos + len(pcm)] = pcm[: len(out) - pos]
        return out


# --- AudioSocket ---------------------------------------------------------------------------------


@dataclass
class AudioSocketCall(SimCall):
    reader: asyncio.StreamReader | None = None
    writer: asyncio.StreamWriter | None = None
    kind: int = wire.KIND_SLIN
    received_kinds: set[int] = field(default_factory=set)
    late: int = 0  # messages of ours that came after the last one had finished playing (a gap heard)
    late_after: float = 0.0  # count only those after this monotonic time (a call's start is priming)
    _play_end: float = 0.0

    async def _write(self, data: bytes) -> None:
        assert self.writer is not None
        if self.writer.is_closing():
            self.closed.set()
            return
        try:
            self.writer.write(data)
            await self.writer.drain()
        except ConnectionError:
            self.closed.set()

    async def send_chunk(self, data: bytes) -> None:
        await self._write(wire.frame(self.kind, data))

    async def dtmf(self, digit: str) -> None:
        await self._write(wire.frame(wire.KIND_DTMF, digit.encode("ascii")))

    async def send_error(self, code: int = 0x01) -> None:
        await self._write(wire.frame(wire.KIND_ERROR, bytes([code])))

    async def hangup(self) -> None:
        """Asterisk's end of the call: the hang-up message, then the socket closes."""
        await self._write(wire.HANGUP)
        self.close()

    def close(self) -> None:
        if self.writer is not None and not self.writer.is_closing():
            self.writer.close()

    async def receive_loop(self) -> None:
        assert self.reader is not None
        try:
            while True:
                kind, length = wire.HEADER.unpack(await self.reader.readexactly(wire.HEADER.size))
                payload = await self.reader.readexactly(length) if length else b""
                self.received_kinds.add(kind)
                if kind == wire.KIND_HANGUP:
                    self.hung_up_by_server = True
                    break
                if wire.is_audio(kind):
                    now = time.monotonic()
                    self.arrivals.append(now)
                    self.received_messages += 1
                    self.received_bytes += len(payload)
                    # Asterisk writes each message to the channel as it comes: played back to back.
                    if self._play_end and now > self._play_end + 1e-3 and now > self.late_after:
                        self.late += 1
                    at = max(now, self._play_end)
                    self._play_end = at + len(payload) / 2 / self.rate
                    self._heard(at, payload)
        except (asyncio.IncompleteReadError, ConnectionError, wire.FrameError):
            pass
        finally:
            self.closed.set()
            self.close()


# --- chan_websocket ------------------------------------------------------------------------------


@dataclass
class MediaWebSocketCall(SimCall):
    ws: aiohttp.ClientWebSocketResponse | None = None
    control: str = wire.PLAIN
    format_name: str = "slin16"
    channel_id: str = ""
    queue: deque[bytes | str] = field(default_factory=deque)  # frames, and mark ids (str)
    queued_frames: int = 0
    max_queued_frames: int = 0
    commands: list[tuple[str, str]] = field(default_factory=list)  # (name, correlation id) as read
    marks_processed: list[str] = field(default_factory=list)
    flushes: int = 0
    media_after_xoff: int = 0  # binary messages that came while we said XOFF
    late: int = 0  # ticks that found the queue empty once our audio had begun (a gap heard)
    late_after: float = 0.0  # count only those after this monotonic time (a call's start is priming)
    xoff_sent: bool = False
    close_code: int | None = None
    _leftover: bytes = b""

    @property
    def frame_bytes(self) -> int:
        return self.chunk_bytes

    async def _send_text(self, text: str) -> None:
        assert self.ws is not None
        if self.ws.closed:
            self.closed.set()
            return
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self.ws.send_str(text)

    async def send_chunk(self, data: bytes) -> None:
        assert self.ws is not None
        if self.ws.closed:
            self.closed.set()
            return
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self.ws.send_bytes(data)

    async def event(self, name: str, **fields: Any) -> None:
        await self._send_text(wire.event(name, self.control, **fields))

    async def media_start(self, connection_id: str) -> None:
        await self.event(
            "MEDIA_START",
            connection_id=connection_id,
            channel=f"WebSocket/{connection_id}/0x1",
            channel_id=self.channel_id,
            format=self.format_name,
            optimal_frame_size=self.frame_bytes,
            ptime=20,
            **({"channel_variables": {"SIMULATED": "1"}} if self.control == wire.JSON else {}),
        )

    async def dtmf(self, digit: str) -> None:
        await self.event("DTMF_END", digit=digit, channel_id=self.channel_id)

    async def xoff(self) -> None:
        self.xoff_sent = True
        await self.event("MEDIA_XOFF", channel_id=self.channel_id)

    async def xon(self) -> None:
        self.xoff_sent = False
        await self.event("MEDIA_XON", channel_id=self.channel_id)

    async def hangup(self) -> None:
        """Asterisk's end of the call: the channel hangs up and the WebSocket closes."""
        if self.ws is not None and not self.ws.closed:
            await self.ws.close()
        self.closed.set()

    def _on_command(self, text: str) -> None:
        try:
            name, ident = wire.read_command(text, self.control)
        except ValueError:
            name, ident = "(unreadable)", text[:40]
        self.commands.append((name, ident))
        if name == "MARK_MEDIA":
            self.queue.append(ident)
        elif name == "FLUSH_MEDIA":
            self.flushes += 1
            self.queue.clear()  # marks too: their MEDIA_MARK_PROCESSED never comes
            self.queued_frames = 0
            self._leftover = b""
        elif name == "HANGUP":
            self.hung_up_by_server = True

    def _on_media(self, data: bytes) -> None:
        self.arrivals.append(time.monotonic())
        self.received_messages += 1
        self.received_bytes += len(data)
        if self.xoff_sent:
            self.media_after_xoff += 1
        size = self.frame_bytes
        for i in range(0, len(data) - len(data) % size, size):  # an odd remainder is dropped
            self.queue.append(data[i : i + size])
            self.queued_frames += 1
        self.max_queued_frames = max(self.max_queued_frames, self.queued_frames)

    async def play_loop(self) -> None:
        """chan_websocket's timer: one frame of the queue every 20 ms, marks answered on the way."""
        start = time.monotonic()
        tick = 0
        while not self.closed.is_set():
            tick += 1
            delay = start + tick * CHUNK_S - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            while self.queue and isinstance(self.queue[0], str):
                ident = self.queue.popleft()
                self.marks_processed.append(ident)  # type: ignore[arg-type]
                await self.event("MEDIA_MARK_PROCESSED", channel_id=self.channel_id, correlation_id=ident)
            if self.queue:
                frame = self.queue.popleft()
                self.queued_frames -= 1
                # Played in its 20 ms slot of the channel's clock, back to back with the last.
                self._heard(start + tick * CHUNK_S, frame)  # type: ignore[arg-type]
            elif self.received_messages and time.monotonic() > self.late_after:
                self.late += 1

    async def receive_loop(self) -> None:
        assert self.ws is not None
        try:
            async for message in self.ws:
                if message.type == aiohttp.WSMsgType.TEXT:
                    self._on_command(message.data)
                    if self.hung_up_by_server:
                        await self.ws.close()
                        break
                elif message.type == aiohttp.WSMsgType.BINARY:
                    self._on_media(message.data)
                else:
                    break
        except (ConnectionError, RuntimeError):
            pass
        finally:
            self.close_code = self.ws.close_code
            self.closed.set()


# --- the dialplan's side --------------------------------------------------------------------------


class AsteriskSimulator:
    """An Asterisk whose dialplan sends its calls to the server at `base_url`."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        audiosocket: tuple[str, int] | None = None,
        session: aiohttp.ClientSession | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.audiosocket = audiosocket
        self._session = session
        self._own_session = session is None

    async def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        return self._session

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    def _auth(self, api_key: str | None) -> dict[str, str]:
        key = self.api_key if api_key is None else api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def ask(
        self,
        *,
        persona: str | None = None,
        variables: Mapping[str, str] | None = None,
        from_: str = "+15550100002",
        to: str = "100",
        call_id: str | None = None,
        form: bool = False,
        api_key: str | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """The dialplan's `POST /asterisk/calls`; (status, the JSON answer)."""
        call_id = (
            call_id or f"{time.time():.0f}.{next(_CALLS)}{secrets.randbelow(10**6):06d}"
        )  # like Asterisk's ${UNIQUEID}
        body: dict[str, Any] = {"from": from_, "to": to, "call_id": call_id}
        if persona:
            body["persona"] = persona
        session = await self.session()
        headers = self._auth(api_key)
        if form:  # CURL()'s default: application/x-www-form-urlencoded, variables as fields
            data: Any = {**body, **dict(variables or {})}
            request = session.post(self.base_url + "/asterisk/calls", data=data, headers=headers)
        else:
            if variables:
                body["variables"] = dict(variables)
            request = session.post(self.base_url + "/asterisk/calls", json=body, headers=headers)
        async with request as response:
            text = await response.text()
            try:
                return response.status, json.loads(text)
            except ValueError:
                return response.status, {"text": text}

    async def next_step(self, key: str, api_key: str | None = None) -> tuple[int, dict[str, Any]]:
        session = await self.session()
        url = f"{self.base_url}/asterisk/calls/{key}/next"
        async with session.get(url, headers=self._auth(api_key)) as response:
            return response.status, json.loads(await response.text())

    @contextlib.asynccontextmanager
    async def audiosocket_call(
        self, call_uuid: str, rate: int = 8000, numbering: str = "asterisk"
    ) -> AsyncIterator[AudioSocketCall]:
        """`AudioSocket(uuid,host:port)` (8 kHz) or `Dial(AudioSocket/host:port/uuid/c(slinNN))`;
        `numbering="first"` sends 16 kHz as kind 0x11, the first proposal's numbering."""
        if self.audiosocket is None:
            raise ValueError("this simulator has no AudioSocket address")
        kind = 0x11 if numbering == "first" and rate == 16000 else KIND_FOR_RATE[rate]
        reader, writer = await asyncio.open_connection(*self.audiosocket)
        call = AudioSocketCall(rate=rate, reader=reader, writer=writer, kind=kind)
        receiver = asyncio.create_task(call.receive_loop())
        try:
            await call._write(wire.uuid_frame(call_uuid))
            yield call
        finally:
            call.close()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(call.closed.wait(), 5.0)
            receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await receiver

    @contextlib.asynccontextmanager
    async def websocket_call(
        self,
        ticket: str,
        fmt: str = "slin16",
        control: str = wire.PLAIN,
        in_path: bool = False,
        subprotocol: bool = True,
        send_start: bool = True,
    ) -> AsyncIterator[MediaWebSocketCall]:
        """`Dial(WebSocket/<client>/c(slin16)v(ticket=UUID))` with the client's URI pointing at
        `/asterisk/media`; `in_path` puts the ticket in the path instead."""
        codec, rate = wire.FORMATS[fmt]
        where = "/asterisk/media/" + ticket if in_path else "/asterisk/media?ticket=" + ticket
        session = await self.session()
        protocols = (wire.SUBPROTOCOL,) if subprotocol else ()
        ws = await session.ws_connect(websocket_base(self.base_url) + where, protocols=protocols)
        call = MediaWebSocketCall(
            rate=rate,
            codec=codec,
            ws=ws,
            control=control,
            format_name=fmt,
            channel_id=f"{time.time():.6f}",
        )
        receiver = asyncio.create_task(call.receive_loop())
        player = asyncio.create_task(call.play_loop())
        try:
            if send_start:
                await call.media_start(str(uuidlib.uuid4()))
            yield call
        finally:
            await call.hangup()
            for task in (receiver, player):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task


# --- one whole call, as `phone simulate` runs it ------------------------------------------------------


async def simulate_call(
    url: str,
    api_key: str,
    pcm_24k: np.ndarray,
    *,
    mode: str = "websocket",
    audiosocket: tuple[str, int] | None = None,
    rate: int = 16000,
    numbering: str = "asterisk",
    control: str = wire.PLAIN,
    digits: list[tuple[float, str]] | None = None,
    persona: str | None = None,
    to: str = "100",
    from_: str = "+15550100002",
) -> tuple[dict[str, Any], np.ndarray, int]:
    """A call from an Asterisk to the server at `url`: the dialplan's request, the media leg
    (`mode` audiosocket or websocket) saying `pcm_24k` at real time with DTMF keys at their times
    ((seconds into it, key)), then the dialplan's next step. Returns (summary, heard, its rate)."""
    from personaplex_voice.audio.resample import resample

    sim = AsteriskSimulator(url, api_key, audiosocket)
    started = time.monotonic()
    try:
        status, answer = await sim.ask(persona=persona, to=to, from_=from_)
        if status != 200 or not answer.get("uuid"):
            raise RuntimeError(f"no call ({status}): {answer}")
        if mode == "audiosocket":
            opened: Any = sim.audiosocket_call(answer["uuid"], rate=rate, numbering=numbering)
        else:
            fmt = {8000: "slin", 16000: "slin16", 24000: "slin24"}.get(rate, "slin16")
            opened = sim.websocket_call(answer["uuid"], fmt, control)
        async with opened as call:
            line = resample(np.asarray(pcm_24k, np.float32), 24000, call.rate)
            waited = await call.answered(timeout=30)
            answered_s = time.monotonic() - started
            await say_with_keys(call, line, call.rate, sorted(digits or []))
            ended_by_server = call.closed.is_set()
        await asyncio.sleep(0.2)  # the server closes its side of the call
        _, step = await sim.next_step(answer["uuid"])
    finally:
        await sim.close()
    heard = call.heard_audio()
    summary: dict[str, Any] = {
        "carrier": "asterisk",
        "mode": mode,
        "call_id": answer["call_id"],
        "uuid": answer["uuid"],
        "persona": answer.get("persona", ""),
        "audio": f"L16 {call.rate / 1000:g} kHz" if call.codec == "l16" else call.codec,
        "answered_after_s": round(answered_s, 3),
        "silence_before_agent_s": round(waited / call.rate, 3),
        "said_s": round(len(line) / call.rate, 3),
        "heard_s": round(len(heard) / call.rate, 3),
        "messages_heard": call.received_messages,
        "dtmf": "".join(key for _, key in sorted(digits or [])),
        "ended_by": "server" if ended_by_server else "caller",
        "next_step": step,
    }
    if isinstance(call, MediaWebSocketCall):
        summary.update(
            control=control,
            subprotocol=call.ws.protocol if call.ws is not None else None,
            marks_processed=len(call.marks_processed),
            flushes=call.flushes,
        )
    else:
        summary.update(kind=f"0x{call.kind:02x}")
    return summary, heard, call.rate


def main(argv: list[str] | None = None) -> None:
    """`python -m personaplex_asterisk.simulate --url … --wav …`: one simulated Asterisk call."""
    import argparse
    import os
    from pathlib import Path

    from personaplex_phone.cli import parse_digits

    from personaplex_voice.audio.io import read_audio, write_wav
    from personaplex_voice.errors import UserError

    from .config import parse_listen

    parser = argparse.ArgumentParser(description="Call the server as an Asterisk would (prints JSON).")
    parser.add_argument(
        "--url", required=True, help="where the server is reached, e.g. http://127.0.0.1:8998"
    )
    parser.add_argument("--wav", required=True, type=Path, help="what the caller says")
    parser.add_argument("--mode", choices=("audiosocket", "websocket"), default="websocket")
    parser.add_argument("--audiosocket", help="the server's AudioSocket listener, HOST:PORT")
    parser.add_argument("--rate", type=int, default=16000, choices=(8000, 16000, 24000))
    parser.add_argument("--numbering", choices=("asterisk", "first"), default="asterisk")
    parser.add_argument("--control", choices=(wire.PLAIN, wire.JSON), default=wire.PLAIN)
    parser.add_argument("--dtmf", action="append", default=[], help="KEY@SECONDS into the WAV")
    parser.add_argument("--persona")
    parser.add_argument("--api-key", default=os.environ.get("PERSONAPLEX_PHONE_API_TOKEN", ""))
    parser.add_argument("--out", type=Path, help="save what the caller heard (WAV)")
    args = parser.parse_args(argv)
    if args.mode == "audiosocket" and not args.audiosocket:
        parser.error("--mode audiosocket needs --audiosocket HOST:PORT")
    try:
        digits = parse_digits(args.dtmf)
    except UserError as exc:
        parser.error(str(exc))
    summary, heard, rate = asyncio.run(
        simulate_call(
            args.url,
            args.api_key,
            read_audio(args.wav),
            mode=args.mode,
            audiosocket=parse_listen(args.audiosocket) if args.audiosocket else None,
            rate=args.rate,
            numbering=args.numbering,
            control=args.control,
            digits=digits,
            persona=args.persona,
        )
    )
    if args.out is not None:
        write_wav(args.out, heard, rate, subtype="PCM_16")
        summary["heard_wav"] = str(args.out)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
