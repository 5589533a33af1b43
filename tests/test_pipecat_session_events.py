"""What a Pipecat user sees of `PersonaPlexLLMService` in a real pipeline: an unexpected failure as
one ErrorFrame (and the call ended by the worker's policy, not left mute), the caller's speech
as Pipecat's VAD and user speaking frames, metrics as Pipecat's MetricsFrames, every input rate
and channel count echoed back, and a 2.5 s prompt load that loses none of the caller's words."""

from __future__ import annotations

import numpy as np
import pytest
from personaplex_pipecat import InProcessBackend, PersonaPlexLLMService
from pipecat.frames.frames import (
    MetricsFrame,
    UserStartedSpeakingFrame,
    UserStoppedSpeakingFrame,
    VADUserStartedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.metrics.metrics import LLMUsageMetricsData, ProcessingMetricsData, TTFBMetricsData
from pipecat.pipeline.worker import ProcessorUnusablePolicy
from pipecat.utils.errors import ErrorCategory
from support_audio import espeak_speech, set_level
from support_pipecat import aligned_logspec_correlation, run_call
from support_server import serving_app, window_found

from personaplex_voice.audio.resample import resample
from personaplex_voice.engine.loopback import LoopbackEngine
from personaplex_voice.engine.scripted import Reply, ScriptedEngine
from personaplex_voice.sessions import SessionManager

SR = 24000
LEAD = SR // 2

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def speech(tmp_path_factory) -> np.ndarray:
    """4 s of synthetic speech at 24 kHz after `LEAD` of silence, then 1.5 s of silence."""
    pcm, rate = espeak_speech(tmp_path_factory.mktemp("speech"))
    x = set_level(resample(pcm, rate, SR), -20.0)
    onset = int(np.argmax(np.abs(x) > 0.02))
    quiet = np.zeros(LEAD, np.float32)
    return np.concatenate([quiet, x[onset : onset + 4 * SR], np.zeros(3 * SR // 2, np.float32)])


# -- failures --------------------------------------------------------------------------------------


class Fire(RuntimeError):
    pass


class FailingSession:
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
    """An in-process backend that fails where told, with an exception no backend should raise."""

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
async def test_an_unexpected_failure_is_one_error_frame_and_the_call_ends(speech, where):
    manager = SessionManager(LoopbackEngine(num_slots=1))
    service = PersonaPlexLLMService(backend=FailingBackend(manager, where))
    try:
        result = await run_call(
            service,
            speech[: 3 * SR],
            SR,
            end="none",  # nothing ends the call but the worker's policy
            worker_options={"processor_unusable_policy": ProcessorUnusablePolicy.END},
        )
    finally:
        await manager.shutdown()
    assert len(result.errors) == 1, result.errors
    error = result.errors[0]
    assert "PersonaPlex: Fire: the" in error.error and isinstance(error.exception, Fire)
    assert error.category is ErrorCategory.UNKNOWN
    assert not service.is_usable  # so the worker ended the call: it did not stay up mute
    assert result.wall_s < 3 * SR / SR + 15  # ended by the policy, not by the harness's timeout
    assert manager.active_count == 0


# -- the caller's speech -------------------------------------------------------------------------


def names(frames) -> list[str]:
    kinds = (
        VADUserStartedSpeakingFrame,
        UserStartedSpeakingFrame,
        VADUserStoppedSpeakingFrame,
        UserStoppedSpeakingFrame,
    )
    return [type(f).__name__ for _, f in frames if isinstance(f, kinds)]


async def test_the_callers_speech_is_announced_as_pipecats_vad_would(speech):
    manager = SessionManager(LoopbackEngine(num_slots=1))
    service = PersonaPlexLLMService(manager=manager, max_audio_ahead_s=None)
    try:
        result = await run_call(service, speech, SR, wait_ready=lambda: service.session is not None)
    finally:
        await manager.shutdown()
    assert result.errors == []
    expected = [
        "VADUserStartedSpeakingFrame",
        "UserStartedSpeakingFrame",
        "VADUserStoppedSpeakingFrame",
        "UserStoppedSpeakingFrame",
    ]
    # both ways (broadcast), as a realtime service's own turn detection announces them; espeak's
    # pauses between words are shorter than the VAD's 0.55 s: one stretch of speech
    assert names(result.downstream) == expected
    assert names(result.upstream) == expected
    started = result.of(VADUserStartedSpeakingFrame)[0]
    stopped = result.of(VADUserStoppedSpeakingFrame)[0]
    # the frames carry when it happened: the speech lasted about its 4 s
    assert 3.0 < stopped.timestamp - started.timestamp < 5.0
    assert service.stats["caller_speech"] == 1


async def test_a_pipeline_with_its_own_vad_is_not_told_twice(speech):
    manager = SessionManager(LoopbackEngine(num_slots=1))
    service = PersonaPlexLLMService(manager=manager, max_audio_ahead_s=None)

    async def pipeline_vad() -> None:  # what a transport's VAD pushes downstream, before ours
        await service.queue_frame(VADUserStartedSpeakingFrame())

    try:
        result = await run_call(
            service, speech, SR, while_feeding=pipeline_vad, wait_ready=lambda: service.session is not None
        )
    finally:
        await manager.shutdown()
    assert result.errors == []
    assert names(result.downstream) == ["VADUserStartedSpeakingFrame"]  # the pipeline's own, passed on
    assert service.stats["caller_speech"] == 1  # ours still heard it (it times the answer)


# -- metrics -------------------------------------------------------------------------------------


async def test_metrics_frames_time_the_answer_from_the_callers_end_of_speech(speech):
    tone = (0.3 * np.sin(2 * np.pi * 440.0 * np.arange(SR) / SR)).astype(np.float32)
    reply = Reply("Sure, I can help with that.", tone)
    manager = SessionManager(ScriptedEngine(num_slots=1, replies=[reply], respond_after_ms=400))
    service = PersonaPlexLLMService(manager=manager, max_audio_ahead_s=None)
    try:
        result = await run_call(
            service, speech, SR, wait_ready=lambda: service.session is not None, enable_metrics=True
        )
    finally:
        await manager.shutdown()
    assert result.errors == []
    # (the worker's own zeros at the start, one per processor that reports metrics, left out)
    data = [d for f in result.of(MetricsFrame)[1:] for d in f.data]
    ttfb = [d.value for d in data if isinstance(d, TTFBMetricsData)]
    processing = [d.value for d in data if isinstance(d, ProcessingMetricsData)]
    usage = [d.value for d in data if isinstance(d, LLMUsageMetricsData)]
    # the scripted agent answers 400 ms after the caller's last sound; the VAD is sure of the
    # end 0.55 s after it, later than the answer, and the answer is timed from the end all the same
    assert len(ttfb) == 1 and 0.4 <= ttfb[0] < 3.0, ttfb
    assert len(processing) == 1 and processing[0] > ttfb[0] + 0.9  # to the end of the 1 s reply
    # usage when the session ended: the call's audio, in 80 ms frames both ways, and the words
    (tokens,) = usage
    assert tokens.input_audio_tokens * 0.08 > 5.0  # the caller's 6 s, as the model heard them
    assert tokens.output_audio_tokens * 0.08 > 5.0  # the model's side, silence included
    assert tokens.completion_tokens == tokens.output_audio_tokens + len(reply.text.split())


# -- input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("channels", [1, 2])
@pytest.mark.parametrize("rate", [16000, 44100, 48000])
async def test_every_input_rate_and_channel_count_is_echoed(speech, rate, channels):
    voice = speech[: LEAD + 4 * SR]
    caller = resample(voice, SR, rate)
    if channels == 2:  # the voice on both sides, louder on the left
        caller = np.stack([caller, 0.5 * caller], axis=1).reshape(-1)
    manager = SessionManager(LoopbackEngine(num_slots=1))
    service = PersonaPlexLLMService(manager=manager, max_audio_ahead_s=None)
    try:
        result = await run_call(
            service, caller, rate, channels=channels, wait_ready=lambda: service.session is not None
        )
    finally:
        await manager.shutdown()
    assert result.errors == []
    corr, _lag = aligned_logspec_correlation(result.agent_timeline(), voice, SR)
    assert corr >= 0.8


async def test_a_slow_prompt_load_loses_none_of_the_callers_first_words(speech):
    """Remote, 2.5 s of prompt load while the caller talks from the pipeline's start."""
    voice = speech[LEAD - SR // 10 :]  # the first word 0.1 s in
    manager = SessionManager(LoopbackEngine(num_slots=1, prefill_s=2.5), cache_bytes=0)
    with serving_app(manager, max_sessions=1) as server:
        service = PersonaPlexLLMService(url=server.ws_url + "/api/chat", max_audio_ahead_s=None)
        result = await run_call(service, voice, SR, tail_s=1.5)
    assert result.errors == []
    # the agent's audio back to back (the catch-up delivers the first seconds faster than real time)
    out = np.concatenate(
        [np.frombuffer(f.audio, "<i2").astype(np.float32) / 32768 for f in result.audio_frames]
    )
    assert window_found(voice[SR // 10 : SR // 10 + SR // 5], out, search=SR) >= 0.8
    assert service.stats["input_samples_dropped"] == 0
    assert manager.metrics.catchup_frames.value >= 2.0 / 0.08  # caught up, not trimmed
