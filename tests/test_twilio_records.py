"""Call records and recordings under `serve --twilio --records-dir`, end to end.

A 10 s call with recording on leaves a stereo WAV of the call as the caller heard it (caller
left, agent right) and a record whose transcript is the agent's text frame by frame, both served
behind the API key. A server killed mid-call leaves a readable partial recording and record,
which the next server serves (marked "interrupted").
"""

from __future__ import annotations

import asyncio
import io
import json
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
from support_server import running_server
from support_twilio import RATE, TwilioSimulator

from personaplex_voice.audio.mulaw import ulaw_decode
from personaplex_voice.process.engine_loader import ECHO_TEXT

pytestmark = pytest.mark.timeout(120)

AUTH_TOKEN = "records-test-auth-token"
API_TOKEN = "records-test-api-token"
AUTH = {"Authorization": f"Bearer {API_TOKEN}"}
PERSONAS = "default: desk\npersonas:\n  desk:\n    text_prompt: 'You answer for Acme.'\n    record: true\n"


def env_for(tmp_path: Path) -> dict[str, str]:
    personas = tmp_path / "personas.yaml"
    personas.write_text(PERSONAS)
    return {
        "TWILIO_AUTH_TOKEN": AUTH_TOKEN,
        "TWILIO_ACCOUNT_SID": "",
        "PUBLIC_URL": "",
        "PERSONAPLEX_TWILIO_API_TOKEN": API_TOKEN,
        "PERSONAPLEX_TWILIO_PERSONAS_FILE": str(personas),
    }


def speechlike(seconds: float, seed: int = 3) -> np.ndarray:
    """Band-limited noise with a syllable-rate envelope: broadband, so correlation finds its lag."""
    rng = np.random.default_rng(seed)
    n = round(seconds * RATE)
    noise = np.convolve(rng.standard_normal(n), np.hanning(9) / 4, "same")
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 3.0 * np.arange(n) / RATE)
    return (0.3 * noise * envelope).astype(np.float32)


def blockwise_correlation(
    ours: np.ndarray, theirs: np.ndarray, block_s: float = 1.0, max_lag_s: float = 0.25
) -> float:
    """Mean over 1 s blocks of each block's best normalized correlation within ±`max_lag_s`.

    Our recording places the agent's audio by the server's model of Twilio's buffer; the
    simulator by when its own (busy, shared-CPU) event loop got each message. Under load the two
    timelines drift apart by tens of ms, so each block is aligned on its own."""
    from scipy.signal import correlate

    block, lag = round(block_s * RATE), round(max_lag_s * RATE)
    scores = []
    for start in range(lag, min(len(ours), len(theirs)) - block - lag, block):
        a = ours[start : start + block]
        b = theirs[start - lag : start + block + lag]
        c = correlate(b, a, mode="valid")
        energy = np.sqrt(np.convolve(b**2, np.ones(block), "valid"))
        denom = np.linalg.norm(a) * energy
        if np.linalg.norm(a) > 0:
            scores.append(float(np.max(c / np.maximum(denom, 1e-12))))
    return float(np.mean(scores)) if scores else 0.0


async def call_for(sim: TwilioSimulator, seconds: float):
    """A call of `seconds` in all (the first part silence until the agent answers)."""
    call_sid, url, params = await asyncio.to_thread(sim.answer)
    async with sim.media_stream(url, params, call_sid=call_sid) as call:
        call.keep_sent = True
        await call.answered()
        left = round(seconds * RATE) - len(call.sent)
        await call.play(speechlike(left / RATE))
    return call_sid, call


