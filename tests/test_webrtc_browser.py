"""The browser client over WebRTC, in real headless Chromium with a fake microphone (espeak-ng
speech), against the real echo server: the page's transport switch set to WebRTC, it hears its
speech back (the recording's agent channel against its microphone channel), with the same
meters, transcript, stats (round trip, loss and jitter-buffer delay from getStats) and
recording as over the WebSocket.

Under loss: the page's WHIP answer is rewritten (playwright route) so that the media flows
through a UDP relay that drops 5 % or 10 % of the RTP packets each way (tests/support_webrtc.py:
LossyRelay; netem is not available on this kernel, so the loss is injected at the RTP layer).
Chromium's NetEq and the server's FEC and concealment must keep the echo continuous: no gap of
silence over 100 ms inside the echoed speech, and the echo still recognisably the speech."""

from __future__ import annotations

import asyncio
import base64
import io
import subprocess
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
from support_browser import CHROMIUM, FAKE_MICROPHONE, FLAGS
from support_server import echo_similarity, running_server
from support_webrtc import host_candidate, start_relay, via_relay

pytestmark = [pytest.mark.browser, pytest.mark.slow]

SPEECH = (
    "Hello there. I would like to talk about the weather today. It is sunny and warm, "
    "and the wind comes from the sea."
)
READ_RECORDING = """async () => {
  const link = document.getElementById('download');
  const bytes = new Uint8Array(await (await fetch(link.href)).arrayBuffer());
  let text = '';
  for (let i = 0; i < bytes.length; i += 0x8000) {
    text += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  }
  return btoa(text);
}"""


