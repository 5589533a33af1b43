"""The browser client in real headless Chromium against the real echo server: the page loads,
captures a (fake) microphone, speaks Ogg-Opus made by WebCodecs + our JS Ogg muxer over
/api/chat (a long persona going by POST /api/prompts), plays the echo through its AudioWorklet,
moves a level meter for the caller and one for the agent, shows the transcript and the server's
info, records the call as a stereo wav, and says in words when the server is full."""

from __future__ import annotations

import base64
import io
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from support_browser import CHROMIUM, FAKE_MICROPHONE, FLAGS
from support_server import running_server

pytestmark = pytest.mark.browser

SPEECH = "Hello there. I would like to talk about the weather today. It is sunny and warm."
LONG_PROMPT = (
    "你是一位睿智而友善的老师。请用清楚而有趣的方式回答问题。" * 80
)  # 2,000 characters, ~18 KB as a URL

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


def test_browser_call_plays_echo_shows_text_and_records(microphone_wav, artifacts_dir):
    from playwright.sync_api import sync_playwright

    with running_server("--max-sessions", "1") as server, sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[*FLAGS, *FAKE_MICROPHONE, f"--use-file-for-fake-audio-capture={microphone_wav}"],
        )
        try:
            page = browser.new_page()
            page_errors: list[str] = []
            page.on("pageerror", lambda exc: page_errors.append(str(exc)))
            page.goto(server.url + "/")

            # The four presets and the server's voices.
            assert page.locator("#presets button").all_inner_texts() == [
                "Assistant",
                "Customer service",
                "Casual",
                "Astronaut",
            ]
            # The echo engine's voices: its own two and the 18 published names, plus the default.
            page.wait_for_function("document.querySelectorAll('#voice option').length === 21", timeout=15_000)
            page.click("#presets button:has-text('Astronaut')")
            assert "astronaut" in page.input_value("#prompt")
            # A persona too long for a URL once percent-encoded: the page stores it first.
            page.fill("#prompt", LONG_PROMPT)
            page.select_option("#voice", "LOOPM0")

            page.click("#connect")
            page.wait_for_function("window.personaplex.phase === 'live'", timeout=30_000)
            page.click("#record")
            # The worklet played the agent's audio (the echo of the fake microphone).
            page.wait_for_function("window.personaplex.stats.played > 24000 * 1.5", timeout=30_000)
            page.wait_for_function("window.personaplex.transcript.includes('echo engine')", timeout=10_000)
            # Both meters moved: the caller's with the fake microphone, the agent's with its echo.
            page.wait_for_function(
                "window.personaplex.levelPeaks.caller > 0.3 && window.personaplex.levelPeaks.agent > 0.3",
                timeout=15_000,
            )
            readings = set()
            for _ in range(20):
                readings.add(page.get_attribute("#meter-agent", "aria-valuenow"))
                page.wait_for_timeout(50)
            assert len(readings) > 2, readings  # it follows the audio, not stuck at one value
            assert page.eval_on_selector("#meter-caller .bar", "e => parseFloat(e.style.width)") >= 0
            page.click("#record")  # stop: the download link appears
            page.wait_for_selector("#download:not([hidden])", timeout=10_000)

            state = page.evaluate("window.personaplex")
            assert state["stats"]["sentBytes"] > 1000  # microphone audio went out as Ogg-Opus
            assert state["metadata"]["voice"] == "LOOPM0"
            assert "personaplex-voice" in page.inner_text("#stat-server")  # instance and build shown
            assert "seed" in page.inner_text("#stat-sampling")
            assert "Hello from the echo engine" in page.inner_text("#transcript")
            assert page.inner_text("#stat-played").endswith(" s")

            recording, rate = sf.read(io.BytesIO(base64.b64decode(page.evaluate(READ_RECORDING))))
            assert rate == 24000 and recording.ndim == 2 and recording.shape[1] == 2
            agent_rms, user_rms = np.sqrt((recording**2).mean(axis=0))
            assert user_rms > 0.01  # the microphone, right channel
            assert agent_rms > 0.005  # the echo the worklet played, left channel

            # A second caller while the only slot is taken is told so, in words.
            second = browser.new_page()
            second.goto(server.url + "/")
            second.click("#connect")
            second.wait_for_function("window.personaplex.error", timeout=30_000)
            assert "full" in second.inner_text("#error")
            second.close()

            page.screenshot(path=str(artifacts_dir / "browser-echo-call.png"), full_page=True)
            page.click("#connect")  # hang up
            page.wait_for_function("window.personaplex.phase === 'ended'", timeout=10_000)
            assert page_errors == []
        finally:
            browser.close()
