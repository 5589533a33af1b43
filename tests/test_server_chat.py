"""/api/chat end to end: the real server under uvicorn (echo engine), real WebSockets, real Opus
through sphn's Ogg-Opus writer/reader as Moshi clients use it."""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
import pytest
import soundfile as sf
from support_server import chat, echo_similarity, openssl_pair, running_server, stop_server

SR = 24000


@pytest.fixture(scope="module")
def server():
    with running_server("--max-sessions", "6") as srv:
        yield srv


@pytest.fixture(scope="module")
def user_wav(golden_dir) -> np.ndarray:
    audio, rate = sf.read(golden_dir / "user.wav", dtype="float32")
    assert rate == SR
    return audio


def chat_url(server, **query: str) -> str:
    params = {"text_prompt": "You enjoy having a good conversation.", **query}
    return str(httpx.URL(server.ws_url + "/api/chat", params=params))


def test_echo_call_streams_audio_text_and_metadata(server, user_wav):
    result = asyncio.run(
        chat(chat_url(server, voice_prompt="LOOPF0", text_temperature="0.5", seed="7"), user_wav)
    )

    assert result.errors == []
    meta = result.metadata[0]
    assert meta["session_id"] and meta["model"] == "loopback" and meta["voice"] == "LOOPF0"
    assert meta["sample_rate"] == SR and meta["queue_position"] == 0
    assert meta["text_temperature"] == 0.5 and meta["seed"] == 7  # per-session values reach the session
    assert result.handshake
    # Decodable agent audio covering the whole call (the echo engine keeps talking while we listen).
    assert len(result.pcm) >= len(user_wav)
    assert "".join(result.text).strip().startswith("Hello from the echo engine.")
    assert echo_similarity(user_wav, result.pcm) >= 0.8
    assert result.close_code == 1000


def test_two_concurrent_clients_each_hear_their_own_audio(server, user_wav):
    first = user_wav[: 3 * SR]
    second = user_wav[::-1][: 3 * SR].copy()  # different speech-like content

    async def both():
        return await asyncio.gather(chat(chat_url(server), first), chat(chat_url(server), second))

    a, b = asyncio.run(both())
    assert a.errors == [] and b.errors == []
    assert a.metadata[0]["session_id"] != b.metadata[0]["session_id"]
    # Served at the same time: by the time one caller has said its 3 s, the other has already
    # heard over a second of its echo (a server that serves one caller at a time gives it nothing).
    assert b.received_by(a.sent_done_at) >= SR and a.received_by(b.sent_done_at) >= SR
    assert len(a.pcm) >= len(first) and len(b.pcm) >= len(second)
    assert echo_similarity(first, a.pcm) >= 0.8 and echo_similarity(second, b.pcm) >= 0.8
    # ... and no crosstalk: each echo matches its own input better than the other's.
    assert echo_similarity(first, a.pcm) > echo_similarity(second, a.pcm) + 0.1
    assert echo_similarity(second, b.pcm) > echo_similarity(first, b.pcm) + 0.1


def test_http_endpoints(server):
    with httpx.Client(base_url=server.url) as client:
        health = client.get("/healthz").json()
        assert health["status"] == "ok" and health["state"] == "ready" and health["capacity"] == 6
        ready = client.get("/readyz")
        assert ready.status_code == 200 and ready.json()["status"] == "ready"
        voices = client.get("/api/voices").json()["voices"]
        assert {"name": "LOOPF0", "kind": "embeddings", "source": "loopback"} in voices
        metrics = client.get("/metrics").text
        for name in (
            "personaplex_active_slots",
            "personaplex_tick_seconds_bucket",
            "personaplex_late_frames_total",
            "personaplex_prefill_seconds_count",
            "personaplex_persona_cache_hits_total",
            "personaplex_chat_bytes_in_total",
            "personaplex_chat_bytes_out_total",
        ):
            assert name in metrics, name
        page = client.get("/")
        assert page.status_code == 200 and "PersonaPlex" in page.text and "app.js" in page.text
        assert client.get("/worklets.js").status_code == 200
        assert client.get("/no-such-file.js").status_code == 404


def test_unknown_voice_and_bad_values_get_a_clear_error(server):
    async def attempts():
        return await asyncio.gather(
            chat(chat_url(server, voice_prompt="NOBODY")),
            chat(chat_url(server, voice_prompt="../../etc/passwd")),
            chat(chat_url(server, text_topk="many")),
        )

    unknown, traversal, bad = asyncio.run(attempts())
    # Refusals that retrying cannot fix are the upgrade's HTTP answer, the reason in its body.
    assert "unknown voice" in unknown.errors[0] and not unknown.handshake
    assert "voice_prompt" in traversal.errors[0] and not traversal.handshake
    assert "text_topk" in bad.errors[0]
    assert {unknown.http_status, traversal.http_status, bad.http_status} == {400}
    assert (unknown.refusal_kind, traversal.refusal_kind, bad.refusal_kind) == (
        "persona",
        "bad_query",
        "bad_query",
    )


