"""The Pipecat service hands the caller's audio from before its session was ready to the session
(issue 16): remote, against a real server whose prompt takes a while, the first words come back."""

from __future__ import annotations

import numpy as np
import pytest
from personaplex_pipecat import PersonaPlexLLMService
from pipecat.frames.frames import TTSAudioRawFrame
from support_audio import espeak_speech, set_level
from support_pipecat import run_call
from support_server import serving_app, window_found

from personaplex_voice.audio.resample import resample
from personaplex_voice.engine.loopback import LoopbackEngine
from personaplex_voice.sessions import SessionManager

SR = 24000
LEAD = SR // 10

pytestmark = pytest.mark.timeout(120)


async def test_remote_session_hears_what_the_caller_said_while_it_opened(tmp_path) -> None:
    pcm, rate = espeak_speech(tmp_path)
    x = set_level(resample(pcm, rate, SR), -20.0)
    onset = int(np.argmax(np.abs(x) > 0.02))
    speech = np.concatenate([np.zeros(LEAD, np.float32), x[onset : onset + 3 * SR]])
    manager = SessionManager(LoopbackEngine(num_slots=1, prefill_s=0.5), cache_bytes=0)
    with serving_app(manager, max_sessions=1) as server:
        service = PersonaPlexLLMService(url=server.ws_url + "/api/chat", max_audio_ahead_s=None)
        # fed from the moment the pipeline starts, while the session is still being opened
        result = await run_call(service, speech, SR, out_rate=SR, tail_s=1.5)
    assert result.errors == []
    out = np.concatenate(
        [np.frombuffer(f.audio, "<i2").astype(np.float32) / 32768.0 for f in result.of(TTSAudioRawFrame)]
    )
    first_words = speech[LEAD : LEAD + SR // 5]
    assert window_found(first_words, out, search=SR) >= 0.8
    assert service.stats["input_samples_dropped"] == 0
    assert manager.metrics.jitter_dropped_frames.value == 0
