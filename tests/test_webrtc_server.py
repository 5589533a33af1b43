"""WebRTC calls against the real `serve --engine echo`: a WHIP client (aiortc's own client side,
tests/support_webrtc.py) gets its speech back, the agent's text and the metadata on its data
channel; refusals are HTTP answers with the reason; the WHIP session resource answers DELETE,
PATCH and other methods as RFC 9725 says; a caller that hangs up, closes, never connects or
vanishes from the network frees its slot."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from support_audio import espeak_speech
from support_server import echo_similarity, running_server
from support_webrtc import WebRTCCaller, whip_call

from personaplex_voice.audio.resample import resample

SR = 24000
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def speech(tmp_path_factory) -> np.ndarray:
    pcm, rate = espeak_speech(Path(tmp_path_factory.mktemp("speech")))
    return resample(pcm, rate, SR)[: 4 * SR]


@pytest.fixture(scope="module")
def server():
    env = {"PERSONAPLEX_WEBRTC_PEER_TIMEOUT_S": "2", "PERSONAPLEX_WEBRTC_CONNECT_TIMEOUT_S": "3"}
    with running_server("--max-sessions", "2", env=env) as srv:
        yield srv
        log = srv.log()
    # Callers that hung up, closed, vanished or never connected cost no traceback or ERROR line.
    assert "Traceback" not in log and " ERROR " not in log and "never retrieved" not in log, log[-3000:]


def active(server) -> int:
    return httpx.get(server.url + "/healthz", timeout=10).json()["active"]


def wait_until(condition, bound_s: float, what: str) -> None:
    """Polls `condition` (a hang bound, not a timing claim)."""
    deadline = time.monotonic() + bound_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {bound_s} s"
        time.sleep(0.1)


def metric(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (r"\{" + re.escape(wanted) + r"\}" if wanted else "") + r" ([0-9.e+-]+)"
    found = re.search(r"^" + pattern + "$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_a_whip_call_gets_its_speech_back_with_text_and_metadata(server, speech):
    result = asyncio.run(whip_call(server.url, {"text_prompt": "hi", "voice_prompt": "LOOPM0"}, speech))
    assert result.status == 201, result.body
    headers = result.answer_headers
    assert headers["content-type"].startswith("application/sdp")
    assert re.fullmatch(r"/api/whip/[0-9a-f]{6}-[A-Za-z0-9_-]{22}", headers["location"])
    assert headers["etag"].startswith('"') and len(headers["etag"]) > 2
    # The answer: Opus only, with our receiver's wishes (RFC 7587 fmtp).
    audio = result.body.split("m=audio", 1)[1].split("m=", 1)[0]
    assert "opus/48000/2" in audio and "PCMU" not in audio and "G722" not in audio
    assert "useinbandfec=1" in audio and "usedtx=0" in audio
    meta = result.metadata[0]
    assert meta["transport"] == "webrtc" and meta["voice"] == "LOOPM0" and meta["sample_rate"] == SR
    assert result.handshake_at is not None and result.errors == []
    assert "Hello from the echo engine" in "".join(result.text)
    similarity = echo_similarity(speech, result.pcm)
    assert similarity >= 0.8, similarity
    assert result.delete_status == 200
    wait_until(lambda: active(server) == 0, 20, "the slot freed after DELETE")
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert metric(text, "personaplex_webrtc_calls_total") >= 1
    assert metric(text, "personaplex_webrtc_caller_packets_total") > 100
    assert metric(text, "personaplex_webrtc_agent_packets_total") > 100


def test_refusals_are_http_answers_with_the_reason(server):
    offer = asyncio.run(_offer_sdp())
    with httpx.Client(base_url=server.url, timeout=30) as http:

        def post(params=None, body=offer, content_type="application/sdp"):
            return http.post("/api/whip", params=params, content=body, headers={"content-type": content_type})

        unknown = post({"voice_prompt": "NOPE"})
        assert unknown.status_code == 400 and unknown.headers["x-personaplex-error"] == "persona"
        assert "NOPE" in unknown.text and unknown.headers["content-type"].startswith("text/plain")
        bad = post({"text_topk": "0"})
        assert bad.status_code == 400 and bad.headers["x-personaplex-error"] == "bad_query"
        assert "text_topk must be between 1 and 100000, got 0" in bad.text
        wrong_type = post(content_type="application/json")
        assert wrong_type.status_code == 415 and "application/sdp" in wrong_type.text
        assert post(body="hello").status_code == 400
        no_opus = post(body=offer.replace("opus/48000", "speex/48000"))
        assert no_opus.status_code == 400 and "Opus" in no_opus.text
        facts = post({"text_prompt": "{a}", "caller.bad-name": "x"})
        assert facts.status_code == 400 and "caller fact" in facts.text
        # The same refusals through Pipecat's endpoint, as its FastAPI server words them.
        pipecat = http.post(
            "/api/offer", json={"sdp": offer, "type": "offer", "requestData": {"voice_prompt": "NOPE"}}
        )
        assert pipecat.status_code == 400 and "NOPE" in pipecat.json()["detail"]
        assert http.post("/api/offer", json={"sdp": offer, "type": "answer"}).status_code == 400
    assert active(server) == 0  # nothing was left open by any refusal


def test_a_full_server_answers_503_with_retry_after(speech):
    with running_server("--max-sessions", "1") as srv:

        async def scenario() -> tuple[httpx.Response, httpx.Response]:
            first = WebRTCCaller(srv.url, speech[:SR])
            result = await first.connect()
            assert result.status == 201 and result.handshake_at is not None
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as http:
                offer = await _offer_sdp()
                whip = await http.post(
                    "/api/whip", content=offer, headers={"content-type": "application/sdp"}
                )
                pipecat = await http.post("/api/offer", json={"sdp": offer, "type": "offer"})
            await first.hang_up("delete")
            return whip, pipecat

        whip, pipecat = asyncio.run(scenario())
    assert whip.status_code == 503 and whip.headers["x-personaplex-error"] == "capacity"
    assert "the server is full (1 sessions)" in whip.text and int(whip.headers["retry-after"]) >= 1
    assert pipecat.status_code == 503 and "full" in pipecat.json()["detail"]


def test_an_api_key_is_required_when_set(speech):
    with running_server("--api-key", "s3cret") as srv:
        offer = asyncio.run(_offer_sdp())
        refused = httpx.post(
            srv.url + "/api/whip", content=offer, headers={"content-type": "application/sdp"}
        )
        assert refused.status_code == 401 and refused.headers["x-personaplex-error"] == "auth"
        assert httpx.get(srv.url + "/api/webrtc").status_code == 401
        config = httpx.get(srv.url + "/api/webrtc", headers={"authorization": "Bearer s3cret"}).json()
        assert config["available"] and config["whip"] == "/api/whip" and config["ice_servers"] == []
        result = asyncio.run(
            whip_call(srv.url, {}, speech[:SR], headers={"authorization": "Bearer s3cret"}, tail_s=0.5)
        )
        assert result.status == 201 and result.delete_status == 200


def test_the_whip_session_resource_answers_as_rfc_9725_says(server):
    async def scenario() -> dict[str, httpx.Response]:
        caller = WebRTCCaller(server.url, np.zeros(SR, np.float32))
        result = await caller.connect()
        assert result.status == 201
        location = caller.location
        ufrag = re.search(r"a=ice-ufrag:(\S+)", caller.pc.localDescription.sdp).group(1)
        etag = result.answer_headers["etag"]
        out = {}
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            frag = f"a=ice-ufrag:{ufrag}\r\na=ice-pwd:x\r\nm=audio 9 RTP/AVP 0\r\na=mid:0\r\n"
            frag += "a=candidate:1 1 udp 2122260223 192.0.2.99 61764 typ host\r\n"
            sdpfrag = {"content-type": "application/trickle-ice-sdpfrag"}
            out["trickle"] = await http.patch(location, content=frag, headers={**sdpfrag, "if-match": etag})
            out["stale"] = await http.patch(
                location, content=frag, headers={**sdpfrag, "if-match": '"other"'}
            )
            restart = frag.replace(ufrag, "newufrag")
            out["restart"] = await http.patch(location, content=restart, headers=sdpfrag)
            out["restart_star"] = await http.patch(
                location, content=frag, headers={**sdpfrag, "if-match": "*"}
            )
            out["wrong_type"] = await http.patch(
                location, content=frag, headers={"content-type": "text/plain"}
            )
            out["get"] = await http.get(location)
            tag, _, token = location.rsplit("/", 1)[1].partition("-")
            out["unknown"] = await http.delete(f"/api/whip/{tag}-{'A' * 22}")
            other_tag = "000000" if tag != "000000" else "111111"
            out["elsewhere"] = await http.delete(f"/api/whip/{other_tag}-{token}")
            out["delete"] = await http.delete(location)
            out["again"] = await http.delete(location)
        await caller.close()
        return out

    out = asyncio.run(scenario())
    assert out["trickle"].status_code == 204
    assert out["stale"].status_code == 412
    assert out["restart"].status_code == 422 and "ICE restart" in out["restart"].text
    assert out["restart_star"].status_code == 422
    assert out["wrong_type"].status_code == 415
    assert out["get"].status_code == 405 and "DELETE" in out["get"].headers["allow"]
    assert out["unknown"].status_code == 404
    assert out["elsewhere"].status_code == 421  # another front-end's call: retry elsewhere
    assert out["delete"].status_code == 200 and out["again"].status_code == 404
    wait_until(lambda: active(server) == 0, 20, "the slot freed")


def test_a_caller_that_closes_its_peer_connection_frees_its_slot(server, speech):
    async def scenario() -> None:
        caller = WebRTCCaller(server.url, speech[:SR])
        result = await caller.connect()
        assert result.handshake_at is not None
        assert active(server) == 1
        await caller.hang_up("close")  # DTLS close_notify, no DELETE

    asyncio.run(scenario())
    wait_until(lambda: active(server) == 0, 20, "the slot freed after a DTLS close")


def test_a_vanished_peer_frees_its_slot_after_the_peer_timeout(server, speech):
    """The network goes silent both ways (no DTLS close, no ICMP): the server hears nothing for
    PERSONAPLEX_WEBRTC_PEER_TIMEOUT_S (2 s here) and ends the call."""

    async def scenario() -> None:
        caller = WebRTCCaller(server.url, speech[: 2 * SR])
        result = await caller.connect(relay=True)
        assert result.handshake_at is not None, result.body
        await caller.speak(tail_s=0.2)
        assert active(server) == 1
        await caller.hang_up("cut")
        await asyncio.to_thread(wait_until, lambda: active(server) == 0, 30, "the vanished peer's slot freed")
        await caller.close()

    asyncio.run(scenario())
    assert "nothing heard from the caller for 2 s" in server.log() or "peer_timeout" in server.log()


def test_a_peer_that_never_connects_frees_its_slot(server):
    async def scenario() -> None:
        offer = await _offer_sdp()
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            answer = await http.post("/api/whip", content=offer, headers={"content-type": "application/sdp"})
        assert answer.status_code == 201
        assert active(server) == 1  # the slot is held from the answer on
        # ...and the client never uses the answer.
        await asyncio.to_thread(wait_until, lambda: active(server) == 0, 30, "the slot freed")

    asyncio.run(scenario())
    assert "did not come up within 3 s" in server.log()


async def _offer_sdp() -> str:
    """A real offer from aiortc's client side (audio + a data channel), never answered."""
    from aiortc import RTCPeerConnection

    pc = RTCPeerConnection()
    pc.addTransceiver("audio", direction="sendrecv")
    pc.createDataChannel("personaplex")
    await pc.setLocalDescription(await pc.createOffer())
    sdp = pc.localDescription.sdp
    await pc.close()
    return sdp


