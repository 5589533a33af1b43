"""G.711 μ-law: known code points and the quality of a round trip on speech-level signals."""

from __future__ import annotations

import numpy as np
import pytest
from support_audio import espeak_speech, set_level, snr_db, telephone_speech

from personaplex_voice.audio.mulaw import ULAW_SILENCE, float_to_int16, ulaw_decode, ulaw_encode


@pytest.fixture(scope="session")
def phone_speech(tmp_path_factory) -> np.ndarray:
    speech, rate = espeak_speech(tmp_path_factory.mktemp("speech"))
    return telephone_speech(speech, rate)


def test_g711_code_points():
    # G.711 μ-law: 0 -> 0xFF, full-scale positive -> 0x80, full-scale negative -> 0x00.
    assert ulaw_encode(np.array([0.0, 1.0, -1.0], np.float32)) == bytes([ULAW_SILENCE, 0x80, 0x00])
    decoded = ulaw_decode(bytes([0xFF, 0x7F, 0x80, 0x00]))
    assert decoded[0] == 0 and decoded[1] == 0
    assert decoded[2] == pytest.approx(32124 / 32768) and decoded[3] == pytest.approx(-32124 / 32768)


def test_every_byte_decodes_and_reencodes_to_itself():
    every = bytes(range(256))
    again = ulaw_encode(ulaw_decode(every))
    # 0x7F and 0xFF both mean zero; every other code survives a decode/encode exactly
    assert [a for a, b in zip(every, again, strict=True) if a != b] == [0x7F]


# Speech-level: RMS from -35 dBFS (quiet caller) to -20 dBFS (peaks just under full scale).
@pytest.mark.parametrize("level_dbfs", [-35.0, -30.0, -25.0, -20.0])
def test_speech_round_trip_snr_at_least_35db(phone_speech, level_dbfs):
    x = set_level(phone_speech, level_dbfs)
    assert snr_db(x, ulaw_decode(ulaw_encode(x))) >= 35


def test_tone_round_trip_and_clipping():
    t = np.arange(8000) / 8000
    x = (0.25 * np.sin(2 * np.pi * 1000 * t)).astype(np.float32)
    assert snr_db(x, ulaw_decode(ulaw_encode(x))) >= 35
    # out-of-range input clips to full scale instead of wrapping around
    assert list(float_to_int16(np.array([1.5, -1.5, 2.0], np.float32))) == [32767, -32768, 32767]
    assert ulaw_encode(np.array([1.5], np.float32)) == ulaw_encode(np.array([1.0], np.float32))


def test_lengths_types_and_empty():
    assert ulaw_encode(np.zeros(0, np.float32)) == b""
    assert ulaw_decode(b"").shape == (0,)
    out = ulaw_decode(bytearray(b"\x80" * 160))
    assert out.dtype == np.float32 and out.shape == (160,)
    assert len(ulaw_encode(np.zeros(480, np.float64))) == 480
