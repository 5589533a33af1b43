"""PersonaPlexLLMService with the in-process backend, in real Pipecat pipelines.

The golden user audio goes in as 16 kHz InputAudioRawFrames at real-time pace; the model runs
behind a real SessionManager (echo engine, or the tiny golden PersonaPlex model).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from personaplex_pipecat import InProcessBackend, PersonaPlexLLMService
from pipecat.frames.frames import (
    InterruptionFrame,
    LLMTextFrame,
    MetricsFrame,
    TTSAudioRawFrame,
    TTSTextFrame,
)
from pipecat.metrics.metrics import ProcessingMetricsData, TTFBMetricsData
from pipecat.utils.errors import ErrorCategory
from support_pipecat import aligned_logspec_correlation, run_call, tone_fraction

from personaplex_voice.audio.io import read_audio
from personaplex_voice.engine.base import Sampling
from personaplex_voice.engine.loopback import LoopbackEngine
from personaplex_voice.sessions import SessionManager

torch.set_num_threads(1)

ECHO_TEXT = [" Hello", None, " world.", None]


@pytest.fixture(scope="module")
def user_16k(golden_dir) -> np.ndarray:
    return read_audio(golden_dir / "user.wav", sample_rate=16000)


def utterances_well_formed(sequence: list[str]) -> bool:
    """Start, TTSStarted, content..., TTSStopped, End, repeated; nothing outside."""
    pattern = [
        "LLMFullResponseStartFrame",
        "TTSStartedFrame",
        "content",
        "TTSStoppedFrame",
        "LLMFullResponseEndFrame",
    ]
    return (
        len(sequence) > 0
        and len(sequence) % 5 == 0
        and all(sequence[i : i + 5] == pattern for i in range(0, len(sequence), 5))
    )


async def test_echo_call_frames_text_and_metrics(user_16k) -> None:
    engine = LoopbackEngine(num_slots=1, text_pieces=ECHO_TEXT)
    manager = SessionManager(engine)
    # Nothing plays the output here, so the playout gate is off: on a loaded CI machine a starved
    # event loop delivers frames in bursts, which the gate would (rightly) drop. The gate has its
    # own tests (test_pipecat_utterance_playout.py) and runs in the Twilio example test.
    service = PersonaPlexLLMService(manager=manager, text_prompt="You are an echo.", max_audio_ahead_s=None)
    try:
        result = await run_call(
            service,
            user_16k,
            16000,
            out_rate=16000,
            wait_ready=lambda: service.session is not None,
            enable_metrics=True,
        )
    finally:
        await manager.shutdown()
    assert result.errors == []
    audio = result.audio_frames
    assert audio and {f.sample_rate for f in audio} == {16000} and {f.num_channels for f in audio} == {1}
    assert utterances_well_formed(result.sequence())
    # the agent's audio is the user's, echoed: same spectrum once the delay is taken out
    out = result.agent_timeline()
    corr, lag_s = aligned_logspec_correlation(out, user_16k, 16000)
    assert len(out) - lag_s * 16000 >= 0.9 * len(user_16k)
    assert corr >= 0.8, (corr, lag_s)
    # every text piece the engine emitted, as LLMTextFrame (kept out of the context) and TTSTextFrame
    text = result.text()
    assert text.startswith(" Hello world. Hello world.")
    assert [f.text for f in result.of(LLMTextFrame)] == [f.text for f in result.of(TTSTextFrame)]
    assert all(not f.append_to_context for f in result.of(LLMTextFrame))
    # Pipecat metrics: TTFB (session ready -> first speech) and processing time (the utterance)
    data = [d for f in result.of(MetricsFrame) for d in f.data]
    assert any(isinstance(d, TTFBMetricsData) and d.value > 0 for d in data)
    assert any(isinstance(d, ProcessingMetricsData) and d.value > 0 for d in data)
    assert service.stats["frames_dropped"] == 0


async def test_golden_model_call(golden_dir, user_16k) -> None:
    """The tiny golden PersonaPlex model behind the service.

    The manager ticks whenever a frame of input is buffered (realtime=False) rather than every
    80 ms: on a shared CI CPU the model may run slower than real time, and a real-time manager
    would then skip ticks. Input still arrives at real-time pace; the gate is off since nothing
    plays the output. Every user frame must come back as one 80 ms frame of agent audio.
    """
    from personaplex_voice.engine.factory import build_engine

    engine = await asyncio.to_thread(build_engine, str(golden_dir), num_slots=1, device="cpu")
    manager = SessionManager(engine, realtime=False)
    service = PersonaPlexLLMService(
        backend=InProcessBackend(manager),
        text_prompt="You enjoy having a good conversation.",
        voice="TINYF0.pt",
        sampling=Sampling(greedy=True),
        seed=1234,
        max_audio_ahead_s=None,
        playout_lead_s=0.0,
    )
    expected_frames = len(user_16k) * 24000 // 16000 // 1920

    async def drain(_result) -> None:  # let the model catch up with the input
        for _ in range(1500):
            if service.stats["frames_pushed"] >= expected_frames:
                return
            await asyncio.sleep(0.02)

    try:
        result = await run_call(
            service,
            user_16k,
            16000,
            out_rate=24000,
            during=drain,
            tail_s=0.0,
            wait_ready=lambda: service.session is not None,
        )
    finally:
        await manager.shutdown()
    assert result.errors == []
    audio = result.audio_frames
    assert {f.sample_rate for f in audio} == {24000}
    assert {f.num_frames for f in audio} == {1920}  # 80 ms at 24 kHz each
    covered_s = sum(f.num_frames for f in audio) / 24000
    assert covered_s >= 0.95 * result.input_s, (covered_s, result.input_s)  # it babbles throughout
    assert utterances_well_formed(result.sequence())
    pieces = [f.text for f in result.of(TTSTextFrame)]
    assert len(pieces) >= 20 and "".join(pieces).strip()
    assert len(result.of(LLMTextFrame)) == len(pieces)


@pytest.mark.parametrize("end", ["end", "cancel"])
async def test_end_or_cancel_mid_call_frees_the_slot(user_16k, end) -> None:
    engine = LoopbackEngine(num_slots=1)
    manager = SessionManager(engine)
    service = PersonaPlexLLMService(manager=manager)
    seen: dict[str, object] = {}

    async def during(_result) -> None:
        seen["session"] = service.session
        seen["active"] = manager.active_count

    try:
        result = await run_call(
            service,
            user_16k,
            16000,
            end=end,
            feed_s=1.0,
            tail_s=0.0,
            during=during,
            wait_ready=lambda: service.session is not None,
        )
        assert result.errors == []
        assert seen["active"] == 1  # the call held the only slot...
        assert manager.active_count == 0  # ...and ending the pipeline gave it back at once
        session = seen["session"].session
        assert session.closed and session.close_reason == "client"
        # the slot is usable right away by the next caller
        from personaplex_voice.engine.base import Persona

        other = await manager.open(Persona())
        await other.ready()
        await other.close()
    finally:
        await manager.shutdown()


async def test_refused_persona_is_an_error_frame(user_16k) -> None:
    manager = SessionManager(LoopbackEngine(num_slots=1))
    service = PersonaPlexLLMService(manager=manager, voice="NO_SUCH_VOICE")
    try:
        result = await run_call(
            service, user_16k, 16000, feed_s=0.2, wait_ready=lambda: False, ready_timeout_s=5
        )
    finally:
        await manager.shutdown()
    assert len(result.errors) == 1
    assert "NO_SUCH_VOICE" in result.errors[0].error
    assert result.errors[0].category is ErrorCategory.INVALID_REQUEST
    assert result.of(TTSAudioRawFrame) == []
    assert manager.active_count == 0


async def test_full_engine_is_an_error_frame(user_16k) -> None:
    from personaplex_voice.engine.base import Persona

    manager = SessionManager(LoopbackEngine(num_slots=1))
    taken = await manager.open(Persona())
    await taken.ready()
    service = PersonaPlexLLMService(manager=manager)
    try:
        result = await run_call(
            service, user_16k, 16000, feed_s=0.2, wait_ready=lambda: False, ready_timeout_s=5
        )
    finally:
        await taken.close()
        await manager.shutdown()
    assert len(result.errors) == 1 and "no free engine slot" in result.errors[0].error
    assert result.errors[0].category is ErrorCategory.RATE_LIMIT


async def test_lost_session_is_reopened(user_16k) -> None:
    manager = SessionManager(LoopbackEngine(num_slots=1))
    service = PersonaPlexLLMService(manager=manager, reconnect_attempts=1)

    async def during(_result) -> None:
        first = service.session
        await first.session.close(reason="test")  # the engine side ends the call on its own
        for _ in range(200):
            if service.session is not None and service.session is not first:
                break
            await asyncio.sleep(0.01)

    try:
        result = await run_call(
            service,
            user_16k,
            16000,
            feed_s=0.5,
            during=during,
            wait_ready=lambda: service.session is not None,
        )
    finally:
        await manager.shutdown()
    assert result.errors == []
    assert service.stats["sessions"] == 2


async def test_any_input_rate_and_channels_and_an_owned_backend() -> None:
    """44.1 kHz stereo in and 44.1 kHz out (Pipecat's soxr resampler where ours does not
    stream); `model=` builds a backend that the service owns and closes."""
    service = PersonaPlexLLMService(model="demo", engine_options={"engine_kind": "echo"})
    t = np.arange(round(1.2 * 44100)) / 44100
    left = 0.3 * np.sin(2 * np.pi * 500.0 * t)
    stereo = np.stack([left, left], axis=1).reshape(-1).astype(np.float32)  # interleaved L R
    result = await run_call(
        service, stereo, 44100, channels=2, out_rate=44100, wait_ready=lambda: service.session is not None
    )
    assert result.errors == []
    assert {f.sample_rate for f in result.audio_frames} == {44100}
    out = result.agent_timeline()
    block = 882
    rms = np.sqrt(np.mean(out[: len(out) // block * block].reshape(-1, block) ** 2, axis=1))
    loud = np.flatnonzero(rms > 0.1)
    echoed = out[loud[0] * block : (loud[-1] + 1) * block]
    assert 1.0 <= len(echoed) / 44100 <= 1.4
    assert tone_fraction(echoed, 500.0, 44100) > 0.9
    assert service.backend.manager is None  # the service shut down the manager it built


async def test_interruption_closes_the_utterance_and_speech_resumes() -> None:
    """An InterruptionFrame mid-speech ends the utterance; the model keeps talking, so a new one starts."""
    manager = SessionManager(LoopbackEngine(num_slots=1))
    service = PersonaPlexLLMService(manager=manager)
    t = np.arange(round(2.0 * 16000)) / 16000
    loud = (0.3 * np.sin(2 * np.pi * 300.0 * t)).astype(np.float32)

    async def interrupt() -> None:
        await asyncio.sleep(1.0)
        await service.queue_frame(InterruptionFrame())

    try:
        result = await run_call(
            service, loud, 16000, while_feeding=interrupt, wait_ready=lambda: service.session is not None
        )
    finally:
        await manager.shutdown()
    assert result.errors == []
    sequence = result.sequence()
    assert utterances_well_formed(sequence)
    assert sequence.count("TTSStartedFrame") == 2, sequence  # continuous speech, cut once
