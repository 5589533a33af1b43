"""What a LiveKit user sees of `personaplex_livekit.DuplexModel` in a real `AgentSession` (no room:
audio from an array in real time, played out and recorded, as LiveKit's own tests run it):
failures reported once and the session closed, the model's `instructions=` as the default
persona (asserted on what the server received), the caller's `user_state` from a real VAD, and
metrics in LiveKit's own types."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import numpy as np
import pytest
from livekit.agents import Agent, AgentSession, CloseReason
from livekit.agents.metrics import RealtimeModelMetrics
from personaplex_livekit import DuplexModel, InProcessBackend
from support_audio import espeak_speech, set_level
from support_livekit import run_agent
from support_server import serving_app

from personaplex_voice.audio.resample import resample
from personaplex_voice.engine.base import StepOutput
from personaplex_voice.engine.loopback import LoopbackEngine
from personaplex_voice.engine.scripted import Reply, ScriptedEngine
from personaplex_voice.sessions import SessionManager

SR = 24000
LEAD = SR // 2

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def speech(tmp_path_factory) -> np.ndarray:
    """About 8.5 s of synthetic speech at 24 kHz, after `LEAD` of silence."""
    pcm, rate = espeak_speech(tmp_path_factory.mktemp("speech"))
    x = set_level(resample(pcm, rate, SR), -20.0)
    onset = int(np.argmax(np.abs(x) > 0.02))
    return np.concatenate([np.zeros(LEAD, np.float32), x[onset:]])


# -- failures --------------------------------------------------------------------------------------


class Fire(RuntimeError):
    pass


class FailingSession:
    """An in-process session that fails where told, with an exception no backend should raise."""

    def __init__(self, inner, where: str) -> None:
        self._inner = inner
        self._where = where

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def push(self, pcm: np.ndarray) -> None:
        if self._where == "push" and self._inner.session.stats["frames_out"] >= 5:
            raise Fire("the sound card caught fire")
        self._inner.push(pcm)

    async def frames(self):
        count = 0
        async for out in self._inner.frames():
            yield out
            count += 1
            if self._where == "frames" and count == 5:
                raise Fire("the GPU caught fire")


class FailingBackend:
    def __init__(self, manager: SessionManager, where: str) -> None:
        self._inner = InProcessBackend(manager)
        self._where = where
        self.model_name = "failing"

    async def prepare(self) -> None:
        await self._inner.prepare()

    async def open(self, persona):
        if self._where == "open":
            raise Fire("the model file caught fire")
        return FailingSession(await self._inner.open(persona), self._where)

    async def aclose(self) -> None:
        pass


@pytest.mark.parametrize("where", ["open", "frames", "push"])
async def test_an_unexpected_failure_is_one_unrecoverable_error_and_the_session_closes(speech, where):
    manager = SessionManager(LoopbackEngine(num_slots=1))
    model = DuplexModel(backend=FailingBackend(manager, where))
    session = AgentSession(llm=model, aec_warmup_duration=None)
    try:
        run = await run_agent(session, Agent(instructions="hi"), speech[: 3 * SR], SR, tail_s=0.5)
        await model.aclose()
    finally:
        await manager.shutdown()
    errors = [e.error for e in run.errors]
    assert len(errors) == 1, errors
    assert not errors[0].recoverable
    assert "PersonaPlex session failed: Fire: the" in str(errors[0].error)
    assert isinstance(errors[0].error.__cause__, Fire)
    # LiveKit closed the AgentSession for it: the caller is not left with a mute agent
    assert run.closed and run.closed[0].reason == CloseReason.ERROR
    assert manager.active_count == 0  # and the engine slot is free


# -- instructions --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    manager = SessionManager(LoopbackEngine(num_slots=4), cache_bytes=0)
    with serving_app(manager, max_sessions=4) as srv:
        yield srv


@pytest.mark.parametrize(
    ("model_instructions", "agent_instructions", "prompt"),
    [("X", "", "X"), ("X", "Y", "Y"), (None, "Y", "Y"), (None, "", "")],
)
async def test_the_agents_instructions_win_and_the_models_stand_in_for_none(
    server, speech, model_instructions, agent_instructions, prompt
):
    model = DuplexModel(server.ws_url, instructions=model_instructions, caller_vad=False)
    agent = Agent(instructions=agent_instructions)
    received: list[str] = []

    def opened() -> bool:
        received[:] = [s.persona.text_prompt for s in server.manager.sessions if s.stats["frames_in"]]
        return bool(received)

    run = await run_agent(
        AgentSession(llm=model, aec_warmup_duration=None), agent, speech[:SR], SR, until=opened, tail_s=0.2
    )
    await model.aclose()
    assert run.errors == []
    assert received == [prompt]  # what the server's session was opened with


async def test_clearing_the_agents_instructions_goes_back_to_the_models(server, speech):
    model = DuplexModel(server.ws_url, instructions="X", caller_vad=False)
    agent = Agent(instructions="Y")

    def prompts() -> set[str]:
        return {s.persona.text_prompt for s in server.manager.sessions if s.stats["frames_in"]}

    async def scenario() -> None:
        while "Y" not in prompts():
            await asyncio.sleep(0.01)
        await agent.update_instructions("")
        while "X" not in prompts():
            await asyncio.sleep(0.01)

    done = asyncio.create_task(scenario())
    run = await run_agent(
        AgentSession(llm=model, aec_warmup_duration=None), agent, speech[: 2 * SR], SR, until=done.done
    )
    await asyncio.wait_for(done, 10)
    await model.aclose()
    assert [e for e in run.errors if not e.error.recoverable] == []


# -- the caller's user_state ---------------------------------------------------------------------


class SilentEngine(LoopbackEngine):
    """An agent that never says a word: LiveKit's agent_state stays "listening"."""

    def step(self, pcm: np.ndarray, active: np.ndarray) -> StepOutput:
        out = super().step(pcm, active)
        return replace(out, pcm=np.zeros_like(out.pcm))


