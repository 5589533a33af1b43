"""Asterisk end to end: a simulated Asterisk (personaplex_asterisk.simulate, written from the
published AudioSocket and chan_websocket protocols) against the real
`personaplex-voice serve --engine echo --carriers asterisk --audiosocket 127.0.0.1:PORT` under
uvicorn. Everything on 127.0.0.1.

Per mode: a call without a valid API key or UUID is refused; a call echoes (similarity >= 0.8)
at its rate; barge-in stops our sending within one message (AudioSocket) or sends FLUSH_MEDIA
(chan_websocket); a DTMF key fires its action, which the dialplan then reads; a hang-up frees
the slot; 16 kHz keeps the band above 4 kHz that 8 kHz loses; MEDIA_XOFF pauses our sending and
MEDIA_XON resumes it, the call going on; the record and the post-call webhook carry the call id.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import aiohttp
import numpy as np
import pytest
from personaplex_asterisk import audiosocket as asock
from personaplex_asterisk import media_ws
from personaplex_asterisk.simulate import AsteriskSimulator
from scipy.signal import resample_poly
from support_server import ServerProcess, free_port, running_server
from support_twilio import HttpSink

pytestmark = pytest.mark.timeout(180)

API_KEY = "asterisk-test-api-key"
SECRET = "asterisk-webhook-secret"
SLOTS = 3
PERSONAS = """
default: desk
personas:
  desk:
    text_prompt: "You answer for Acme."
    webhook_url: SINK
    actions:
      - on_dtmf: "0"
        do: transfer
        to: "+15551230099"
        announce: "Connecting you to a colleague."
      - on_dtmf: "5"
        do: play
        say: "One moment please."
        then: resume
"""


@dataclass
class Rig:
    server: ServerProcess
    audiosocket: tuple[str, int]
    sink: HttpSink

    def simulator(self) -> AsteriskSimulator:
        return AsteriskSimulator(self.server.url, API_KEY, self.audiosocket)


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    with HttpSink() as sink:
        personas = tmp_path_factory.mktemp("asterisk") / "personas.yaml"
        personas.write_text(PERSONAS.replace("SINK", sink.url + "/calls"))
        env = {
            "PERSONAPLEX_PHONE_API_TOKEN": API_KEY,
            "PERSONAPLEX_PHONE_PERSONAS_FILE": str(personas),
            "PERSONAPLEX_PHONE_WEBHOOK_SECRET": SECRET,
            "PUBLIC_URL": "",
        }
        port = free_port()
        args = ("--carriers", "asterisk", "--audiosocket", f"127.0.0.1:{port}", "--max-sessions", str(SLOTS))
        with running_server(*args, env=env) as server:
            yield Rig(server, ("127.0.0.1", port), sink)
            log = server.log()
        # Callers that hang up, garbage, refusals: warnings at most, never a traceback.
        assert "Traceback" not in log and " ERROR " not in log, log[-3000:]


@pytest.fixture
async def sim(rig: Rig) -> AsyncIterator[AsteriskSimulator]:
    simulator = rig.simulator()
    yield simulator
    await simulator.close()


# --- helpers ---------------------------------------------------------------------------------------


def noise(seconds: float, rate: int, seed: int = 1, smooth: int = 7) -> np.ndarray:
    """Broadband noise (a correlation probe that matches itself at one lag only), low-passed a
    little so the phone path's resamplers keep nearly all of it."""
    rng = np.random.default_rng(seed)
    x = np.convolve(rng.standard_normal(round(seconds * rate)), np.hanning(smooth), "same")
    return (0.25 * x / np.sqrt(np.mean(x**2))).astype(np.float32)


