"""/api/chat around the handshake (issue 16): every input byte sent after connecting counts, a
queued burst is absorbed without a dropped frame, and what can be refused before the upgrade
is refused in HTTP with the reason. Real uvicorn (the `serve` configuration), real WebSockets,
real Opus (sphn, as Moshi clients use it), speech from espeak-ng."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time

import httpx
import numpy as np
import pytest
import sphn
from support_audio import espeak_speech, set_level
from support_server import echo_similarity, running_server, serving_app, window_similarity
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from personaplex_voice.audio.resample import resample
from personaplex_voice.engine.base import FRAME_SIZE
from personaplex_voice.engine.loopback import LoopbackEngine
from personaplex_voice.sessions import SessionManager

SR = 24000
PACKET = 480  # 20 ms, what browsers and LiveKit send
PREFILL_S = 0.5  # the echo engine's "system prompt" takes this long: audio arrives meanwhile

pytestmark = pytest.mark.timeout(120)


LEAD = SR // 10  # the microphone's first 100 ms are quiet; the first word starts right after


@pytest.fixture(scope="module")
def speech(tmp_path_factory) -> np.ndarray:
    """About 4 s of synthetic speech at 24 kHz, its first word at `LEAD`."""
    pcm, rate = espeak_speech(tmp_path_factory.mktemp("speech"))
    x = set_level(resample(pcm, rate, SR), -20.0)
    onset = int(np.argmax(np.abs(x) > 0.02))
    return np.concatenate([np.zeros(LEAD, np.float32), x[onset : onset + 4 * SR]])


@pytest.fixture(scope="module")
def server():
    # No persona cache: every call pays the prefill, as a first call with a new persona does.
    engine = LoopbackEngine(num_slots=4, prefill_s=PREFILL_S, text_pieces=[" Hello", None])
    manager = SessionManager(engine, cache_bytes=0)
    with serving_app(manager, max_sessions=4) as srv:
        yield srv


def chat_url(server, **query: str) -> str:
    return str(httpx.URL(server.ws_url + "/api/chat", params={"text_prompt": "hi", **query}))


async def stream(
    url: str, audio: np.ndarray, *, wait_handshake: bool, burst_s: float = 0.0, tail_s: float = 1.0
) -> dict:
    """Connect and send `audio` as Ogg-Opus in 20 ms packets: the first `burst_s` at once, the
    rest in real time. Without `wait_handshake` it starts the moment it connects. Keeps the
    microphone open (silence) until the echo covers what was sent (or `tail_s` past 15 s)."""
    writer, reader = sphn.OpusStreamWriter(SR), sphn.OpusStreamReader(SR)
    received: list[np.ndarray] = []
    handshake = asyncio.Event()
    got = {"samples": 0, "errors": [], "handshake_at": None, "connected_at": None}

    async def receive(ws) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for message in ws:
                kind, payload = message[0], message[1:]
                if kind == 0x00:
                    got["handshake_at"] = time.monotonic()
                    handshake.set()
                elif kind == 0x01:
                    pcm = reader.append_bytes(payload)
                    if pcm is not None and len(pcm):
                        received.append(np.asarray(pcm, np.float32))
                        got["samples"] += len(pcm)
                elif kind == 0x05:
                    got["errors"].append(payload.decode())
        handshake.set()

    async with connect(url, compression=None, max_size=None, proxy=None) as ws:
        got["connected_at"] = time.monotonic()
        receiver = asyncio.create_task(receive(ws))
        if wait_handshake:
            await asyncio.wait_for(handshake.wait(), 30)
        burst = int(burst_s * SR)
        if burst:
            await ws.send(b"\x01" + writer.append_pcm(audio[:burst]))
        start = time.monotonic()
        sent = burst
        while sent < len(audio) or (got["samples"] < len(audio) and time.monotonic() - start < 15 + tail_s):
            piece = audio[sent : sent + PACKET] if sent < len(audio) else np.zeros(PACKET, np.float32)
            await ws.send(b"\x01" + writer.append_pcm(piece))
            sent += PACKET
            await asyncio.sleep(max(0.0, start + (sent - burst) / SR - time.monotonic()))
        await ws.close()
        await receiver
    got["pcm"] = np.concatenate(received) if received else np.zeros(0, np.float32)
    return got


def counters(manager) -> dict[str, float]:
    m = manager.metrics
    return {
        "jitter_dropped": m.jitter_dropped_frames.value,
        "dropped_input": m.dropped_input_samples.value,
        "catchup": m.catchup_frames.value,
        "late": m.late_frames.value,
    }


def assert_no_burst_trimmed(before: dict[str, float], after: dict[str, float]) -> None:
    """Nothing of the caller's audio was lost but what the jitter buffer trims after a late tick
    (a busy machine's own lateness, one spare frame for each silence fed): never the start burst."""
    trimmed = after["jitter_dropped"] - before["jitter_dropped"]
    assert trimmed <= after["late"] - before["late"], (before, after)
    assert after["dropped_input"] - before["dropped_input"] == trimmed * FRAME_SIZE, (before, after)


def test_a_client_that_talks_at_once_gets_the_echo_of_its_first_words(server, speech):
    before = counters(server.manager)
    got = asyncio.run(stream(chat_url(server), speech, wait_handshake=False))
    after = counters(server.manager)
    assert got["errors"] == []
    # it spoke through the prefill: the handshake came well after its first words
    assert got["handshake_at"] - got["connected_at"] >= 0.8 * PREFILL_S
    first_words = window_similarity(speech, got["pcm"], LEAD, SR // 5)  # its first 200 ms of speech
    assert first_words >= 0.8, first_words
    assert echo_similarity(speech, got["pcm"]) >= 0.8
    assert_no_burst_trimmed(before, after)
    assert after["catchup"] > before["catchup"]  # the backlog from the prefill was caught up


def test_a_queued_burst_then_real_time_input_drops_no_frame(server, speech):
    before = counters(server.manager)
    got = asyncio.run(stream(chat_url(server), speech, wait_handshake=True, burst_s=0.7))
    after = counters(server.manager)
    assert got["errors"] == []
    assert window_similarity(speech, got["pcm"], LEAD, SR // 5) >= 0.8
    assert echo_similarity(speech, got["pcm"]) >= 0.8
    assert_no_burst_trimmed(before, after)
    # 0.7 s: 8 frames, the first taken by a tick, the rest by catch-up steps. On a busy machine
    # this client's own sends come late too, and a frame or two of the burst can stay queued as
    # the jitter buffer's spare (never dropped: asserted above); most of it is caught up.
    assert after["catchup"] >= before["catchup"] + 4


async def refused_upgrade(url: str) -> tuple[int, str, str | None]:
    with pytest.raises(InvalidStatus) as refused:
        await connect(url, proxy=None)
    response = refused.value.response
    return response.status_code, response.body.decode(), response.headers.get("x-personaplex-error")


def test_unknown_voice_and_an_over_long_prompt_are_http_errors_with_the_reason(server):
    async def both():
        return await asyncio.gather(
            refused_upgrade(chat_url(server, voice_prompt="NOBODY")),
            refused_upgrade(chat_url(server, text_prompt="x" * 4001)),
        )

    (voice_status, voice_body, voice_kind), (long_status, long_body, long_kind) = asyncio.run(both())
    assert voice_status == 400 and "unknown voice 'NOBODY'" in voice_body and voice_kind == "persona"
    assert long_status == 400 and "too long (4001 characters, at most 4000)" in long_body
    assert long_kind == "bad_query"
    assert server.manager.active_count == 0  # nothing was left open
    # A client that cannot read the upgrade's answer (a browser) asks the same URL over HTTP.
    probe = httpx.get(server.url + "/api/chat", params={"text_prompt": "hi", "voice_prompt": "NOBODY"})
    assert probe.status_code == 400 and "unknown voice" in probe.text
    assert httpx.get(server.url + "/api/chat", params={"text_prompt": "hi"}).status_code == 426


def test_refusals_are_counted_as_refused_and_logged_once():
    with running_server("--max-sessions", "2", "--api-key", "k3y") as srv:
        base = srv.ws_url + "/api/chat?text_prompt=hi"

        async def scenario():
            await asyncio.gather(
                refused_upgrade(base + "&token=k3y&voice_prompt=NOBODY"),
                refused_upgrade(base + "&token=wrong"),
                refused_upgrade(base + "&token=k3y&text_topk=0"),
            )
            # refused after the upgrade: audio that is not Ogg
            async with connect(base + "&token=k3y", proxy=None) as ws:
                await ws.send(b"\x01not ogg at all")
                with contextlib.suppress(ConnectionClosed):
                    async for _ in ws:
                        pass
                return ws.close_code

        code = asyncio.run(scenario())
        assert code == 1007
        metrics = httpx.get(srv.url + "/metrics", headers={"Authorization": "Bearer k3y"}).text
        assert 'personaplex_sessions_closed_total{reason="refused"} 1.0' in metrics
        assert 'reason="other"' not in metrics
        for kind in ("persona", "auth", "bad_query", "malformed_audio"):
            assert f'personaplex_chat_errors_total{{kind="{kind}"}} 1.0' in metrics
        deadline = time.monotonic() + 5
        while "NOBODY" not in srv.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        log = srv.log()
    refusal_lines = [line for line in log.splitlines() if "NOBODY" in line]
    assert len(refusal_lines) == 1 and "400" in refusal_lines[0] and "unknown voice" in refusal_lines[0]
    assert len([line for line in log.splitlines() if "text_topk" in line]) == 1
    assert "Unsupported upgrade request" not in log
    assert "ERROR" not in log and "Traceback" not in log


def test_an_over_long_upgrade_request_line_is_refused_in_one_line():
    with running_server("--max-sessions", "1") as srv:
        url = srv.ws_url + "/api/chat?text_prompt=" + "y" * 20_000
        status, body, _ = asyncio.run(refused_upgrade(url))
        assert status == 414 and "POST /api/prompts" in body
        # The log line is written as the answer goes out; give the file a moment.
        deadline = time.monotonic() + 5
        while "does not fit a URL" not in srv.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # and room for a second line (an access line) if one were coming
        log = srv.log()
    assert "Unsupported upgrade request" not in log
    # 414 as a word of its own: a port such as :41400 or a timestamp's ,414 is not a status.
    status_lines = [line for line in log.splitlines() if re.search(r"(?<!\S)414(?!\S)", line)]
    assert len(status_lines) == 1 and "does not fit a URL" in status_lines[0], status_lines
