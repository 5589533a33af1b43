"""A phone call to the real engine (the tiny golden model on CPU) through `serve --twilio`.

The caller speaks the golden user audio; the agent's audio must stream back for the whole call
as Twilio expects it: one `media` per its length on average (40 ms by default:
PERSONAPLEX_TWILIO_MESSAGE_MS), never a gap over 100 ms.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
from support_server import running_server
from support_twilio import RATE, TwilioSimulator

from personaplex_voice.audio.io import read_audio
from personaplex_voice.audio.resample import resample

AUTH_TOKEN = "golden-test-auth-token"


async def test_golden_model_call_streams_in_real_time(golden_dir) -> None:
    user = resample(read_audio(golden_dir / "user.wav"), 24000, RATE)  # 5.6 s of the caller
    # One torch thread: the tiny model needs no more, and CI runs other tests beside this one.
    env = {
        "TWILIO_AUTH_TOKEN": AUTH_TOKEN,
        "PUBLIC_URL": "",
        "TWILIO_ACCOUNT_SID": "",
        "OMP_NUM_THREADS": "1",
    }
    with running_server(
        "--twilio", "--max-sessions", "1", engine="model", model=str(golden_dir), env=env
    ) as server:
        sim = TwilioSimulator(server.url, AUTH_TOKEN)
        call_sid, url, params = await asyncio.to_thread(sim.answer)
        async with sim.media_stream(url, params, call_sid=call_sid) as call:
            for _ in range(500):  # the system prompt is prefilled before the agent speaks
                if call.played or call.closed.is_set():
                    break
                await asyncio.sleep(0.02)
            await call.play(user)
            await call.play(np.zeros(RATE // 2, np.float32))
            assert not call.closed.is_set(), f"the call ended early ({call.close_code})"
        log = server.log()
    arrivals = np.array([p.arrival for p in call.played])
    message_s = len(call.played[0].payload) / RATE
    assert message_s == 0.040  # TwilioSettings.message_ms
    expected = (len(user) / RATE + 0.5) / message_s  # the caller's audio and the silence after it
    assert len(arrivals) >= 0.9 * expected, f"{len(arrivals)} messages of ~{expected:.0f}\n{log[-3000:]}"
    average = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)
    assert 0.975 * message_s <= average <= 1.025 * message_s, f"{average * 1000:.2f} ms per message"
    # Gaps as the server sent them (the bridge logs its metrics when the call ends): the
    # simulator's own arrival times also carry this test process's scheduling on a busy CI box.
    line = next((x for x in log.splitlines() if "call_metrics=" in x), None)
    metrics = json.loads(line.split("call_metrics=", 1)[1]) if line else None
    assert metrics is not None, f"no call metrics in the server log\n{log[-3000:]}"
    assert metrics["max_send_gap_ms"] <= 100.0, f"a {metrics['max_send_gap_ms']} ms gap\n{log[-2000:]}"
    assert metrics["frames_out"] >= len(arrivals)
    heard = np.concatenate([np.frombuffer(p.payload, np.uint8) for p in call.played])
    assert np.count_nonzero((heard & 0x7F) != 0x7F) > 0, "the agent sent only silence"
