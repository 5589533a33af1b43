"""The streaming resampler: delay, passband, image/alias rejection, speech round trip, chunking."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support_audio import espeak_speech, fractional_delay, snr_db, telephone_speech

from personaplex_voice.audio.resample import BlockResampler, StreamingResampler, resample

RATES = (8000, 16000, 24000, 48000)


@pytest.fixture(scope="session")
def phone_speech(tmp_path_factory) -> np.ndarray:
    """espeak-ng speech as a phone line carries it: 8 kHz, 300-3400 Hz, -20 dBFS."""
    speech, rate = espeak_speech(tmp_path_factory.mktemp("speech"))
    return telephone_speech(speech, rate)


def stream(resampler: StreamingResampler, x: np.ndarray, chunk: int) -> tuple[np.ndarray, float]:
    """Feeds ``x`` in chunks; returns the output and the mean backlog in seconds (input time
    consumed minus output time emitted, after each chunk): the part of the delay spent waiting."""
    outs, backlog, n_in, n_out = [], [], 0, 0
    for i in range(0, len(x), chunk):
        piece = x[i : i + chunk]
        y = resampler.process(piece)
        outs.append(y)
        n_in, n_out = n_in + len(piece), n_out + len(y)
        backlog.append(n_in / resampler.in_rate - n_out / resampler.out_rate)
    return np.concatenate(outs), float(np.mean(backlog))


def tone(rate: int, hz: float, seconds: float = 0.25, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (amp * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def tone_amplitude(x: np.ndarray, rate: int, hz: float) -> float:
    """Least-squares amplitude of the ``hz`` component of ``x``."""
    t = np.arange(len(x)) / rate
    basis = np.stack([np.sin(2 * np.pi * hz * t), np.cos(2 * np.pi * hz * t)], axis=1)
    coef, *_ = np.linalg.lstsq(basis, x.astype(np.float64), rcond=None)
    return float(np.hypot(*coef))


@pytest.mark.parametrize(("in_rate", "out_rate"), [(8000, 24000), (24000, 8000)])
def test_delay_with_20ms_chunks_is_under_2ms(phone_speech, in_rate, out_rate):
    signal = phone_speech if in_rate == 8000 else resample(phone_speech, 8000, 24000)
    resampler = StreamingResampler(in_rate, out_rate)
    out, backlog = stream(resampler, signal, in_rate // 50)
    # Where the content sits in the output (against a delay-free reference) plus how long output
    # lags input at chunk boundaries: the time from a sound entering to it leaving.
    content_delay = fractional_delay(resample(signal, in_rate, out_rate), out, out_rate)
    delay = content_delay + backlog
    assert 0 <= delay <= 2e-3
    assert content_delay == pytest.approx(resampler.delay_seconds, abs=2e-5)


@pytest.mark.parametrize(("in_rate", "out_rate"), [(8000, 24000), (24000, 8000)])
def test_telephony_passband_is_flat_within_half_a_db(in_rate, out_rate):
    settle = 0.02  # skip the filter's start-up
    for hz in (300, 500, 1000, 1500, 2000, 2500, 3000, 3300, 3400):
        out = StreamingResampler(in_rate, out_rate).process(tone(in_rate, hz))
        gain_db = 20 * np.log10(tone_amplitude(out[int(settle * out_rate) :], out_rate, hz) / 0.5)
        assert abs(gain_db) <= 0.5, (hz, gain_db)


def test_upsampling_rejects_images():
    # 8 kHz -> 24 kHz: a tone at f has images at 8k-f, 8k+f, 16k-f...; all must be > 60 dB down.
    for hz in (400, 1000, 2500, 3400):
        out = StreamingResampler(8000, 24000).process(tone(8000, hz))[480:]
        spectrum = np.abs(np.fft.rfft(out * np.hanning(len(out))))
        f = np.fft.rfftfreq(len(out), 1 / 24000)
        images = spectrum[f >= 4000].max()
        assert 20 * np.log10(images / spectrum.max()) < -60, hz


def test_downsampling_rejects_aliases():
    # 24 kHz -> 8 kHz: tones above 4.6 kHz would fold into the 300-3400 Hz telephone band and must
    # be > 65 dB down; 4-4.6 kHz folds into the 3.4-4 kHz transition band, > 45 dB down.
    reference = tone_amplitude(StreamingResampler(24000, 8000).process(tone(24000, 1000))[160:], 8000, 1000)
    for hz, limit_db in (
        (4100, -45),
        (4400, -45),
        (4600, -65),
        (5000, -65),
        (7000, -65),
        (9000, -65),
        (11000, -65),
    ):
        out = StreamingResampler(24000, 8000).process(tone(24000, hz))[160:]
        alias_hz = abs(hz - 8000 * round(hz / 8000))
        level_db = 20 * np.log10(tone_amplitude(out, 8000, alias_hz) / reference)
        assert level_db < limit_db, (hz, level_db)


def test_transition_band_does_not_bulge():
    # a low-delay fit left free between 3.4 and 4 kHz puts a +14 dB bump there (amplified line noise)
    for hz in range(3400, 4000, 50):
        out = StreamingResampler(8000, 24000).process(tone(8000, hz))
        assert 20 * np.log10(tone_amplitude(out[480:], 24000, hz) / 0.5) < 0.5, hz


def test_speech_round_trip_8k_24k_8k_keeps_40db(phone_speech):
    up, down = StreamingResampler(8000, 24000), StreamingResampler(24000, 8000)
    wide, _ = stream(up, phone_speech, 160)
    back, _ = stream(down, wide, 480)
    lag = round(up.delay_samples / 3 + down.delay_samples)  # 1.5 ms + 1.5 ms = 24 samples at 8 kHz
    assert snr_db(phone_speech[: len(back) - lag], back[lag:]) >= 40


@settings(max_examples=25, deadline=None)
@given(
    pair=st.sampled_from([p for p in itertools.permutations(RATES, 2)]),
    cuts=st.lists(st.integers(min_value=0, max_value=900), min_size=1, max_size=12),
)
def test_output_is_identical_for_any_chunking(pair, cuts):
    in_rate, out_rate = pair
    x = np.random.default_rng(7).uniform(-0.5, 0.5, 3000).astype(np.float32)
    whole = StreamingResampler(in_rate, out_rate)
    expected = np.concatenate([whole.process(x), whole.flush()])
    chunked = StreamingResampler(in_rate, out_rate)
    pieces, start = [], 0
    for size in [*cuts, len(x)]:
        pieces.append(chunked.process(x[start : start + size]))
        start += size
    pieces.append(chunked.flush())
    np.testing.assert_array_equal(np.concatenate(pieces), expected)


@pytest.mark.parametrize(("in_rate", "out_rate"), list(itertools.permutations(RATES, 2)))
def test_every_rate_pair_passes_speech_band_with_low_delay(in_rate, out_rate):
    resampler = StreamingResampler(in_rate, out_rate)
    assert resampler.delay_seconds <= 2e-3
    x = tone(in_rate, 1000)
    out = resampler.process(x)
    assert len(out) == len(x) * out_rate // in_rate
    amplitude = tone_amplitude(out[out_rate // 50 :], out_rate, 1000)
    assert amplitude == pytest.approx(0.5, rel=0.01)


def test_flush_returns_the_delayed_tail_and_reset_forgets():
    up = StreamingResampler(8000, 24000)
    x = tone(8000, 1000, seconds=0.1)
    body = up.process(x)
    tail = up.flush()
    assert len(tail) >= up.delay_samples
    # the last input sample's contribution lands in the tail, not lost
    assert np.abs(tail[: int(up.delay_samples)]).max() > 0.1
    # after flush (which resets) the same input gives the same output again
    np.testing.assert_array_equal(up.process(x), body)
    up.reset()
    np.testing.assert_array_equal(up.process(x), body)


def test_same_rate_is_a_copy_and_odd_ratios_are_refused():
    same = StreamingResampler(24000, 24000)
    x = tone(24000, 440)
    np.testing.assert_array_equal(same.process(x), x)
    assert same.delay_samples == 0
    with pytest.raises(ValueError, match="resample"):
        StreamingResampler(44100, 24000)
    with pytest.raises(ValueError):
        StreamingResampler(0, 24000)


def test_one_shot_resample_keeps_pitch_and_timing():
    x = tone(44100, 1000, seconds=0.5)
    y = resample(x, 44100, 24000)
    assert len(y) == 12000
    assert tone_amplitude(y[1000:-1000], 24000, 1000) == pytest.approx(0.5, rel=0.01)
    # delay-compensated: the phase of the tone is where it was (sin at t=0 crosses upward)
    t = np.arange(len(y)) / 24000
    assert np.corrcoef(y[1000:-1000], 0.5 * np.sin(2 * np.pi * 1000 * t[1000:-1000]))[0, 1] > 0.999
    assert len(resample(np.zeros(0, np.float32), 8000, 24000)) == 0


@pytest.mark.parametrize(
    ("in_rate", "out_rate"), [(24000, 8000), (8000, 24000), (16000, 48000), (48000, 24000)]
)
def test_block_resampler_matches_the_streaming_resampler(in_rate, out_rate) -> None:
    """The matrix-product variant is the same filter, whatever the chunking (to float rounding)."""
    x = (np.random.default_rng(1).standard_normal(in_rate) * 0.3).astype(np.float32)
    block, reference = BlockResampler(in_rate, out_rate), StreamingResampler(in_rate, out_rate)
    got, want, at = [], [], 0
    for size in [1920, 7, 500, 1, 160, 3333, 2, 640, 0] * 8:
        piece = x[at : at + size]
        at += size
        got.append(block.process(piece))
        want.append(reference.process(piece))
        assert len(got[-1]) == len(want[-1])
    got.append(block.flush())
    want.append(reference.flush())
    np.testing.assert_allclose(np.concatenate(got), np.concatenate(want), rtol=0, atol=1e-6)
    assert block.delay_samples == reference.delay_samples
