"""Pipecat's small-WebRTC client path against `serve --engine echo`: the offer exchange its
client makes (pipecat-ai/pipecat-client-web-transports, transports/small-webrtc-transport/src/
smallWebRTCTransport.ts: `POST` `{sdp, type, pc_id, restart_pc, requestData}` to the offer URL,
`PATCH` `{pc_id, candidates: [{candidate, sdp_mid, sdp_mline_index}]}`, a data channel "chat"
with `ping: <ms>` keepalives and RTVI messages, audio and video transceivers), and the runner's
`POST /start` then `/sessions/{id}/api/offer` flow (pipecat-ai 1.14 runner/run.py). The client
side is aiortc's (tests/support_webrtc.py), as Pipecat's own Python side is."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from support_audio import espeak_speech
from support_server import echo_similarity, running_server
from support_webrtc import WebRTCCaller

from personaplex_voice.audio.resample import resample

SR = 24000
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def speech(tmp_path_factory) -> np.ndarray:
    pcm, rate = espeak_speech(Path(tmp_path_factory.mktemp("speech")))
    return resample(pcm, rate, SR)[: 3 * SR]


def active(url: str) -> int:
    return httpx.get(url + "/healthz", timeout=10).json()["active"]


async def until(condition, bound_s: float, what: str) -> None:
    deadline = time.monotonic() + bound_s
    while not await asyncio.to_thread(condition):
        assert time.monotonic() < deadline, f"{what} did not happen within {bound_s} s"
        await asyncio.sleep(0.1)


def test_pipecats_client_exchange_connects_talks_restarts_and_hangs_up(speech):
    request_data = {
        "text_prompt": "You help {customer_name}.",
        "voice_prompt": "LOOPF0",
        "seed": 7,
        "caller": {"customer_name": "Omar"},
    }
    with running_server("--max-sessions", "2") as srv:

        async def scenario() -> dict:
            caller = WebRTCCaller(srv.url, speech, endpoint="pipecat", request_data=request_data)
            result = await caller.connect()
            assert result.status == 200, result.body
            answer = result.body
            first_pc_id = caller.pc_id
            assert result.handshake_at is not None, result.rtvi
            out: dict = {"answer": answer, "pc_id": first_pc_id}
            # Trickled candidates, as the client PATCHes them every 200 ms.
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as http:
                patch = await http.patch(
                    "/api/offer",
                    json={
                        "pc_id": first_pc_id,
                        "candidates": [
                            {
                                "candidate": "candidate:1 1 udp 2122260223 192.0.2.99 61764 typ host",
                                "sdp_mid": "0",
                                "sdp_mline_index": 0,
                            },
                            {"candidate": "", "sdp_mid": "0", "sdp_mline_index": 0},
                        ],
                    },
                )
                out["patch"] = patch
                out["patch_unknown"] = await http.patch(
                    "/api/offer", json={"pc_id": "nope", "candidates": []}
                )
            await caller.speak(tail_s=1.0)
            out["first_pcm"] = caller.result.pcm.copy()
            # The client's reconnection: a new peer connection, the same pc_id, restart_pc.
            caller.result.received.clear()
            caller.start.clear()
            await caller.restart()
            out["restart_status"] = caller.result.status
            out["restart_pc_id"] = caller.pc_id
            out["active_after_restart"] = await asyncio.to_thread(active, srv.url)
            await caller.speak(tail_s=1.0)
            out["second_pcm"] = caller.result.pcm.copy()
            await caller.hang_up("disconnect-bot")
            await until(lambda: active(srv.url) == 0, 20, "the slot freed after disconnect-bot")
            out["result"] = caller.result
            return out

        out = asyncio.run(scenario())
    result = out["result"]
    # The answer: audio both ways, the client's video transceiver declined (inactive).
    video = out["answer"].split("m=video", 1)[1]
    assert "a=inactive" in video
    ready = next(m for m in result.rtvi if m["type"] == "bot-ready")
    assert ready["label"] == "rtvi-ai" and ready["id"] == "ready-1"  # answers the client-ready
    metadata = result.metadata[0]
    assert metadata["voice"] == "LOOPF0" and metadata["seed"] == 7 and metadata["transport"] == "webrtc"
    assert "Hello from the echo engine" in "".join(result.text)  # bot-transcription messages
    assert out["patch"].status_code == 200 and out["patch"].json() == {"status": "success"}
    assert out["patch_unknown"].status_code == 404
    assert echo_similarity(speech, out["first_pcm"]) >= 0.8
    # Restarted on a new peer connection, the same call and session: still one slot, still echoing.
    assert out["restart_status"] == 200 and out["restart_pc_id"] == out["pc_id"]
    assert out["active_after_restart"] == 1
    assert echo_similarity(speech, out["second_pcm"]) >= 0.8


def test_the_runners_start_then_session_offer_flow(speech):
    with running_server("--max-sessions", "1") as srv:
        start = httpx.post(
            srv.url + "/start",
            json={"transport": "webrtc", "body": {"text_prompt": "hi", "voice_prompt": "LOOPM0"}},
            timeout=30,
        )
        assert start.status_code == 200
        session_id = start.json()["sessionId"]
        assert start.json()["iceConfig"] == {"iceServers": []}
        assert httpx.post(srv.url + "/start", json={"transport": "daily"}, timeout=30).status_code == 400

        async def scenario():
            caller = WebRTCCaller(
                srv.url, speech[:SR], endpoint="pipecat", offer_path=f"/sessions/{session_id}/api/offer"
            )
            result = await caller.connect()
            await caller.speak(tail_s=0.5)
            await caller.hang_up("close")
            return result

        result = asyncio.run(scenario())
        missing = httpx.post(srv.url + "/sessions/nope/api/offer", json={"sdp": "v=0", "type": "offer"})
    assert result.status == 200 and result.handshake_at is not None
    assert result.metadata[0]["voice"] == "LOOPM0"  # the persona /start kept
    assert missing.status_code == 404