def tone(freq: float, seconds: float, rate: int, amplitude: float = 0.3) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    return (amplitude * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def echo_similarity(sent: np.ndarray, heard: np.ndarray, rate: int, block_s: float = 0.25) -> float:
    """How much of `sent` came back: the echo's place by cross-correlation, then each block's
    best normalized correlation within ±40 ms of it (a machine that stalls now and then shifts
    later blocks a little), averaged."""
    n = len(sent)
    spectrum = np.fft.rfft(heard, len(heard) + n) * np.conj(np.fft.rfft(sent, len(heard) + n))
    lag = int(np.argmax(np.fft.irfft(spectrum)[: max(1, len(heard) - n + 1)]))
    block, slack = round(block_s * rate), round(0.040 * rate)
    scores = []
    for start in range(0, n - block + 1, block):
        a = sent[start : start + block]
        best = 0.0
        for shift in range(-slack, slack + 1, 2):
            at = lag + start + shift
            if at < 0 or at + block > len(heard):
                continue
            b = heard[at : at + block]
            denom = float(np.linalg.norm(a) * np.linalg.norm(b))
            if denom > 0:
                best = max(best, float(np.dot(a, b)) / denom)
        scores.append(best)
    return float(np.mean(scores)) if scores else 0.0


def high_band_share(pcm: np.ndarray, rate: int) -> float:
    """The share of the energy between 100 Hz and 7 kHz that lies above 4 kHz."""
    spectrum = np.abs(np.fft.rfft(pcm.astype(np.float64))) ** 2
    freqs = np.fft.rfftfreq(len(pcm), 1 / rate)
    total = spectrum[(freqs >= 100) & (freqs <= 7000)].sum()
    return float(spectrum[(freqs > 4000) & (freqs <= 7000)].sum() / max(total, 1e-20))


async def state(rig: Rig) -> dict:
    async with (
        aiohttp.ClientSession() as session,
        session.get(rig.server.url + "/asterisk/calls", headers={"Authorization": f"Bearer {API_KEY}"}) as r,
    ):
        assert r.status == 200
        return await r.json()


async def wait_idle(rig: Rig, timeout: float = 15.0) -> dict:
    """Until no session runs and no slot is reserved (the calls' slots are free again)."""
    found: dict = {}
    for _ in range(int(timeout / 0.05)):
        found = await state(rig)
        if found["active_sessions"] == 0 and found["reserved"] == 0:
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"slots not freed: {found}")


async def record_of(rig: Rig, call_id: str, timeout: float = 10.0) -> dict:
    """The ended call's record (once the stream's end has closed it)."""
    url = f"{rig.server.url}/asterisk/calls/{call_id}"
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as session:
        for _ in range(int(timeout / 0.05)):
            async with session.get(url) as response:
                record = await response.json()
            if response.status == 200 and not record.get("live", True):
                return record
            await asyncio.sleep(0.05)
    raise AssertionError(f"no ended record of {call_id}")


async def new_call(sim: AsteriskSimulator, **kw) -> dict:
    status, answer = await sim.ask(**kw)
    assert status == 200 and answer["uuid"], answer
    return answer


# --- refused without a valid key or UUID ------------------------------------------------------------


async def test_post_calls_needs_the_api_key(rig, sim) -> None:
    for key in ("", "wrong-key"):
        status, _ = await sim.ask(api_key=key)
        assert status == 403
    assert (await state(rig))["reserved"] == 0
    status, _ = await sim.next_step("5bd9b4b4-9d6a-4b87-9f5e-2c0f0b5e8a11", api_key="wrong")
    assert status == 401
    status, _ = await sim.next_step("5bd9b4b4-9d6a-4b87-9f5e-2c0f0b5e8a11")
    assert status == 404


async def test_audiosocket_refuses_an_unknown_or_used_uuid(rig, sim) -> None:
    # A UUID we never handed out: AudioSocket's hang-up, the socket closed, no session.
    async with sim.audiosocket_call("5bd9b4b4-9d6a-4b87-9f5e-2c0f0b5e8a11") as call:
        await asyncio.wait_for(call.closed.wait(), 10)
    assert call.hung_up_by_server and call.received_messages == 0
    # A connection that does not start with its UUID.
    reader, writer = await asyncio.open_connection(*rig.audiosocket)
    writer.write(asock.encode(asock.KIND_SLIN, bytes(320)))
    assert await asyncio.wait_for(reader.read(), 10) == asock.HANGUP
    writer.close()
    # A good UUID opens one stream, once.
    answer = await new_call(sim)
    async with sim.audiosocket_call(answer["uuid"]) as call:
        await call.answered()
    async with sim.audiosocket_call(answer["uuid"]) as again:
        await asyncio.wait_for(again.closed.wait(), 10)
    assert again.hung_up_by_server and again.received_messages == 0
    await wait_idle(rig)


async def test_chan_websocket_refuses_a_missing_or_unknown_ticket(rig, sim) -> None:
    for ticket in ("", "5bd9b4b4-9d6a-4b87-9f5e-2c0f0b5e8a11", "not-a-uuid"):
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            async with sim.websocket_call(ticket):
                pass
        assert refused.value.status == 403
    await wait_idle(rig)


async def test_one_reservation_per_call_however_often_the_dialplan_asks(rig, sim) -> None:
    first = await new_call(sim, call_id="1712345678.900")
    again = await new_call(sim, call_id="1712345678.900")
    assert again["uuid"] == first["uuid"]
    assert (await state(rig))["reserved"] == 1
    async with sim.websocket_call(first["uuid"], in_path=True) as call:  # the ticket as the path's end
        await call.answered()
    await wait_idle(rig)


