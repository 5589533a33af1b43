"""`eval --url`: the same scripted calls against a deployed server's `/api/chat`, in real time.

One WebSocket per call, the project's own protocol (`server.protocol`) and Ogg-Opus codec
(`audio.opus`). The caller's frame k is sent when it has been "spoken", at 80(k+1) ms after the
handshake, so the server hears it as a live microphone. The agent is heard as it arrives: each
decoded piece plays from its arrival time (or right after the previous piece, if that is still
playing), so everything on the way — network both ways, queueing, the engine's step, Opus —
shows in the measures, as a caller would experience it. Agent text is placed at its arrival.
The scenario's line codec is applied on the client, around the Opus link. Action rules run on
the client (the server's `/api/chat` knows none).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from personaplex_voice.audio.opus import OggError, OggOpusReader, OggOpusWriter
from personaplex_voice.engine.base import FRAME_SIZE, SAMPLE_RATE
from personaplex_voice.server import protocol
from personaplex_voice.server.protocol import ChatParams, Kind

from .call import FRAME_S, CallDriver, CallPlan, CallTrace
from .speech import ClipBook

HANDSHAKE_TIMEOUT_S = 120.0  # the server may queue the call before its prompt goes in
OPEN_TIMEOUT_S = 15.0
MAX_URL_BYTES = 6000  # longer prompts go by POST /api/prompts (as the Pipecat remote does)


class CallFailed(Exception):
    pass


async def run_remote(
    url: str,
    plans: Sequence[CallPlan],
    clips: ClipBook,
    *,
    api_key: str | None = None,
    concurrency: int = 4,
    on_frame: Callable[[], None] = lambda: None,
    on_call: Callable[[CallTrace], Awaitable[None]] | None = None,
) -> tuple[list[CallTrace], dict[str, Any]]:
    """Every plan as a real-time call to `url` (ws://host:port/api/chat), `concurrency` at once."""
    limit = asyncio.Semaphore(max(1, concurrency))
    started = time.perf_counter()

    async def one(plan: CallPlan) -> CallTrace:
        async with limit:
            trace = await _call(url, plan, clips, api_key, on_frame)
        if on_call is not None:
            await on_call(trace)
        return trace

    traces = await asyncio.gather(*(one(plan) for plan in plans))
    wall = time.perf_counter() - started
    audio_s = sum(t.duration_s for t in traces)
    return list(traces), {
        "mode": "url",
        "url": url.split("?")[0],
        "concurrency": concurrency,
        "calls": len(traces),
        "audio_s": round(audio_s, 3),
        "wall_s": round(wall, 3),
        "x_realtime": round(audio_s / wall, 3) if wall > 0 else None,
    }


async def _call(
    url: str, plan: CallPlan, clips: ClipBook, api_key: str | None, on_frame: Callable[[], None]
) -> CallTrace:
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidHandshake, InvalidStatus, InvalidURI, WebSocketException

    driver = CallDriver(plan, clips)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        target = await _session_url(url, plan, api_key)
        async with connect(
            target,
            additional_headers=headers,
            open_timeout=OPEN_TIMEOUT_S,
            max_size=4 << 20,
            compression=None,
        ) as ws:
            await asyncio.wait_for(_handshake(ws), HANDSHAKE_TIMEOUT_S)
            return await _converse(ws, driver, on_frame)
    except InvalidStatus as exc:
        return driver.trace(error=f"{url} refused the connection (HTTP {exc.response.status_code})")
    except InvalidURI as exc:
        return driver.trace(error=f"bad server url {url}: {exc}")
    except TimeoutError:
        return driver.trace(error=f"{url} did not start the session within {HANDSHAKE_TIMEOUT_S:.0f} s")
    except (OSError, InvalidHandshake, WebSocketException, CallFailed) as exc:
        return driver.trace(error=str(exc) or type(exc).__name__)


async def _session_url(url: str, plan: CallPlan, api_key: str | None) -> str:
    params = ChatParams.from_persona(plan.persona)
    target = params.url(url)
    if len(target.encode()) <= MAX_URL_BYTES:
        return target
    prompt_id = await asyncio.to_thread(_store_prompt, url, plan.persona.text_prompt, api_key)
    return replace(params, text_prompt="").url(url, prompt_id=prompt_id)


def _store_prompt(url: str, text: str, api_key: str | None) -> str:
    parts = urlsplit(url)
    scheme = "https" if parts.scheme == "wss" else "http"
    endpoint = urlunsplit((scheme, parts.netloc, parts.path.rsplit("/", 1)[0] + "/prompts", "", ""))
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    body = json.dumps({"text_prompt": text}, ensure_ascii=False).encode("utf-8")
    request = urllib.request.Request(endpoint, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=OPEN_TIMEOUT_S) as response:
            return str(json.loads(response.read())["prompt_id"])
    except urllib.error.HTTPError as exc:
        raise CallFailed(f"{endpoint} refused the prompt (HTTP {exc.code})") from None
    except (OSError, ValueError, KeyError) as exc:
        raise CallFailed(f"cannot store the prompt at {endpoint}: {exc}") from None


async def _handshake(ws: Any) -> None:
    async for data in ws:
        message = protocol.decode(data) if isinstance(data, bytes) else None
        if message is None:
            continue
        if message.kind == Kind.HANDSHAKE:
            return
        if message.kind == Kind.ERROR:
            raise CallFailed(f"the server refused the call: {message.text()}")
    raise CallFailed("the server closed the connection before the session started")


class _Heard:
    """The agent's audio on the call's timeline (24 kHz), placed where the caller hears it."""

    def __init__(self) -> None:
        self.pcm = np.zeros(SAMPLE_RATE * 30, np.float32)
        self.played_to = 0  # samples: where the last piece stops playing
        self.pieces: list[tuple[float, str]] = []

    def audio(self, pcm: np.ndarray, now_s: float) -> None:
        at = max(round(now_s * SAMPLE_RATE), self.played_to)
        end = at + len(pcm)
        if end > len(self.pcm):
            self.pcm = np.concatenate(
                [self.pcm, np.zeros(max(end, 2 * len(self.pcm)) - len(self.pcm), np.float32)]
            )
        self.pcm[at:end] = pcm
        self.played_to = end

    def frame(self, k: int) -> tuple[np.ndarray, str | None]:
        lo, hi = k * FRAME_SIZE, (k + 1) * FRAME_SIZE
        pcm = self.pcm[lo:hi] if hi <= len(self.pcm) else np.zeros(FRAME_SIZE, np.float32)
        text = "".join(t for at, t in self.pieces if k * FRAME_S <= at < (k + 1) * FRAME_S)
        return pcm.copy(), (text or None)


async def _converse(ws: Any, driver: CallDriver, on_frame: Callable[[], None]) -> CallTrace:
    from websockets.exceptions import ConnectionClosed

    loop = asyncio.get_running_loop()
    writer = OggOpusWriter(SAMPLE_RATE, frame_ms=20)
    reader = OggOpusReader(SAMPLE_RATE)
    heard = _Heard()
    t0 = loop.time()
    lost: list[str] = []

    async def receive() -> None:
        try:
            async for data in ws:
                message = protocol.decode(data) if isinstance(data, bytes) else None
                if message is None:
                    continue
                now = loop.time() - t0
                if message.kind == Kind.AUDIO:
                    try:
                        for pcm in reader.feed(message.payload):
                            heard.audio(pcm, now)
                    except OggError as exc:
                        lost.append(f"bad audio from the server ({exc})")
                        return
                elif message.kind == Kind.TEXT:
                    heard.pieces.append((now, message.text()))
                elif message.kind == Kind.ERROR:
                    lost.append(f"the server ended the call: {message.text()}")
            lost.append("the server closed the connection")
        except ConnectionClosed as exc:
            lost.append(f"the connection was lost ({exc})")

    receiver = asyncio.create_task(receive())
    try:
        while True:
            now = loop.time() - t0
            while driver.frames_in < driver.frames_out and (driver.frames_in + 1) * FRAME_S <= now:
                pcm, text = heard.frame(driver.frames_in)
                driver.on_agent_frame(pcm, text)
                on_frame()
            if driver.output_done:
                break
            if lost and not driver.output_done:
                return driver.trace(error=lost[0])
            if not driver.input_done and (driver.frames_out + 1) * FRAME_S <= now + 1e-3:
                frame = driver.next_engine_frame()
                if frame is not None:
                    pages = writer.write(frame)
                    if pages:
                        await ws.send(protocol.encode_audio(pages))
                continue
            next_send = (driver.frames_out + 1) * FRAME_S
            next_take = (driver.frames_in + 1) * FRAME_S
            wake = min(next_send, next_take) if not driver.input_done else next_take
            await asyncio.sleep(max(0.0, wake - (loop.time() - t0)))
    finally:
        receiver.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await receiver
    return driver.trace()
