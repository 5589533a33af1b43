"""`personaplex_livekit.DuplexModel` in a real LiveKit `AgentSession` (no room: the caller's audio
comes from an array in real time, the agent's is played out and recorded, as LiveKit's own tests
run it), remote: against the real server app under uvicorn with the echo engine, over real
WebSockets and real Opus."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from livekit.agents import Agent, AgentSession, RunContext, function_tool
from personaplex_livekit import Backoff, DuplexModel, chat_url
from support_audio import espeak_speech, set_level
from support_livekit import run_agent
from support_server import echo_similarity, serving_app, window_found

from personaplex_voice.audio.resample import resample
from personaplex_voice.engine.loopback import LoopbackEngine
from personaplex_voice.sessions import SessionManager

SR = 24000
LEAD = SR // 10
TEXT = [" Hello", None, " world.", None]  # the echo engine's text, a piece every other frame
TRANSFER = [{"on_agent_text": r"world", "do": "transfer", "to": "+15551230099"}]
AEC_WARMUP_S = 3.0  # AgentSession's default: the caller is muted to the model that long

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def speech(tmp_path_factory) -> np.ndarray:
    """7 s of synthetic speech at 24 kHz, its first word at `LEAD`."""
    pcm, rate = espeak_speech(tmp_path_factory.mktemp("speech"))
    x = set_level(resample(pcm, rate, SR), -20.0)
    onset = int(np.argmax(np.abs(x) > 0.02))
    return np.concatenate([np.zeros(LEAD, np.float32), x[onset : onset + 7 * SR - LEAD]])


@pytest.fixture(scope="module")
def server():
    # Each call's prompt takes 0.3 s (no persona cache): the caller talks meanwhile.
    manager = SessionManager(LoopbackEngine(num_slots=4, prefill_s=0.3, text_pieces=TEXT), cache_bytes=0)
    with serving_app(manager, max_sessions=4) as srv:
        yield srv


class Receptionist(Agent):
    """An app's agent with a transfer tool, as a LiveKit telephony agent has one."""

    def __init__(self, instructions: str = "You are an echo.") -> None:
        super().__init__(instructions=instructions)
        self.transfers: list[str] = []

    @function_tool
    async def transfer_call(self, ctx: RunContext, to: str) -> str:
        """Transfer the caller to a colleague."""
        self.transfers.append(to)
        return f"transferring to {to}"


def record(agent: Agent, name: str, into: list) -> None:
    agent.duplex_session.on(name, into.append)


async def test_default_agent_session_plays_the_echo_text_in_order_and_calls_the_tool(server, speech):
    model = DuplexModel(server.ws_url, voice="NATF2", actions=TRANSFER)
    agent = Receptionist()
    deltas: list = []
    session = AgentSession(llm=model)  # LiveKit's defaults: its VAD, turn detector, AEC warm-up

    async def watch() -> None:
        while agent._activity is None:
            await asyncio.sleep(0.005)
        record(agent, "transcript_delta", deltas)

    watcher = asyncio.create_task(watch())
    run = await run_agent(session, agent, speech, SR, tail_s=1.5)
    await watcher
    await model.aclose()
    assert run.errors == []
    # LiveKit mutes the caller to the model for the first 3 s of the agent's speech (its AEC
    # warm-up, docs/livekit.md); from then on the agent's audio is the caller's, echoed.
    after = int((AEC_WARMUP_S + 1.0) * SR)
    assert echo_similarity(speech[after:], run.played()) >= 0.8
    # transcript deltas: every piece, in order, each one frame long on the model's timeline
    assert len(deltas) >= 20
    assert [d.text for d in deltas] == [TEXT[2 * (i % 2)] for i in range(len(deltas))]
    starts = [d.start_ms for d in deltas]
    assert starts == sorted(starts) and starts[-1] > starts[0]  # on the model's timeline, in order
    assert all(d.end_ms - d.start_ms == 80 for d in deltas)
    assert "Hello world." in run.text_out.text  # and the session's transcription shows them
    # the persona's rule fired the app's tool once, though the phrase came again and again
    assert agent.transfers == ["+15551230099"]