AWAY_S = 2.0  # user_away_timeout, short: the caller below talks for over 4 times as long


async def test_a_talking_caller_is_speaking_not_away_and_a_silent_one_goes_away(speech):
    """LiveKit's defaults (its VAD not wired for a realtime model with turn detection): the
    caller's user_state comes from the model's input_speech events alone. A caller who talks
    for 8 s while the agent says nothing is "speaking", never "away"; once they stop, the same
    timer marks them away (the control: away detection still works)."""
    manager = SessionManager(SilentEngine(num_slots=1))
    model = DuplexModel(manager=manager)
    session = AgentSession(llm=model, user_away_timeout=AWAY_S)
    agent_states: list[str] = []
    session.on("agent_state_changed", lambda ev: agent_states.append(ev.new_state))
    user_states: list[tuple[float, str]] = []
    session.on("user_state_changed", lambda ev: user_states.append((time.monotonic(), ev.new_state)))
    t0 = time.monotonic()
    try:
        run = await run_agent(
            session,
            Agent(instructions="hi"),
            speech,
            SR,
            tail_s=0.0,
            until=lambda: any(state == "away" for _, state in user_states),
        )
    finally:
        await model.aclose()
        await manager.shutdown()
    assert run.errors == []
    assert "speaking" not in agent_states  # the agent was silent throughout
    states = [state for _, state in run.user_states]
    assert states[0] == "speaking"
    speech_end = t0 + len(speech) / SR
    away = [t for t, state in run.user_states if state == "away"]
    assert away, run.user_states
    # Never away while talking: the first "away" comes only after the caller's last word (at
    # least the timeout after it; the fixed time it takes is the benchmark's business).
    assert away[0] > speech_end
    assert states[-2:] == ["listening", "away"]
    speaking = [t for t, state in run.user_states if state == "speaking"]
    assert speaking[0] < t0 + len(speech) / SR / 2  # it started while the caller talked


# -- metrics -------------------------------------------------------------------------------------


def tone(seconds: float, freq: float = 440.0) -> np.ndarray:
    t = np.arange(round(seconds * SR)) / SR
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


async def test_metrics_in_livekits_own_types(speech):
    """An agent that answers 0.4 s after the caller stops (the scripted engine): connection,
    burst and usage metrics reach the AgentSession's `metrics_collected` and its usage."""
    reply = Reply("Sure, I can help with that.", tone(1.0))
    engine = ScriptedEngine(num_slots=1, replies=[reply], respond_after_ms=400, prefill_s=0.2)
    manager = SessionManager(engine, cache_bytes=0)
    model = DuplexModel(manager=manager)
    session = AgentSession(llm=model, aec_warmup_duration=None)
    caller = np.concatenate([speech[: 3 * SR], np.zeros(SR // 2, np.float32)])
    try:
        run = await run_agent(session, Agent(instructions="hi"), caller, SR, tail_s=2.0)
    finally:
        await model.aclose()
        await manager.shutdown()
    assert run.errors == []
    ours = [m for m in run.metrics if isinstance(m, RealtimeModelMetrics)]
    assert all(m.metadata.model_provider == "personaplex-voice" for m in ours)
    connected, *bursts, usage = ours
    assert connected.acquire_time >= 0.2  # the prompt load is part of getting the session
    session_id = connected.request_id
    assert session_id and usage.request_id == session_id
    # the session: how long, when its first audible audio came, the audio both ways
    assert usage.session_duration > 4.0
    assert 2.5 < usage.ttft < usage.session_duration  # its first words came after the caller's
    assert usage.input_token_details.audio_tokens > 4.0 / 0.08  # 80 ms frames the model heard
    assert usage.output_token_details.audio_tokens > 4.0 / 0.08  # and made, silence included
    assert usage.output_token_details.text_tokens == len(reply.text.split())
    # the agent's reply, one burst, timed from the end of the caller's speech (the VAD's)
    assert len(bursts) == 1 and bursts[0].request_id == session_id + "-1"
    assert 0.4 <= bursts[0].ttft < 3.0  # respond_after_ms, and the delivery (a hang bound)
    assert 0.9 < bursts[0].duration < 3.0
    # LiveKit added them up into the session's usage
    summary = [u for u in session.usage.model_usage if getattr(u, "provider", "") == "personaplex-voice"]
    assert summary and summary[0].session_duration == pytest.approx(usage.session_duration)
