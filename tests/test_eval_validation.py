"""eval's timing measures on speech nobody scripted for them: conversations of other espeak-ng
voices changed by sox, with their own timing and pink, brown or white noise, the agent hearing
with silero-vad, checked against where the clean audio (tapped off the line before the noise
and the codec) has sound. The response and stop latencies must be within 120 ms of the truth
at the 90th percentile, at 24 kHz and over μ-law at 8 kHz (personaplex_voice/eval/validation.py;
`python -m personaplex_voice.eval.validation` prints every measure's errors)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from personaplex_voice.eval import validation

pytestmark = pytest.mark.timeout(600)

CONVERSATIONS = 6
P90_LIMIT_MS = 120.0


@pytest.fixture(scope="module")
def material(tmp_path_factory) -> validation.Material:
    """Synthesised once for both lines (espeak-ng and sox are the slow part)."""
    return validation.build(tmp_path_factory.mktemp("conversations"), CONVERSATIONS, seed=1)


@pytest.mark.parametrize("line", ["wideband", "twilio"])
def test_latencies_are_within_120_ms_of_the_truth_at_p90(material, line, tmp_path):
    found = asyncio.run(validation.validate_line(material, line, tmp_path, words="text"))
    errors = found["errors"]
    # Every turn was measured: three answers and one barge-in per conversation.
    assert len(errors["response_ms"]) == 3 * CONVERSATIONS
    assert len(errors["stop_ms"]) == CONVERSATIONS
    for name in ("response_ms", "stop_ms"):
        p90 = float(np.percentile(np.abs(errors[name]), 90))
        assert p90 <= P90_LIMIT_MS, (line, name, found["errors_ms"])
    assert found["errors_ms"]["turn_end_ms"]["n"] == 3 * CONVERSATIONS


def test_the_truth_is_the_clean_sound_not_a_detector():
    rate = 16000
    clean = np.zeros(rate, np.float32)
    clean[4000:8000] = 0.3 * np.sin(np.arange(4000) * 0.3)
    clean[8000:8800] = 0.001 * np.sin(np.arange(800) * 0.3)  # a tail 50 dB down: not sound
    (seg,) = validation.sound_segments(clean, rate)
    assert (round(seg.start, 3), round(seg.end, 3)) == (0.25, 0.5)
    noise = np.full(rate, 0.05, np.float32)  # a sound under the noise laid over it is heard by nobody
    clean[12000:13000] = 0.02
    assert len(validation.sound_segments(clean, rate)) == 2
    assert len(validation.sound_segments(clean, rate, noise)) == 1