async def test_the_callers_first_words_reach_the_model(server, speech):
    """What the caller says while the session connects and its prompt is prefilled is heard:
    with LiveKit's AEC warm-up off (docs/livekit.md) the echo starts with the first word."""
    metrics = server.manager.metrics
    trimmed, late = metrics.jitter_dropped_frames.value, metrics.late_frames.value
    model = DuplexModel(server.ws_url)
    run = await run_agent(
        AgentSession(llm=model, aec_warmup_duration=None), Agent(instructions="hi"), speech, SR
    )
    await model.aclose()
    assert run.errors == []
    played = run.played()
    assert window_found(speech[LEAD : LEAD + SR // 5], played, search=SR) >= 0.8
    assert echo_similarity(speech, played) >= 0.8
    # Only what the jitter buffer trims after a late tick (a busy machine's): never the burst
    # the plugin flushed after the handshake.
    assert metrics.jitter_dropped_frames.value - trimmed <= metrics.late_frames.value - late


async def test_a_refusal_ends_the_session_without_retrying(server, speech):
    refusals = server.app.state.server_metrics.errors
    before = refusals.values().get("persona", 0)
    model = DuplexModel(server.ws_url, voice="NOBODY")
    session = AgentSession(llm=model, aec_warmup_duration=None)
    closed = asyncio.Event()
    session.on("close", lambda _ev: closed.set())
    run = await run_agent(session, Agent(instructions="hi"), speech[: SR // 2], SR, tail_s=0.5)
    await asyncio.wait_for(closed.wait(), 10)
    await model.aclose()
    errors = [e.error for e in run.errors]
    assert len(errors) == 1 and not errors[0].recoverable
    assert "unknown voice 'NOBODY'" in str(errors[0].error)
    assert refusals.values().get("persona", 0) == before + 1  # asked once, not again


async def test_a_lost_session_is_reopened_and_new_instructions_open_a_new_one(server, speech):
    manager = server.manager
    model = DuplexModel(server.ws_url, backoff=Backoff(attempts=3, initial_s=0.1))
    agent = Receptionist("first persona")
    reconnects: list = []

    async def scenario() -> None:
        while agent._activity is None or agent.duplex_session.backend_session is None:
            await asyncio.sleep(0.01)
        record(agent, "session_reconnected", reconnects)
        first = next(s for s in manager.sessions if s.persona.text_prompt == "first persona")
        await first.close(reason="engine_error")  # the server side ends the call
        while not any(s.persona.text_prompt == "first persona" and s is not first for s in manager.sessions):
            await asyncio.sleep(0.01)
        await agent.update_instructions("second persona")  # a persona is fixed per session
        while not any(
            s.persona.text_prompt == "second persona" and s.stats["frames_in"] for s in manager.sessions
        ):  # the new session is in use: the caller's audio reaches it
            await asyncio.sleep(0.01)

    done = asyncio.create_task(scenario())
    run = await run_agent(
        AgentSession(llm=model, aec_warmup_duration=None),
        agent,
        speech[: 3 * SR],
        SR,
        until=done.done,
        tail_s=0.5,
    )
    await done
    await model.aclose()
    # LiveKit was told (once for both when the new instructions came while reopening)
    assert 1 <= len(reconnects) <= 2
    assert [e for e in run.errors if not e.error.recoverable] == []
    assert any(e.error.recoverable for e in run.errors)  # the loss was reported, as recoverable
    assert len(run.played()) > 0


def test_server_urls_as_livekit_users_write_them():
    assert chat_url("ws://gpu:8998") == "ws://gpu:8998/api/chat"
    assert chat_url("gpu:8998") == "ws://gpu:8998/api/chat"
    assert chat_url("https://gpu.example/") == "wss://gpu.example/api/chat"
    assert chat_url("wss://gpu.example/api/chat?token=k") == "wss://gpu.example/api/chat?token=k"
