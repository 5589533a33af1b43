"""LiveKit's published PersonaPlex client, `livekit-plugins-nvidia[personaplex]`'s
`RealtimeModel`, against `personaplex-voice serve --engine echo`, in a real `AgentSession` with
the settings docs/livekit.md gives: audio and text flow, and the caller's first words (sent by
the plugin in one burst once our handshake arrives) are not lost."""

from __future__ import annotations

import aiohttp
import numpy as np
import pytest
from livekit.agents import Agent, AgentSession
from livekit.plugins.nvidia.experimental.realtime import RealtimeModel
from support_audio import espeak_speech, set_level
from support_livekit import run_agent
from support_server import echo_similarity, running_server, window_found

from personaplex_voice.audio.resample import resample

SR = 24000
LEAD = SR // 10
PROMPT = "You are a helpful assistant."

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def server():
    with running_server("--max-sessions", "2") as srv:
        yield srv


async def test_nvidia_realtime_model_with_the_documented_settings(server, tmp_path):
    pcm, rate = espeak_speech(tmp_path)
    x = set_level(resample(pcm, rate, SR), -20.0)
    onset = int(np.argmax(np.abs(x) > 0.02))
    speech = np.concatenate([np.zeros(LEAD, np.float32), x[onset : onset + 4 * SR]])
    async with aiohttp.ClientSession() as http:  # outside a LiveKit job, the plugin needs one
        model = RealtimeModel(base_url=server.ws_url, voice="NATF2", text_prompt=PROMPT, http_session=http)
        # no VAD (it would cut the model's speech into pieces), no AEC warm-up (it would feed the
        # model silence for the agent's first 3 s); instructions equal to the text prompt, or the
        # plugin reconnects to apply them
        session = AgentSession(llm=model, vad=None, aec_warmup_duration=None)

        async def close_plugin_session() -> None:
            # its generations never end while the server streams, so AgentSession.aclose would
            # wait for them: the plugin's session is closed first (docs/livekit.md)
            await session.current_agent.realtime_llm_session.aclose()

        run = await run_agent(
            session, Agent(instructions=PROMPT), speech, SR, before_close=close_plugin_session
        )
        await model.aclose()
    assert run.errors == []
    played = run.played()
    assert echo_similarity(speech, played) >= 0.8
    assert window_found(speech[LEAD : LEAD + SR // 5], played, search=SR) >= 0.8  # the first words
    assert "Hello from the echo engine." in run.text_out.text
    metrics = (await _get(server.url + "/metrics")).splitlines()
    assert "personaplex_jitter_dropped_frames_total 0.0" in metrics
    assert "personaplex_dropped_input_samples_total 0.0" in metrics


async def _get(url: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(url) as response:
        return await response.text()
