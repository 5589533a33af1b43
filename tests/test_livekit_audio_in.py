"""The caller's audio as LiveKit hands it to `personaplex_livekit.DuplexModel`, in a real
`AgentSession`: a SIP trunk's 16 kHz, a file's 44.1 kHz, a room's 48 kHz, mono and stereo, all
reach the model as its 24 kHz and come back as the echo; and a session whose prompt takes 2.5 s
to load hears every word the caller said meanwhile (the server's start burst, the bridge's
early audio: docs/sessions.md)."""

from __future__ import annotations

import numpy as np
import pytest
from livekit.agents import Agent, AgentSession
from personaplex_livekit import DuplexModel
from support_audio import espeak_speech, set_level
from support_livekit import run_agent
from support_server import echo_similarity, serving_app, window_found

from personaplex_voice.audio.resample import resample
from personaplex_voice.engine.base import FRAME_SIZE
from personaplex_voice.engine.loopback import LoopbackEngine
from personaplex_voice.sessions import SessionManager

SR = 24000
LEAD = SR // 10

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def speech(tmp_path_factory) -> np.ndarray:
    """4 s of synthetic speech at 24 kHz, its first word at `LEAD`."""
    pcm, rate = espeak_speech(tmp_path_factory.mktemp("speech"))
    x = set_level(resample(pcm, rate, SR), -20.0)
    onset = int(np.argmax(np.abs(x) > 0.02))
    return np.concatenate([np.zeros(LEAD, np.float32), x[onset : onset + 4 * SR - LEAD]])


@pytest.mark.parametrize("channels", [1, 2])
@pytest.mark.parametrize("rate", [16000, 44100, 48000])
async def test_every_input_rate_and_channel_count_reaches_the_model(speech, rate, channels):
    caller = resample(speech, SR, rate) if rate != SR else speech
    if channels == 2:  # a stereo source: the voice on both sides, louder on the left
        caller = np.stack([caller, 0.5 * caller], axis=1).reshape(-1)
    manager = SessionManager(LoopbackEngine(num_slots=1))
    model = DuplexModel(manager=manager)
    session = AgentSession(llm=model, aec_warmup_duration=None)
    agent = Agent(instructions="hi")
    stats: dict = {}

    async def keep() -> None:
        stats.update(agent.duplex_session.stats)

    try:
        run = await run_agent(session, agent, caller, rate, channels=channels, tail_s=0.5, before_close=keep)
    finally:
        await model.aclose()
        await manager.shutdown()
    assert run.errors == []
    played = run.played()
    assert echo_similarity(speech, played) >= 0.8
    # every second the caller said reached the model, mixed to mono at 24 kHz
    assert stats["input_samples"] >= len(speech)


async def test_a_slow_prompt_load_loses_none_of_the_callers_first_words(speech):
    """2.5 s of prompt load (no persona cache) while the caller talks from the first moment:
    the bridge holds what they said, the server keeps it as a start burst and catches it up."""
    manager = SessionManager(LoopbackEngine(num_slots=1, prefill_s=2.5), cache_bytes=0)
    metrics = manager.metrics
    with serving_app(manager, max_sessions=1) as server:
        model = DuplexModel(server.ws_url)
        agent = Agent(instructions="hi")
        stats: dict = {}

        async def keep() -> None:
            stats.update(agent.duplex_session.stats)
            stats["server"] = [s.stats for s in manager.sessions]

        run = await run_agent(
            AgentSession(llm=model, aec_warmup_duration=None),
            agent,
            speech,
            SR,
            tail_s=1.5,
            before_close=keep,
        )
        await model.aclose()
    assert run.errors == []
    assert stats["input_samples_dropped"] == 0  # the bridge kept it all
    (server_stats,) = stats["server"]
    # and so did the server: nothing dropped before the session ran or by the input bound; only
    # what the jitter buffer trims after a late tick (a busy machine's), never the burst
    assert server_stats["dropped_pre_ready_samples"] == 0
    assert server_stats["dropped_input_samples"] == server_stats["jitter_dropped_frames"] * FRAME_SIZE
    assert server_stats["jitter_dropped_frames"] <= server_stats["late_frames"]
    assert metrics.catchup_frames.value >= 2.0 / 0.08  # the backlog was caught up, not trimmed
    played = run.played()
    assert window_found(speech[LEAD : LEAD + SR // 5], played, search=SR) >= 0.8  # the first word
    assert echo_similarity(speech, played) >= 0.8  # and the rest
