"""Callers whose audio comes late never make a server refuse others (a real server).

`personaplex-voice serve --engine echo --max-sessions 16` with its saturation policy on. Five
/api/chat clients send their audio the way a poor mobile link delivers it: 0.4 s of it at once,
every 1.2 s. Most of their ticks get late silence (their loss: counted per call, and on
/metrics as `late_input`), and the server says so (`late_share` on /readyz); but its own clock,
loop and media path are fine, so /readyz stays `ready` throughout and a sixth caller is
admitted. (Before, late input from four or more callers counted as the process's own lateness:
/readyz went `saturated` within two seconds and every new caller was refused.)
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import numpy as np
import pytest
import sphn
from support_server import chat, running_server
from websockets.asyncio.client import connect

pytestmark = pytest.mark.timeout(120)

BURSTY = 5
BURST_S = 0.4
EVERY_S = 1.2
TALK_S = 7.0
CHUNK = 1920  # 80 ms at 24 kHz


async def bursty_client(url: str, seed: int, stop: asyncio.Event, handshakes: list[int]) -> None:
    """Connects, waits for the handshake, then sends 0.4 s of audio at once every 1.2 s."""
    writer = sphn.OpusStreamWriter(24000)
    rng = np.random.default_rng(seed)
    async with connect(url, compression=None, proxy=None, max_size=None) as ws:

        async def drain() -> None:
            async for message in ws:
                if isinstance(message, bytes) and message[:1] == b"\x00":
                    handshakes.append(seed)

        reader = asyncio.create_task(drain())
        try:
            while not handshakes.count(seed):
                await asyncio.sleep(0.05)
            start = time.monotonic()
            n = 0
            while not stop.is_set():
                for _ in range(round(BURST_S / 0.08)):
                    pcm = (0.1 * rng.standard_normal(CHUNK)).astype(np.float32)
                    await ws.send(b"\x01" + writer.append_pcm(pcm))
                n += 1
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), max(0.0, start + n * EVERY_S - time.monotonic()))
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader


async def test_callers_sending_late_or_in_bursts_leave_the_server_ready_for_others():
    env = {"PERSONAPLEX_SATURATION": "1"}
    with running_server("--max-sessions", "16", env=env) as server:
        url = server.ws_url + "/api/chat?text_prompt=hi"
        stop, handshakes = asyncio.Event(), []
        clients = [asyncio.create_task(bursty_client(url, i, stop, handshakes)) for i in range(BURSTY)]
        deadline = time.monotonic() + 30
        while len(set(handshakes)) < BURSTY:
            assert time.monotonic() < deadline, "the bursty clients were not all admitted"
            await asyncio.sleep(0.1)

        answers = []
        until = time.monotonic() + TALK_S
        while time.monotonic() < until:
            answer = await asyncio.to_thread(httpx.get, server.url + "/readyz", timeout=10)
            answers.append((answer.status_code, answer.json()))
            await asyncio.sleep(0.3)
        # A new caller, after 7 s of them: admitted, talked to, echoed.
        newcomer = await chat(url, np.zeros(24000, np.float32), tail_s=0.5)
        stop.set()
        await asyncio.gather(*clients)

        assert all(code == 200 and body["status"] == "ready" for code, body in answers), [
            body for code, body in answers if code != 200
        ][:3]
        shown = [body["headroom"]["late_share"] for _, body in answers if body["headroom"]["late_share"]]
        assert max(shown, default=0.0) >= 0.5, shown  # they are late, and the server says so
        assert newcomer.handshake and newcomer.http_status is None and newcomer.audio_messages > 0

        await asyncio.sleep(1.0)  # their sessions closed: their loss is counted
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        late = [
            line
            for line in metrics.splitlines()
            if line.startswith('personaplex_audio_inserted_seconds_total{reason="late_input"}')
        ]
        assert late and float(late[0].split()[-1]) > 1.0, late