async def test_a_recorded_call_is_stereo_as_heard_with_its_transcript(tmp_path) -> None:
    records = tmp_path / "records"
    with running_server("--twilio", "--records-dir", str(records), env=env_for(tmp_path)) as server:
        sim = TwilioSimulator(server.url, AUTH_TOKEN)
        call_sid, call = await call_for(sim, 10.0)
        for _ in range(100):  # the record is closed as the stream ends
            record = (
                await asyncio.to_thread(httpx.get, f"{server.url}/twilio/calls/{call_sid}", headers=AUTH)
            ).json()
            if not record["live"]:
                break
            await asyncio.sleep(0.05)
        wav = await asyncio.to_thread(
            httpx.get, f"{server.url}/twilio/calls/{call_sid}/recording", headers=AUTH
        )
        unauthorized = await asyncio.to_thread(httpx.get, f"{server.url}/twilio/calls/{call_sid}/recording")
    assert unauthorized.status_code == 401
    assert wav.status_code == 200 and wav.headers["content-type"] == "audio/wav"
    audio, rate = sf.read(io.BytesIO(wav.content), dtype="float32")
    assert rate == RATE and audio.shape[1] == 2
    assert abs(len(audio) / RATE - 10.0) <= 0.2, len(audio) / RATE
    assert abs(record["recording_s"] - len(audio) / RATE) < 1e-3
    # Left: what the caller sent, sample for sample (μ-law both ways).
    sent = ulaw_decode(bytes(call.sent))
    assert len(call.sent) == 10 * RATE and np.array_equal(audio[: len(sent), 0], sent[: len(audio)])
    # Right: what the caller heard, where the caller heard it.
    heard = call.played_audio()
    n = min(len(heard), len(audio))
    assert blockwise_correlation(audio[:n, 1], heard[:n]) >= 0.8
    # The transcript is the agent's text, one piece per engine frame, in order.
    pieces = record["transcript"]
    frames = record["metrics"]["session"]["frames_out"]
    assert [p["frame"] for p in pieces] == list(range(len(pieces)))
    assert [p["text"] for p in pieces] == [ECHO_TEXT[i % len(ECHO_TEXT)] for i in range(len(pieces))]
    assert frames - 3 <= len(pieces) <= frames and len(pieces) >= 110
    assert all(0 <= p["t"] <= 10.5 for p in pieces)
    on_disk = json.loads((records / call_sid / "record.json").read_text())
    assert on_disk["transcript"] == pieces and on_disk["live"] is False and on_disk["end_reason"] == "stop"


async def test_a_killed_server_leaves_a_readable_partial_recording_and_record(tmp_path) -> None:
    records = tmp_path / "records"
    env = env_for(tmp_path)
    with running_server("--twilio", "--records-dir", str(records), env=env) as server:
        sim = TwilioSimulator(server.url, AUTH_TOKEN)
        call_sid, url, params = await asyncio.to_thread(sim.answer)
        async with sim.media_stream(url, params, call_sid=call_sid) as call:
            await call.answered()
            await call.play(speechlike(3.0))
            killed_at = time.monotonic() - call.t0
            server.process.kill()  # SIGKILL: nothing of ours runs after this
            server.process.wait(10)
            await asyncio.wait_for(call.closed.wait(), 10)
    folder = records / call_sid
    record = json.loads((folder / "record.json").read_text())
    assert record["live"] is True and record["prompt"] == "You answer for Acme."
    audio, rate = sf.read(folder / "recording.wav", dtype="float32")
    assert rate == RATE and audio.shape[1] == 2
    assert killed_at - 2.5 <= len(audio) / RATE <= killed_at  # at most a second or two lost
    lines = (folder / "events.jsonl").read_text().splitlines()
    assert len(lines) >= 10 and json.loads(lines[0])["kind"] == "text"
    # The next server serves what the killed one left.
    with running_server("--twilio", "--records-dir", str(records), env=env) as again:
        listing = httpx.get(f"{again.url}/twilio/calls", headers=AUTH).json()
        assert call_sid in [c["call_sid"] for c in listing["earlier_calls"]]
        served = httpx.get(f"{again.url}/twilio/calls/{call_sid}", headers=AUTH).json()
        wav = httpx.get(f"{again.url}/twilio/calls/{call_sid}/recording", headers=AUTH)
    assert served["interrupted"] is True and len(served["transcript"]) >= 10
    assert [p["text"] for p in served["transcript"][:3]] == list(ECHO_TEXT[:3])
    assert wav.status_code == 200 and len(wav.content) == (folder / "recording.wav").stat().st_size


def test_call_records_need_the_api_key_and_a_real_sid(tmp_path) -> None:
    with running_server("--twilio", "--records-dir", str(tmp_path / "r"), env=env_for(tmp_path)) as server:
        assert httpx.get(f"{server.url}/twilio/calls/CA{'0' * 32}").status_code == 401
        assert httpx.get(f"{server.url}/twilio/calls/CA{'0' * 32}", headers=AUTH).status_code == 404
        assert httpx.get(f"{server.url}/twilio/calls/..%2F..%2Fetc", headers=AUTH).status_code == 404
        assert httpx.get(f"{server.url}/twilio/calls/CA{'0' * 32}/recording", headers=AUTH).status_code == 404


def test_retention_removes_the_oldest_records_first(tmp_path) -> None:
    import os

    from personaplex_phone.records import RecordStore

    store = RecordStore(tmp_path, max_age_s=3600, max_bytes=2500)
    now = time.time()
    for i, age_s in enumerate([7200, 30, 20, 10]):  # one too old, then three of 1 kB each
        folder = tmp_path / f"CA{i:032d}"
        folder.mkdir()
        (folder / "recording.wav").write_bytes(b"x" * 1000)
        os.utime(folder / "recording.wav", (now - age_s, now - age_s))
    live = f"CA{1:032d}"
    assert store.sweep(keep={live}) == 2  # the too old one, then the oldest that is not live
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"CA{1:032d}", f"CA{3:032d}"]
