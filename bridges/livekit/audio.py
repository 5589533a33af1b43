"""LiveKit audio frames <-> the model's 24 kHz mono float32 PCM.

In: whatever LiveKit hands the model (48 kHz from a room, 16 kHz from a SIP trunk, stereo from a
file) is mixed to mono and resampled to 24 kHz: with our 1.5 ms low-delay streaming resampler
for the rates it streams (8, 16, 24, 48 kHz...), with LiveKit's own for the others (44.1 kHz).
Out: each 80 ms model frame becomes one 24 kHz mono int16 `rtc.AudioFrame`; LiveKit's audio
output resamples to the room's rate itself.
"""

from __future__ import annotations

import numpy as np

from livekit import rtc
from personaplex_voice.audio.resample import StreamingResampler
from personaplex_voice.engine.base import SAMPLE_RATE


class InputAudio:
    """One session's input conversion; the resampler state of each input rate is kept, so a
    stream stays continuous across frames."""

    def __init__(self) -> None:
        self._ours: dict[int, StreamingResampler] = {}
        self._livekit: dict[int, rtc.AudioResampler] = {}

    def convert(self, frame: rtc.AudioFrame) -> np.ndarray:
        channels = max(1, frame.num_channels)
        pcm = np.frombuffer(frame.data, dtype=np.int16).astype(np.float32) / 32768.0
        if channels > 1:
            pcm = pcm[: len(pcm) // channels * channels].reshape(-1, channels).mean(axis=1)
        rate = frame.sample_rate
        if rate == SAMPLE_RATE:
            return pcm
        resampler = self._ours.get(rate)
        if resampler is None and rate not in self._livekit:
            try:
                resampler = self._ours[rate] = StreamingResampler(rate, SAMPLE_RATE)
            except ValueError:  # a ratio ours does not stream (44.1 kHz): LiveKit's
                self._livekit[rate] = rtc.AudioResampler(rate, SAMPLE_RATE, num_channels=1)
        if resampler is not None:
            return resampler.process(pcm)
        mono = rtc.AudioFrame(
            data=_to_int16(pcm).tobytes(), sample_rate=rate, num_channels=1, samples_per_channel=len(pcm)
        )
        out = [np.frombuffer(f.data, dtype=np.int16) for f in self._livekit[rate].push(mono)]
        if not out:
            return np.zeros(0, np.float32)
        return np.concatenate(out).astype(np.float32) / 32768.0


def output_frame(pcm: np.ndarray) -> rtc.AudioFrame:
    """One model frame (24 kHz mono float32) as LiveKit audio."""
    data = _to_int16(pcm)
    return rtc.AudioFrame(
        data=data.tobytes(), sample_rate=SAMPLE_RATE, num_channels=1, samples_per_channel=len(data)
    )


def _to_int16(pcm: np.ndarray) -> np.ndarray:
    return (np.clip(pcm, -1.0, 1.0) * 32767.0).round().astype(np.int16)
