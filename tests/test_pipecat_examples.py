"""The Pipecat examples run: the Twilio bot against a simulated Twilio, the file pipeline end to end.

Both use the echo engine in process, so what comes back is what went in (a tone).
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
from personaplex_pipecat import InProcessBackend
from support_pipecat import tone_fraction
from support_twilio import TwilioSimulator, parse_stream_twiml, running_app, tone

from personaplex_voice.audio.io import read_audio, write_wav
from personaplex_voice.engine.loopback import LoopbackEngine

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
AUTH_TOKEN = "example-auth-token"


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def loud_part(x: np.ndarray, rate: int, threshold: float = 0.05) -> np.ndarray:
    """The samples from the first to the last 20 ms block whose RMS is above `threshold`."""
    block = rate // 50
    rms = np.sqrt(np.mean(x[: len(x) // block * block].reshape(-1, block) ** 2, axis=1))
    loud = np.flatnonzero(rms > threshold)
    assert len(loud), "no audio came back"
    return x[loud[0] * block : (loud[-1] + 1) * block]


async def test_twilio_bot_example_echoes_a_call() -> None:
    bot = load_example("pipecat_twilio_bot")
    backend = InProcessBackend(engine=LoopbackEngine(num_slots=1))
    app = bot.create_app(backend, bot.BotConfig(twilio_auth_token=AUTH_TOKEN))
    with running_app(app) as server:
        sim = TwilioSimulator(base_url=server.url, auth_token=AUTH_TOKEN)
        form = {
            "AccountSid": "AC" + "0" * 32,
            "CallSid": "CA" + "1" * 32,
            "From": "+15550001",
            "To": "+15550002",
        }
        unsigned = await asyncio.to_thread(sim.post_webhook, "/twiml", form, signature=None)
        assert unsigned.status_code == 403
        answer = await asyncio.to_thread(sim.post_webhook, "/twiml", form)
        assert answer.status_code == 200, answer.text
        stream_url, params = parse_stream_twiml(answer.text)
        assert stream_url == server.url.replace("http://", "ws://") + "/ws"
        async with sim.media_stream(stream_url, params) as call:
            for _ in range(200):  # the bot opens its PersonaPlex session (audio before it is lost)
                if any(session.ready_now for session in backend.manager.sessions):
                    break
                await asyncio.sleep(0.025)
            await call.play(np.concatenate([tone(440.0, 1.2, 0.4), np.zeros(4000, np.float32)]))
            await asyncio.sleep(0.5)
            assert backend.manager.active_count == 1
        # the caller hung up: the pipeline is cancelled and the engine slot comes back
        for _ in range(100):
            if backend.manager.active_count == 0:
                break
            await asyncio.sleep(0.05)
        assert backend.manager.active_count == 0
    echoed = loud_part(call.played_audio(), 8000)
    assert 0.8 <= len(echoed) / 8000 <= 1.6
    assert tone_fraction(echoed, 440.0, 8000) > 0.9


async def test_file_pipeline_example(tmp_path) -> None:
    example = load_example("pipecat_file_pipeline")
    question = tmp_path / "question.wav"
    answer = tmp_path / "answer.wav"
    write_wav(question, tone(330.0, 1.0, 0.4, rate=16000), 16000)
    assert await example.main([str(question), str(answer), "--engine", "echo"]) == 0
    out = read_audio(answer, sample_rate=24000)
    assert len(out) >= 24000  # at least as long as the input
    echoed = loud_part(out, 24000)
    assert 0.8 <= len(echoed) / 24000 <= 1.3
    assert tone_fraction(echoed, 330.0, 24000) > 0.9