# --- audio --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rate", "numbering"),
    [(8000, "asterisk"), (16000, "asterisk"), (16000, "first")],
    ids=["8k", "16k", "16k-0x11"],
)
async def test_audiosocket_echoes_at_its_rate(rig, sim, rate, numbering) -> None:
    answer = await new_call(sim)
    signal = noise(1.5, rate)
    async with sim.audiosocket_call(answer["uuid"], rate=rate, numbering=numbering) as call:
        primed = await call.answered()
        await call.play(signal)
        await call.play(np.zeros(rate // 2, np.float32))
        await call.hangup()
    heard = call.heard_audio()[primed:]
    similarity = echo_similarity(signal, heard, rate)
    assert similarity >= 0.8, f"echo similarity {similarity:.3f} at {rate} Hz"
    record = await record_of(rig, answer["call_id"])
    assert record["metrics"]["audio_in"] == f"L16 {rate // 1000:g} kHz little-endian"
    assert record["end_reason"] == "stop" and record["carrier"] == "asterisk"
    kind = 0x11 if numbering == "first" else {8000: 0x10, 16000: 0x12}[rate]
    assert call.received_kinds == {kind}  # our audio goes back in the kind that came
    assert f"kind 0x{kind:02x} = {rate} Hz" in rig.server.log()
    await wait_idle(rig)


@pytest.mark.parametrize("control", [media_ws.PLAIN, media_ws.JSON])
async def test_chan_websocket_echoes_at_16k_in_either_control_format(rig, sim, control) -> None:
    answer = await new_call(sim)
    signal = noise(1.5, 16000)
    async with sim.websocket_call(answer["uuid"], "slin16", control) as call:
        assert call.ws is not None and call.ws.protocol == "media"  # the subprotocol it offered
        primed = await call.answered()
        await call.play(signal)
        await call.play(np.zeros(8000, np.float32))
    similarity = echo_similarity(signal, call.heard_audio()[primed:], 16000)
    assert similarity >= 0.8, f"echo similarity {similarity:.3f}"
    names = {name for name, _ in call.commands}
    assert "MARK_MEDIA" in names and call.marks_processed  # answered, in the format it came in
    record = await record_of(rig, answer["call_id"])
    # Our pacing kept Asterisk's queue of ours at ~60 ms, never past 100 ms; its marks came back.
    assert record["metrics"]["max_queued_ms_model"] <= 101 and record["metrics"]["marks_acked"] >= 10
    await wait_idle(rig)


async def test_16k_keeps_the_band_above_4k_that_8k_loses(rig, sim) -> None:
    source = noise(1.5, 16000, seed=7, smooth=1)  # white: half its energy above 4 kHz
    shares = {}
    for mode in ("audiosocket-16k", "websocket-16k", "audiosocket-8k"):
        answer = await new_call(sim)
        rate = 8000 if mode.endswith("8k") else 16000
        sent = source if rate == 16000 else resample_poly(source, 1, 2).astype(np.float32)
        opened = (
            sim.websocket_call(answer["uuid"], "slin16")
            if mode.startswith("websocket")
            else sim.audiosocket_call(answer["uuid"], rate=rate)
        )
        async with opened as call:
            primed = await call.answered()
            await call.play(sent)
            await call.play(np.zeros(rate // 2, np.float32))
        heard = call.heard_audio()[primed:]
        if rate == 8000:
            heard = resample_poly(heard, 2, 1)
        shares[mode] = high_band_share(heard, 16000)
    print("energy above 4 kHz:", {k: round(v, 3) for k, v in shares.items()})
    assert shares["audiosocket-16k"] >= 0.25 and shares["websocket-16k"] >= 0.25
    assert shares["audiosocket-8k"] <= 0.02
    await wait_idle(rig)


# --- barge-in -------------------------------------------------------------------------------------------


def talk_over_the_agent(rate: int) -> list[np.ndarray]:
    """The caller says something, pauses 40 ms, and starts again while the echo of the first
    is still playing: a talk spurt that starts over the agent."""
    return [tone(440.0, 0.6, rate), np.zeros(rate // 25, np.float32), tone(660.0, 0.6, rate)]


async def test_audiosocket_barge_in_stops_sending_within_one_message(rig, sim) -> None:
    answer = await new_call(sim)
    async with sim.audiosocket_call(answer["uuid"], rate=16000) as call:
        await call.answered()
        for part in talk_over_the_agent(16000):
            await call.play(part)
        await call.play(np.zeros(8000, np.float32))
    metrics = (await record_of(rig, answer["call_id"]))["metrics"]
    assert metrics["barge_ins"] >= 1
    assert metrics["barge_in_sent_after"] <= 1  # what was on its way; nothing after it
    await wait_idle(rig)


async def test_chan_websocket_barge_in_sends_flush_media(rig, sim) -> None:
    answer = await new_call(sim)
    async with sim.websocket_call(answer["uuid"], "slin16", media_ws.JSON) as call:
        await call.answered()
        first, pause, second = talk_over_the_agent(16000)
        await call.play(first)
        await call.play(pause)
        before = len(call.commands)
        await call.play(second)
        await call.play(np.zeros(8000, np.float32))
    later = [name for name, _ in call.commands[before:]]
    assert "FLUSH_MEDIA" in later and call.flushes >= 1
    metrics = (await record_of(rig, answer["call_id"]))["metrics"]
    assert metrics["barge_ins"] >= 1 and metrics["barge_in_sent_after"] <= 1
    # The flush dropped the marks queued behind it: they were never answered, and never waited for.
    assert metrics["marks_acked"] < metrics["marks_sent"]
    await wait_idle(rig)


# --- DTMF actions, the dialplan's next step, hang-up ------------------------------------------------------


@pytest.mark.parametrize("mode", ["audiosocket", "websocket"])
async def test_a_dtmf_key_transfers_through_the_dialplan(rig, sim, mode) -> None:
    answer = await new_call(sim)
    opened = (
        sim.audiosocket_call(answer["uuid"]) if mode == "audiosocket" else sim.websocket_call(answer["uuid"])
    )
    async with opened as call:
        await call.answered()
        await call.dtmf("0")
        talker = asyncio.create_task(call.play(np.zeros(8000 * 5, np.float32)))
        await asyncio.wait_for(call.closed.wait(), 10)  # our leg ends: the dialplan goes on
        talker.cancel()
    if mode == "audiosocket":
        assert call.hung_up_by_server  # AudioSocket's hang-up message: AudioSocket() returns
    else:
        assert call.close_code == 1000
    status, step = await sim.next_step(answer["uuid"])
    assert status == 200
    assert step["action"] == "transfer" and step["target"] == "+15551230099"
    assert step["say"] == "Connecting you to a colleague." and step["call_id"] == answer["call_id"]
    record = await record_of(rig, answer["call_id"])
    (action,) = record["actions"]
    assert action["ok"] and action["trigger"] == "dtmf 0" and action["action"] == "transfer"
    await wait_idle(rig)


async def test_play_then_resume_comes_back_to_the_same_conversation(rig, sim) -> None:
    """A `play … then: resume` key: our leg ends, the dialplan says the words and connects back
    with the new UUID of its next step, and the same session goes on (one call, one record)."""
    answer = await new_call(sim)
    async with sim.audiosocket_call(answer["uuid"], rate=16000) as first:
        await first.answered()
        await first.dtmf("5")
        talker = asyncio.create_task(first.play(np.zeros(16000 * 5, np.float32)))
        await asyncio.wait_for(first.closed.wait(), 10)
        talker.cancel()
    assert first.hung_up_by_server
    status, step = await sim.next_step(answer["uuid"])
    assert status == 200 and step["action"] == "agent" and step["say"] == "One moment please."
    assert step["uuid"] and step["uuid"] != answer["uuid"]
    assert (await state(rig))["active_sessions"] == 1  # parked: the conversation waits
    signal = noise(1.0, 16000)
    async with sim.websocket_call(step["uuid"]) as second:  # back in either mode
        primed = await second.answered()
        await second.play(signal)
        await second.play(np.zeros(8000, np.float32))
    assert echo_similarity(signal, second.heard_audio()[primed:], 16000) >= 0.8
    record = await record_of(rig, answer["call_id"])
    statuses = [s["status"] for s in record["statuses"]]
    assert "stream-resumed" in statuses and record["end_reason"] == "stop"
    (action,) = record["actions"]
    assert action["ok"] and action["action"] == "play"
    async with sim.audiosocket_call(step["uuid"]) as again:  # the UUID was for one leg
        await asyncio.wait_for(again.closed.wait(), 10)
    assert again.hung_up_by_server and again.received_messages == 0
    await wait_idle(rig)


@pytest.mark.parametrize("how", ["hangup-message", "close", "error", "websocket-close"])
async def test_hanging_up_frees_the_slot(rig, sim, how) -> None:
    answer = await new_call(sim)
    opened = (
        sim.websocket_call(answer["uuid"])
        if how == "websocket-close"
        else sim.audiosocket_call(answer["uuid"])
    )
    async with opened as call:
        await call.answered()
        assert (await state(rig))["active_sessions"] == 1
        if how == "error":
            await call.send_error(0x01)  # Asterisk: the calling party hung up
        elif how == "close":
            call.close()  # the socket closes without a word: as good as a hang-up
        else:
            await call.hangup()
    await wait_idle(rig)
    record = await record_of(rig, answer["call_id"])
    assert record["end_reason"] == "stop" and record["call_sid"] == answer["call_id"]
    status, step = await sim.next_step(answer["call_id"])
    assert status == 200 and step["action"] == "hangup"


async def test_the_post_call_webhook_carries_the_call_id(rig, sim) -> None:
    answer = await new_call(sim, call_id="pbx1-1712345678.55")
    async with sim.websocket_call(answer["uuid"]) as call:
        await call.answered()
        await call.play(np.zeros(8000, np.float32))
    for _ in range(200):
        bodies = [json.loads(r.body) for r in rig.sink.received]
        mine = [b for b in bodies if b.get("call_sid") == "pbx1-1712345678.55"]
        if mine:
            break
        await asyncio.sleep(0.05)
    assert mine and mine[0]["carrier"] == "asterisk" and mine[0]["end_reason"] == "stop"
    await wait_idle(rig)


# --- flow control -----------------------------------------------------------------------------------


async def test_media_xoff_pauses_our_sending_and_xon_resumes_it(rig, sim) -> None:
    answer = await new_call(sim)
    async with sim.websocket_call(answer["uuid"], "slin16", media_ws.JSON) as call:
        await call.answered()
        talker = asyncio.create_task(call.play(noise(8.0, 16000)))
        await asyncio.sleep(0.5)
        await call.xoff()
        await asyncio.sleep(0.5)  # what was already on its way arrives meanwhile
        paused_at = call.received_messages
        await asyncio.sleep(1.0)
        during_pause = call.received_messages - paused_at
        await call.xon()
        for _ in range(200):
            if call.received_messages >= paused_at + during_pause + 10:
                break
            await asyncio.sleep(0.05)
        resumed = call.received_messages - paused_at - during_pause
        talker.cancel()
        assert not call.closed.is_set()  # the call went on
    assert during_pause == 0 and resumed >= 10
    record = await record_of(rig, answer["call_id"])
    assert record["end_reason"] == "stop"
    assert record["metrics"]["flow_pauses"] == 1 and record["metrics"]["flow_paused_ms"] >= 1000
    await wait_idle(rig)


# --- the simulator as a user runs it ---------------------------------------------------------------


async def test_a_simulated_call_from_the_command_line(rig, tmp_path) -> None:
    """`python -m personaplex_asterisk.simulate` (what `phone simulate --carrier asterisk` runs):
    an AudioSocket call saying a WAV, a key pressed, the dialplan's next step printed."""
    import subprocess
    import sys

    import soundfile as sf

    wav, out = tmp_path / "hello.wav", tmp_path / "heard.wav"
    sf.write(wav, noise(1.0, 24000), 24000)
    host, port = rig.audiosocket
    command = [
        sys.executable, "-m", "personaplex_asterisk.simulate", "--url", rig.server.url, "--wav", str(wav),
        "--mode", "audiosocket", "--audiosocket", f"{host}:{port}", "--rate", "16000",
        "--dtmf", "0@0.6", "--api-key", API_KEY, "--out", str(out),
    ]  # fmt: skip
    done = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["mode"] == "audiosocket" and summary["kind"] == "0x12" and summary["dtmf"] == "0"
    assert summary["ended_by"] == "server" and summary["next_step"]["action"] == "transfer"
    heard, rate = sf.read(out)
    assert rate == 16000 and len(heard) > 0.3 * rate
    await wait_idle(rig)


async def test_the_simulator_websocket_mode_with_json_control(rig) -> None:
    from personaplex_asterisk.simulate import simulate_call

    said = noise(1.0, 24000)
    summary, heard, rate = await simulate_call(rig.server.url, API_KEY, said, control=media_ws.JSON)
    assert summary["subprotocol"] == "media" and summary["marks_processed"] >= 5
    assert rate == 16000 and summary["ended_by"] == "caller" and summary["next_step"]["action"] == "hangup"
    assert echo_similarity(resample_poly(said, 2, 3), heard, 16000) >= 0.8  # the WAV came back
    await wait_idle(rig)