@pytest.fixture(scope="module")
def microphone_wav(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mic") / "speech.wav"
    subprocess.run(["espeak-ng", "-w", str(path), SPEECH], check=True, timeout=60)
    return path


class RelayLoop:
    """An asyncio loop in a thread for the relays (the playwright API here is synchronous)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.relays: list = []

    def relay_for(self, answer: str, loss: float, seed: int) -> str:
        async def make():
            return await start_relay(host_candidate(answer), loss, seed)

        relay = asyncio.run_coroutine_threadsafe(make(), self.loop).result(10)
        self.relays.append(relay)
        return via_relay(answer, relay)

    def close(self) -> None:
        for relay in self.relays:
            self.loop.call_soon_threadsafe(relay.transport.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def longest_gap_ms(mic: np.ndarray, agent: np.ndarray, rate: int) -> float:
    """The longest run of silence (under -50 dBFS in 10 ms windows) in the echo where the
    microphone had speech (over -35 dBFS). The echo is found second by second (its delay may
    move by a frame when the server's jitter buffer drops or adds one), within 300 ms of its
    overall delay."""
    from scipy.signal import correlate

    overall = int(np.argmax(correlate(agent, mic, mode="full", method="fft"))) - (len(mic) - 1)
    window, block, reach = rate // 100, rate, int(0.3 * rate)
    longest = run = 0
    for start in range(0, len(mic) - block, block):
        ref = mic[start : start + block]
        lo = max(0, start + overall - reach)
        around = agent[lo : start + overall + block + reach]
        if len(around) < block or np.sqrt(np.mean(ref**2)) < 1e-3:
            lag = overall
        else:
            lag = lo + int(np.argmax(correlate(around, ref, mode="valid", method="fft"))) - start
        for w in range(start, start + block, window):
            if not 0 <= w + lag <= len(agent) - window:
                continue
            spoken = np.sqrt(np.mean(mic[w : w + window] ** 2)) > 10 ** (-35 / 20)
            heard = np.sqrt(np.mean(agent[w + lag : w + lag + window] ** 2)) > 10 ** (-50 / 20)
            run = run + 1 if spoken and not heard else 0
            longest = max(longest, run)
    return 10.0 * longest


def webrtc_call(server, microphone_wav: Path, *, seconds: float, loss: float = 0.0, seed: int = 1) -> dict:
    """One call from the page over WebRTC; returns the page's state, the recording and the relay."""
    from playwright.sync_api import sync_playwright

    relays = RelayLoop()
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=CHROMIUM,
                headless=True,
                args=[*FLAGS, *FAKE_MICROPHONE, f"--use-file-for-fake-audio-capture={microphone_wav}"],
            )
            try:
                page = browser.new_page()
                errors: list[str] = []
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                if loss:

                    def through_relay(route):
                        response = route.fetch()
                        if response.status != 201:
                            route.fulfill(response=response)
                            return
                        route.fulfill(response=response, body=relays.relay_for(response.text(), loss, seed))

                    page.route("**/api/whip?*", through_relay)
                page.goto(server.url + "/?transport=webrtc")
                assert page.input_value("#transport") == "webrtc"
                page.fill("#prompt", "You enjoy having a good conversation.")
                page.click("#connect")
                live = "window.personaplex.phase === 'live' || window.personaplex.error"
                page.wait_for_function(live, timeout=60_000)
                error = page.evaluate("window.personaplex.error")
                assert not error, error
                page.click("#record")
                page.wait_for_timeout(round(seconds * 1000))
                page.click("#record")
                page.wait_for_selector("#download:not([hidden])", timeout=10_000)
                state = page.evaluate("window.personaplex")
                stats_text = page.inner_text("#stats")
                transcript = page.inner_text("#transcript")
                recording, rate = sf.read(io.BytesIO(base64.b64decode(page.evaluate(READ_RECORDING))))
                page.click("#connect")  # hang up
                page.wait_for_function("window.personaplex.phase === 'ended'", timeout=10_000)
                return {
                    "state": state,
                    "stats_text": stats_text,
                    "transcript": transcript,
                    "recording": recording.astype(np.float32),
                    "rate": rate,
                    "errors": errors,
                    "relay": relays.relays[0] if relays.relays else None,
                    "page": page,
                }
            finally:
                browser.close()
    finally:
        relays.close()


def metric(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    line = name + (f"{{{wanted}}}" if wanted else "") + " "
    return sum(float(x[len(line) :]) for x in text.splitlines() if x.startswith(line))


def active(server) -> int:
    return httpx.get(server.url + "/healthz", timeout=10).json()["active"]


def wait_free(server) -> None:
    deadline = time.monotonic() + 20
    while active(server):
        assert time.monotonic() < deadline, "the slot was not freed after the hang-up"
        time.sleep(0.1)


def test_the_page_over_webrtc_hears_its_speech_with_meters_stats_and_recording(microphone_wav, artifacts_dir):
    with running_server("--max-sessions", "1") as server:
        call = webrtc_call(server, microphone_wav, seconds=8)
        wait_free(server)
        log = server.log()
    state = call["state"]
    assert call["errors"] == []
    assert state["transport"] == "webrtc" and state["metadata"]["transport"] == "webrtc"
    assert "Hello from the echo engine" in call["transcript"]
    assert state["levelPeaks"]["caller"] > 0.3 and state["levelPeaks"]["agent"] > 0.3
    stats = state["stats"]
    assert stats["rttMs"] is not None and stats["lossPct"] == 0
    assert stats["jitterBufferMs"] > 0 and stats["played"] > 24000 * 3
    assert "RTT" in call["stats_text"] and "jitter buffer" in call["stats_text"]
    recording, rate = call["recording"], call["rate"]
    assert rate == 24000 and recording.ndim == 2
    agent, mic = recording[:, 0], recording[:, 1]
    similarity = echo_similarity(mic, agent, rate=rate)
    assert similarity >= 0.8, similarity
    assert "whip" in log and "DELETE /api/whip/" in log


def test_the_webrtc_echo_stays_continuous_under_5_and_10_percent_packet_loss(microphone_wav):
    """Both levels in one test, one after the other: two Chromium calls at once on a small
    machine would measure the machine, not the loss."""
    for loss in (0.05, 0.10):
        with running_server("--max-sessions", "1") as server:
            call = webrtc_call(server, microphone_wav, seconds=10, loss=loss, seed=int(loss * 100))
            wait_free(server)
            metrics = httpx.get(server.url + "/metrics", timeout=10).text
            log = server.log().splitlines()
            ended = [line for line in log if "closed (" in line or "to keep the frame" in line]
        relay = call["relay"]
        assert relay is not None
        # The loss happened, both ways, about as asked.
        for direction in ("to_server", "to_client"):
            sent = relay.dropped[direction] + relay.forwarded[direction]
            assert relay.dropped[direction] >= 0.5 * loss * sent and sent > 200, relay.dropped
        assert call["state"]["stats"]["lossPct"] > 0  # the page saw it in getStats
        # The server counted the caller's losses and rebuilt some from Chromium's in-band FEC
        # (which Chromium adds once the server's receiver reports show loss).
        assert metric(metrics, "personaplex_webrtc_caller_lost_packets_total") > 0
        assert metric(metrics, "personaplex_webrtc_caller_filled_seconds_total", how="fec") > 0
        recording, rate = call["recording"], call["rate"]
        agent, mic = recording[:, 0], recording[:, 1]
        gap = longest_gap_ms(mic, agent, rate)
        similarity = echo_similarity(mic, agent, rate=rate)
        print(f"loss {loss:.0%}: longest gap {gap:.0f} ms, echo similarity {similarity:.3f}")
        assert gap <= 100, (loss, gap, ended, call["state"]["stats"])
        assert similarity >= 0.7, (loss, similarity, ended)
