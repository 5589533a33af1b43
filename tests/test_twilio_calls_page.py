"""The /calls page in real headless Chromium against `serve --twilio --records-dir`: a live
call's transcript grows on the page while the (simulated) call runs, and a past call's
recording plays in the page's audio player. Saves artifacts/calls_page.png."""

from __future__ import annotations

import asyncio
import re
import threading

import numpy as np
import pytest
from support_browser import CHROMIUM, FLAGS
from support_server import running_server
from support_twilio import TwilioSimulator, tone

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]

AUTH_TOKEN = "calls-page-auth-token"
API_TOKEN = "calls-page-api-token"
PERSONAS = (
    "default: desk\npersonas:\n  desk:\n    text_prompt: 'Verify customer name {customer_name}.'\n"
    "    variables: {customer_name: unknown}\n    record: true\n"
)


def run_call(sim: TwilioSimulator, seconds: float, done: threading.Event) -> None:
    """A simulated call in its own thread and event loop (the browser drives this one)."""

    async def call() -> None:
        call_sid, url, params = await asyncio.to_thread(
            lambda: sim.answer(query="customer_name=Omar%20Torres")
        )
        async with sim.media_stream(url, params, call_sid=call_sid) as live:
            await live.answered()
            await live.play(tone(440.0, seconds, 0.3))
            await live.play(np.zeros(4000, np.float32))

    try:
        asyncio.run(call())
    finally:
        done.set()


def test_calls_page_shows_a_live_transcript_and_plays_a_past_recording(tmp_path, artifacts_dir) -> None:
    from playwright.sync_api import sync_playwright

    personas = tmp_path / "personas.yaml"
    personas.write_text(PERSONAS)
    env = {
        "TWILIO_AUTH_TOKEN": AUTH_TOKEN,
        "TWILIO_ACCOUNT_SID": "",
        "PUBLIC_URL": "",
        "PERSONAPLEX_TWILIO_API_TOKEN": API_TOKEN,
        "PERSONAPLEX_TWILIO_PERSONAS_FILE": str(personas),
    }
    with (
        running_server("--twilio", "--records-dir", str(tmp_path / "records"), env=env) as server,
        sync_playwright() as pw,
    ):
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        caller: threading.Thread | None = None
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 1100})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{server.url}/calls#token={API_TOKEN}")
            page.wait_for_function("window.calls.polls > 0", timeout=60_000)
            assert "token=" not in page.url  # the key left the address bar

            done = threading.Event()
            caller = threading.Thread(
                target=run_call, args=(TwilioSimulator(server.url, AUTH_TOKEN), 5.0, done)
            )
            caller.start()
            page.wait_for_selector("#live tbody tr", timeout=60_000)
            page.click("#live tbody tr")
            # The echo engine's words come in while the call runs.
            page.wait_for_function("window.calls.transcript.includes('echo engine.')", timeout=60_000)
            assert not done.is_set(), "the call was over before its transcript showed"
            assert "Omar Torres" in (page.text_content("#detail-prompt") or "")
            live_text = page.inner_text("#transcript")
            assert "Hello from the echo engine." in live_text
            level = float(page.get_attribute("#live tbody tr .meter.caller", "aria-valuenow") or 0)
            assert level > 0.3  # the caller's 440 Hz tone at -10 dBFS
            slips = page.inner_text("#live tbody tr td:nth-child(8)")  # audio lost to keep the clock
            assert slips == "–" or re.fullmatch(r"(lost \d+ ms)?(, )?(\+\d+ ms silence)?", slips), slips
            page.screenshot(path=str(artifacts_dir / "calls_page_live.png"), full_page=True)

            assert done.wait(30)
            page.wait_for_selector("#past tbody tr", timeout=60_000)
            page.click("#past tbody tr")
            page.wait_for_function("window.calls.audioReady === true", timeout=60_000)
            duration = page.evaluate("document.getElementById('player').duration")
            assert 4.0 <= duration <= 8.0, duration
            # play() resolves once playback has started (or rejects, failing here with why).
            page.evaluate("document.getElementById('player').play().then(() => true)")
            page.wait_for_function("document.getElementById('player').currentTime > 0.5", timeout=90_000)
            assert len(page.inner_text("#transcript")) > len(live_text)  # the whole call now
            assert "Audio lost to keep the clock" in page.inner_text("#detail-facts")
            page.screenshot(path=str(artifacts_dir / "calls_page.png"), full_page=True)
            assert not errors, errors
        finally:
            if caller is not None:
                caller.join(30)
            browser.close()
