"""`personaplex_livekit.DuplexModel` in process, on the tiny golden PersonaPlex model, in a real
LiveKit `AgentSession` with its default settings: the golden user audio goes in as LiveKit audio
frames at real-time pace, and what the model makes is exactly the published implementation's."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import soundfile as sf
import torch
from livekit.agents import Agent, AgentSession, RunContext, function_tool
from personaplex_livekit import DuplexModel
from support_livekit import ArrayAudioInput, RecordedTextOutput

from personaplex_voice.engine.base import FRAME_SIZE, Sampling
from personaplex_voice.sessions import SessionManager

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(300)

FRAMES = 70  # the golden run's user frames


class Receptionist(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="You enjoy having a good conversation.")
        self.transfers: list[str] = []

    @function_tool
    async def transfer_call(self, ctx: RunContext, to: str) -> str:
        """Transfer the caller to a colleague."""
        self.transfers.append(to)
        return "transferring"


def prompt_in(agent: Agent) -> bool:
    return agent._activity is not None and agent.duplex_session.backend_session is not None


def piece(p: str) -> str | None:
    return None if p in ("EPAD", "PAD") else p


async def test_golden_model_in_an_agent_session_is_exact(golden_dir) -> None:
    """The manager ticks whenever a frame of input is buffered (realtime=False): on a shared CI
    CPU the model may be slower than real time, and every user frame must become one output frame.
    No audio sink is attached: LiveKit's AEC warm-up would otherwise mute the caller to the
    model during the agent's first 3 s of speech (docs/livekit.md), and the tokens would be
    another conversation's."""
    from personaplex_voice.engine.factory import build_engine

    expected = dict(np.load(golden_dir / "expected.npz"))
    user, rate = sf.read(golden_dir / "user.wav", dtype="int16")  # its own samples, exactly
    assert rate == 24000
    engine = build_engine(str(golden_dir), num_slots=1, device="cpu")
    manager = SessionManager(engine, realtime=False, output_frames=512, max_call_s=None, idle_timeout_s=None)
    model = DuplexModel(
        manager=manager,
        voice="TINYF0.pt",
        sampling=Sampling(greedy=True),
        seed=1234,
        # " torres" comes twice in the golden run: the rule fires once
        actions=[{"on_agent_text": r"\btorres\b", "do": "transfer", "to": "sip:desk@pbx.example.com"}],
    )
    agent = Receptionist()
    session = AgentSession(llm=model)  # LiveKit's defaults
    # The caller starts once the prompt is in: the golden run has no audio from before it (a
    # caller who talks during the prefill is heard too, from a burst: test_livekit_remote.py).
    session.input.audio = ArrayAudioInput(user, 24000, start_when=lambda: prompt_in(agent))
    session.output.audio = None
    text = RecordedTextOutput()
    session.output.transcription = text
    frames: list = []
    deltas: list = []
    try:
        await session.start(agent)
        agent.duplex_session.on("personaplex_frame", frames.append)
        agent.duplex_session.on("transcript_delta", deltas.append)
        for _ in range(6000):
            if len(frames) >= FRAMES and agent.transfers:
                break
            await asyncio.sleep(0.02)
        await session.aclose()
    finally:
        await model.aclose()
        await manager.shutdown()

    got = frames[:FRAMES]
    assert [f.index for f in got] == list(range(FRAMES))
    tokens = np.stack([f.tokens for f in got])
    golden = expected["pt_voice__tokens"]
    n = min(tokens.shape[1], golden.shape[1])
    np.testing.assert_array_equal(tokens[:, :n], golden[:, :n])
    pcm = np.concatenate([f.pcm for f in got])
    np.testing.assert_allclose(pcm, expected["pt_voice__pcm"], atol=1e-4, rtol=0)
    assert [f.text for f in got] == [piece(p) for p in expected["pt_voice__pieces"]]
    # the stream LiveKit reads is that audio, frame for frame, stamped 80 ms apart
    assert [f.start_ms for f in got] == [80 * i for i in range(FRAMES)]
    assert all(f.pcm.shape == (FRAME_SIZE,) for f in got)
    # transcript deltas: the golden pieces, in order, each on its frame's span of the timeline
    spoken = [(f.text, f.start_ms) for f in got if f.text]
    assert [(d.text, d.start_ms) for d in deltas[: len(spoken)]] == spoken
    assert all(d.end_ms == d.start_ms + 80 for d in deltas)
    assert agent.transfers == ["sip:desk@pbx.example.com"]
