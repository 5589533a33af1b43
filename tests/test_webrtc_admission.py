"""WebRTC's admission answers in process (no media): a server without real-time headroom answers a
WHIP offer and a Pipecat offer 503 `saturated` with Retry-After, as /api/chat does; a server
without aiortc answers 501 saying what to install; `--no-webrtc` leaves the routes out; a bad
`--ice-servers` stops `serve` with one line."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from support_cli import assert_one_line_error, call_cli
from support_server import serving_app

from personaplex_voice.engine.headroom import HeadroomConfig
from personaplex_voice.engine.loopback import LoopbackEngine
from personaplex_voice.sessions import SessionManager

# Saturated by any work at all: the loop monitor's first second makes it so, and it stays.
ALWAYS_SATURATED = HeadroomConfig(loop_load_enter=1e-9, loop_load_exit=0.0, loop_load_hold_s=0.0)


def offer() -> str:
    from aiortc import RTCPeerConnection

    async def make() -> str:
        pc = RTCPeerConnection()
        pc.addTransceiver("audio", direction="sendrecv")
        pc.createDataChannel("personaplex")
        await pc.setLocalDescription(await pc.createOffer())
        sdp = pc.localDescription.sdp
        await pc.close()
        return sdp

    return asyncio.run(make())


def test_a_saturated_server_refuses_webrtc_calls_with_503_and_retry_after():
    manager = SessionManager(LoopbackEngine(num_slots=4), headroom=ALWAYS_SATURATED)
    with serving_app(manager, log_level="warning") as server:
        deadline = time.monotonic() + 10
        while httpx.get(server.url + "/readyz").status_code != 503:
            assert time.monotonic() < deadline, "the server never saturated"
            time.sleep(0.1)
        sdp = offer()
        whip = httpx.post(server.url + "/api/whip", content=sdp, headers={"content-type": "application/sdp"})
        pipecat = httpx.post(server.url + "/api/offer", json={"sdp": sdp, "type": "offer"})
        metrics = httpx.get(server.url + "/metrics").text
    assert whip.status_code == 503 and whip.headers["x-personaplex-error"] == "saturated"
    assert int(whip.headers["retry-after"]) >= 1 and "cannot take another call in real time" in whip.text
    assert pipecat.status_code == 503 and pipecat.json()["kind"] == "saturated"
    assert 'personaplex_webrtc_errors_total{kind="saturated"} 2.0' in metrics
    assert manager.active_count == 0


def test_without_aiortc_the_endpoints_answer_501_saying_what_to_install(monkeypatch):
    import personaplex_voice.server.webrtc as webrtc

    monkeypatch.setattr(webrtc, "_load_aiortc", lambda: f"{webrtc.INSTALL_HINT} (No module named 'aiortc')")
    manager = SessionManager(LoopbackEngine(num_slots=1))
    with serving_app(manager, log_level="warning") as server:
        sdp = {"content-type": "application/sdp"}
        answer = httpx.post(server.url + "/api/whip", content="v=0", headers=sdp)
        config = httpx.get(server.url + "/api/webrtc").json()
    assert answer.status_code == 501 and "pip install 'personaplex-voice[webrtc]'" in answer.text
    assert config["available"] is False and "webrtc" in config["reason"]


def test_no_webrtc_leaves_the_routes_out():
    manager = SessionManager(LoopbackEngine(num_slots=1))
    with serving_app(manager, log_level="warning", webrtc=False) as server:
        assert httpx.post(server.url + "/api/whip", content="v=0").status_code in (404, 405)
        assert httpx.get(server.url + "/api/webrtc").status_code == 404


@pytest.mark.parametrize(
    ("value", "fragment"),
    [("turn:turn.example.com:3478", "needs turn:USER:PASS@HOST:PORT"), ("http://x", "expected stun:")],
)
def test_a_bad_ice_server_setting_stops_serve_with_one_line(value, fragment):
    refused = call_cli("serve", "--engine", "echo", "--ice-servers", value)
    assert_one_line_error(refused, "--ice-servers", fragment)
