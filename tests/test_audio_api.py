"""Smoke tests of the transport-audio API other areas code against (docs: /work/team/API.md)."""

from __future__ import annotations

import numpy as np
import pytest

from personaplex_voice.audio import (
    ChunkBuffer,
    FrameBuffer,
    OggError,
    OggOpusReader,
    OggOpusWriter,
    StreamingResampler,
    ulaw_decode,
    ulaw_encode,
)
from personaplex_voice.audio.io import read_audio, write_wav
from personaplex_voice.audio.resample import resample
from personaplex_voice.errors import UserError


def tone(rate: int, seconds: float, hz: float = 440.0, amp: float = 0.3) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (amp * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def test_ulaw_round_trip_shapes_and_silence_byte():
    x = tone(8000, 0.02)
    data = ulaw_encode(x)
    assert isinstance(data, bytes) and len(data) == 160
    y = ulaw_decode(data)
    assert y.dtype == np.float32 and y.shape == (160,)
    assert np.max(np.abs(y - x)) < 0.02
    assert ulaw_encode(np.zeros(4, np.float32)) == b"\xff" * 4


def test_streaming_resampler_8k_to_24k_and_back():
    up, down = StreamingResampler(8000, 24000), StreamingResampler(24000, 8000)
    x = tone(8000, 0.2)
    y = np.concatenate([up.process(x[i : i + 160]) for i in range(0, len(x), 160)])
    assert y.dtype == np.float32 and len(y) == 3 * len(x)
    assert up.delay_samples == pytest.approx(36.0)  # 1.5 ms at 24 kHz
    z = down.process(y)
    assert len(z) == len(x) and down.delay_samples == pytest.approx(12.0)
    tail = up.flush()
    assert len(tail) >= up.delay_samples


def test_one_shot_resample_any_rate():
    y = resample(tone(44100, 0.5), 44100, 24000)
    assert y.dtype == np.float32 and len(y) == 12000


def test_opus_writer_reader_round_trip():
    writer, reader = OggOpusWriter(), OggOpusReader()
    x = tone(24000, 0.5)
    first = writer.write(x[:1920])
    assert first.startswith(b"OggS") and b"OpusHead" in first and b"OpusTags" in first
    data = first + writer.write(x[1920:]) + writer.flush()
    out = np.concatenate(reader.feed(data))
    assert out.dtype == np.float32 and len(out) == len(x)
    assert float(np.corrcoef(x, out)[0, 1]) > 0.95
    assert reader.dropped == 0
    with pytest.raises(OggError):
        OggOpusReader().feed(b"not an ogg stream")


def test_frame_and_chunk_buffers():
    frames = FrameBuffer(1920)
    frames.push(np.ones(1000, np.float32))
    assert frames.pop() is None and len(frames) == 1000
    frames.push(np.ones(3000, np.float32))
    assert [len(f) for f in frames.pop_all()] == [1920, 1920] and len(frames) == 160
    chunks = ChunkBuffer(160)
    chunks.push(b"\x01" * 400)
    assert chunks.pop_all() == [b"\x01" * 160] * 2 and len(chunks) == 80


def test_read_audio_mixes_and_resamples(tmp_path):
    stereo = np.stack([tone(44100, 0.25), tone(44100, 0.25)], axis=1)
    path = tmp_path / "stereo.wav"
    write_wav(path, stereo, 44100)
    y = read_audio(path)
    assert y.dtype == np.float32 and y.ndim == 1 and len(y) == 6000
    (tmp_path / "junk.wav").write_bytes(b"junk" * 10)
    with pytest.raises(UserError, match=r"junk\.wav"):
        read_audio(tmp_path / "junk.wav")