def test_webrtc_calls_run_in_cluster_front_ends(speech):
    """Two front-end processes on one port, one engine worker: a call is answered by whichever
    front-end the kernel picks; a later request that lands on the other one gets 421, and the
    retry on a new connection reaches the call's own front-end."""
    with running_server("--workers", "2", "--engine-workers", "1", timeout=180) as srv:

        async def scenario() -> tuple[list[int], float]:
            statuses: list[int] = []
            similarity = 0.0
            for _ in range(4):  # enough calls that some follow-ups meet the other front-end
                caller = WebRTCCaller(srv.url, speech[: 2 * SR])
                result = await caller.connect()
                assert result.status == 201 and result.handshake_at is not None, result.body
                await caller.speak(tail_s=1.0)
                similarity = max(similarity, echo_similarity(speech[: 2 * SR], result.pcm))
                for _ in range(12):  # a new connection (a new client) each time
                    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as http:
                        status = (await http.delete(caller.location)).status_code
                    statuses.append(status)
                    if status != 421:
                        break
                assert status == 200, statuses
                await caller.close()
            return statuses, similarity

        statuses, similarity = asyncio.run(scenario())
        wait_until(lambda: active(srv) == 0, 20, "every slot freed")
    assert set(statuses) <= {200, 421}
    assert similarity >= 0.8