def test_capacity_queue_and_refusal():
    """One slot, one queue place: the second caller waits with its position, the third is refused,
    /readyz says full, and the waiting caller gets the slot when the first leaves."""
    with running_server("--max-sessions", "1", "--max-queue", "1") as srv:
        url = chat_url(srv)
        silence = np.zeros(3 * SR, np.float32)

        async def scenario():
            first = asyncio.create_task(chat(url, silence, tail_s=0.5))  # holds the slot >= 3.5 s
            await asyncio.sleep(0.8)
            second = asyncio.create_task(chat(url, silence[: SR // 2], tail_s=0.3))
            await asyncio.sleep(0.3)
            third = await chat(url)
            async with httpx.AsyncClient(base_url=srv.url) as client:
                readyz = await client.get("/readyz")
            return await first, await second, third, readyz

        first, second, third, readyz = asyncio.run(scenario())
        assert first.handshake and first.errors == []
        assert second.metadata[0]["queue_position"] == 1
        assert second.handshake and second.metadata[-1]["queue_position"] == 0  # updated when admitted
        assert len(second.pcm) > 0
        assert "full" in third.errors[0] and third.close_code == 1013 and not third.handshake
        assert readyz.status_code == 503 and readyz.json()["status"] == "full"


def test_api_key_and_origin():
    with running_server("--api-key", "s3cret", "--allowed-origins", "https://good.example") as srv:
        url = chat_url(srv)

        async def attempts():
            return await asyncio.gather(
                chat(url),
                chat(url + "&token=wrong"),
                chat(url + "&token=s3cret", origin="https://evil.example"),
                chat(url + "&token=s3cret", np.zeros(SR // 4, np.float32), origin="https://good.example"),
                chat(url, np.zeros(SR // 4, np.float32), headers={"Authorization": "Bearer s3cret"}),
                chat(url, np.zeros(SR // 4, np.float32), headers={"X-API-Key": "s3cret"}),
            )

        none, wrong, evil, good, bearer, header = asyncio.run(attempts())
        assert "API key" in none.errors[0] and "API key" in wrong.errors[0]
        assert "origin" in evil.errors[0]
        assert (none.http_status, wrong.http_status, evil.http_status) == (401, 401, 403)
        for ok in (good, bearer, header):
            assert ok.handshake and ok.errors == [], ok.errors
        with httpx.Client(base_url=srv.url) as client:
            assert client.get("/api/voices").status_code == 401
            assert client.get("/api/voices", params={"token": "s3cret"}).status_code == 200
            assert client.get("/healthz").status_code == 200  # probes need no key
        assert "s3cret" not in srv.log()  # the key never reaches the logs


def test_every_slot_is_free_after_calls(server):
    with httpx.Client(base_url=server.url) as client:
        deadline = time.monotonic() + 10
        while client.get("/healthz").json()["active"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.get("/healthz").json()["active"] == 0


def test_golden_model_call(golden_dir, user_wav):
    """The real engine (the tiny golden PersonaPlex) behind /api/chat: greedy, its own voice."""
    clip = user_wav[: 3 * SR]
    with running_server(
        "--max-sessions",
        "1",
        engine="model",
        model=str(golden_dir),
        env={"OMP_NUM_THREADS": "1"},
        timeout=180,
    ) as srv:
        with httpx.Client(base_url=srv.url) as client:
            voices = {v["name"] for v in client.get("/api/voices").json()["voices"]}
        assert "TINYF0.pt" in voices
        url = chat_url(srv, voice_prompt="TINYF0.pt", greedy="1", seed="1")
        result = asyncio.run(chat(url, clip))
    assert result.errors == [] and result.handshake
    meta = result.metadata[0]
    # A local model directory is named, never shown as a path.
    assert meta["model"] == golden_dir.name and meta["voice"] == "TINYF0.pt" and meta["greedy"] is True
    assert len(result.pcm) >= len(clip)  # agent audio for the whole call
    assert np.isfinite(result.pcm).all() and np.abs(result.pcm).max() > 1e-3  # it babbles, not silence
    pieces = [p for p in result.text if p.strip()]
    assert len(pieces) >= 5 and all("▁" not in p for p in pieces)  # SentencePiece spaces shown as spaces


def test_shutdown_ends_calls_in_words():
    """SIGTERM: each caller hears why (0x05) and gets a going-away close, not a bare reset."""
    with running_server("--max-sessions", "2") as srv:

        async def scenario():
            call = asyncio.create_task(chat(chat_url(srv), np.zeros(5 * SR, np.float32)))
            while not srv.log().count("opened"):
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            await asyncio.to_thread(stop_server, srv)
            return await call

        result = asyncio.run(scenario())
        assert result.handshake
        assert result.errors == ["the session ended on the server (shutdown)"]
        assert result.close_code == 1001


def test_ssl_serves_https_and_wss(tmp_path):
    openssl_pair(tmp_path, "localhost")
    with running_server("--max-sessions", "1", "--ssl", str(tmp_path)) as srv:
        assert srv.url.startswith("https://")
        with httpx.Client(base_url=srv.url, verify=False) as client:
            assert client.get("/healthz").json()["status"] == "ok"
            assert "PersonaPlex" in client.get("/").text
        result = asyncio.run(chat(chat_url(srv), np.zeros(SR // 2, np.float32), tail_s=0.2))
        assert result.handshake and result.errors == [] and len(result.pcm) > 0


def test_audio_much_faster_than_real_time_is_refused(server, user_wav):
    flood = np.tile(user_wav, 4)  # 22 s of audio sent as fast as the socket takes it
    result = asyncio.run(chat(chat_url(server), flood, realtime=False, max_tail_s=5))
    assert result.errors == ["audio arrives much faster than real time"]
    assert result.close_code == 1008
