"""Audio files: common formats and rates in, float WAV out, one clear error for anything else."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import soundfile

from personaplex_voice.audio.io import read_audio, write_wav
from personaplex_voice.errors import UserError


def tone(rate: int, seconds: float = 0.5, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (0.4 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def dominant_hz(x: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.fft.rfftfreq(len(x), 1 / rate)[np.argmax(spectrum)])


@pytest.mark.parametrize(
    ("suffix", "fmt", "subtype", "rate"),
    [
        ("wav", "WAV", "PCM_16", 16000),
        ("wav", "WAV", "FLOAT", 48000),
        ("flac", "FLAC", "PCM_24", 44100),
        ("ogg", "OGG", "VORBIS", 22050),
    ],
)
def test_common_formats_and_rates_come_back_24k_mono(tmp_path, suffix, fmt, subtype, rate):
    path = tmp_path / f"in.{suffix}"
    stereo = np.stack([tone(rate), tone(rate)], axis=1)
    soundfile.write(str(path), stereo, rate, format=fmt, subtype=subtype)
    y = read_audio(path)
    assert y.dtype == np.float32 and y.ndim == 1
    assert len(y) == pytest.approx(12000, abs=2)
    assert dominant_hz(y, 24000) == pytest.approx(440, abs=3)
    assert float(np.sqrt(np.mean(y[1000:-1000] ** 2))) == pytest.approx(0.4 / np.sqrt(2), rel=0.05)


def test_stereo_is_averaged(tmp_path):
    left, right = tone(24000, hz=300), tone(24000, hz=900)
    path = tmp_path / "lr.wav"
    write_wav(path, np.stack([left, right], axis=1), 24000)
    np.testing.assert_allclose(read_audio(path), (left + right) / 2, atol=1e-6)


def test_mp3_and_espeak_speech_are_read(tmp_path):
    mp3 = tmp_path / "tone.mp3"
    soundfile.write(str(mp3), tone(44100), 44100, format="MP3", subtype="MPEG_LAYER_III")
    y = read_audio(mp3)
    assert dominant_hz(y, 24000) == pytest.approx(440, abs=3)
    wav = tmp_path / "speech.wav"  # espeak-ng writes 22.05 kHz 16-bit WAV
    subprocess.run(["espeak-ng", "-w", str(wav), "testing one two"], check=True, capture_output=True)
    speech = read_audio(wav, sample_rate=8000)
    assert speech.dtype == np.float32 and len(speech) > 4000 and np.abs(speech).max() > 0.05


def test_write_wav_keeps_floats_exactly(tmp_path):
    x = np.array([0.0, 0.123456789, -1.5, 2.0], dtype=np.float32)  # out of range survives FLOAT
    path = tmp_path / "f.wav"
    write_wav(path, x, 24000)
    info = soundfile.info(str(path))
    assert info.subtype == "FLOAT" and info.samplerate == 24000
    back, _ = soundfile.read(str(path), dtype="float32")
    np.testing.assert_array_equal(back, x)
    write_wav(tmp_path / "p.wav", x, 8000, subtype="PCM_16")
    assert soundfile.info(str(tmp_path / "p.wav")).subtype == "PCM_16"


def test_unreadable_files_raise_user_error_naming_them(tmp_path):
    with pytest.raises(UserError, match="missing"):
        read_audio(tmp_path / "missing.wav")
    (tmp_path / "text.wav").write_text("this is not audio\n")
    with pytest.raises(UserError, match=r"text\.wav"):
        read_audio(tmp_path / "text.wav")
    (tmp_path / "empty.flac").write_bytes(b"")
    with pytest.raises(UserError, match=r"empty\.flac"):
        read_audio(tmp_path / "empty.flac")
    with pytest.raises(UserError, match="adir"):
        (tmp_path / "adir").mkdir()
        read_audio(tmp_path / "adir")