def test_a_data_channel_flood_ends_the_call(speech):
    """More than a voice call's worth of data-channel bytes (/api/chat's 128 KiB/s past a 2 MiB
    burst): the call ends as `too_fast` and its slot is freed. (The 0x05 saying so is sent, but
    a client that floods its own association may not read it before the close.)"""
    with running_server("--max-sessions", "1") as srv:

        async def scenario() -> None:
            caller = WebRTCCaller(srv.url, speech[:SR])
            result = await caller.connect()
            assert result.handshake_at is not None
            for _ in range(3000):  # 6 MB, queued at once: SCTP sends it as fast as it can
                caller.channel.send(b"\x03" + b"x" * 2000)
            freed = (wait_until, lambda: active(srv) == 0, 60, "the flooding caller's slot freed")
            await asyncio.to_thread(*freed)
            await caller.close()

        asyncio.run(scenario())
        log = srv.log()
    assert "ended (too_fast): the client sends far more data than a voice call needs" in log


def test_shutdown_tells_webrtc_callers_why(speech):
    """SIGTERM: a WebRTC caller gets 0x05 "the session ended on the server (shutdown)" on its
    data channel before the peer connection closes, as /api/chat callers do."""
    from support_server import stop_server

    with running_server("--max-sessions", "1") as srv:

        async def scenario():
            caller = WebRTCCaller(srv.url, speech[:SR])
            result = await caller.connect()
            assert result.handshake_at is not None
            await asyncio.to_thread(stop_server, srv)
            deadline = time.monotonic() + 15
            while not result.errors and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            await caller.close()
            return result

        result = asyncio.run(scenario())
    assert result.errors == ["the session ended on the server (shutdown)"]
