"""Phone-path transport audio: our μ-law + low-delay resampler against Pipecat's Twilio serializer.

Both sides run on the same espeak-ng speech, band-limited like a phone line, in 20 ms chunks:
inbound 160 μ-law bytes at 8 kHz -> 24 kHz PCM, outbound 24 kHz PCM in 480-sample chunks -> μ-law.

* delay_ms_in / delay_ms_out: time from a sound entering to it leaving = where the content sits in
  the output (cross-correlation against a delay-free one-shot resample) + the output backlog at
  chunk boundaries (input time consumed minus output time emitted, averaged over chunks).
* snr_db: the whole round trip μ-law 8 kHz -> 24 kHz -> μ-law 8 kHz, against the decoded input;
  snr_db_300_3400: the same with both limited to the telephone band first (the μ-law noise above
  3.4 kHz that a telephony filter removes no longer counts as error); snr_db_vs_source: against
  the speech before its first μ-law encoding (what the listener hears relative to the talker);
  resample_snr_db: the same without μ-law (the resamplers alone).
* us_per_20ms: CPU time per 20 ms of call audio, both directions (codec + resampling).

Pipecat's side is ``TwilioFrameSerializer`` with its default parameters (soxr ResampleStream, VHQ)
and a 24 kHz pipeline; its timing calls the same ``ulaw_to_pcm``/``pcm_to_ulaw`` helpers the
serializer calls, without the JSON/base64 envelope (which we would pay too).

``--candidates`` also prints the measurements behind the choice of resampler (docs/audio.md).
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support_audio import band_limit, espeak_speech, fractional_delay, snr_db, telephone_speech

from personaplex_voice.audio.mulaw import ulaw_decode, ulaw_encode
from personaplex_voice.audio.resample import (
    BlockResampler,
    StreamingResampler,
    design_lowdelay_lowpass,
    resample,
)

IN_CHUNK, OUT_CHUNK = 160, 480  # 20 ms at 8 kHz and at 24 kHz


def delay_s(chunks_in: list[np.ndarray], chunks_out: list[np.ndarray], in_rate: int, out_rate: int) -> float:
    """Content delay of the streamed output plus its mean backlog behind the input, in seconds."""
    x, y = np.concatenate(chunks_in), np.concatenate(chunks_out)
    content = fractional_delay(resample(x, in_rate, out_rate), y, out_rate)
    n_in = np.cumsum([len(c) for c in chunks_in]) / in_rate
    n_out = np.cumsum([len(c) for c in chunks_out]) / out_rate
    return float(content) + float(np.mean(n_in - n_out))


def aligned_snr(reference: np.ndarray, test: np.ndarray, max_lag: int = 4000, band: bool = False) -> float:
    """SNR after shifting ``test`` by the integer lag that best matches ``reference``; with
    ``band``, both are first limited to 300-3400 Hz (what the telephone band keeps)."""
    if band:
        reference, test = band_limit(reference, 8000, 300, 3400), band_limit(test, 8000, 300, 3400)
    n = len(reference) + len(test)
    xc = np.fft.irfft(np.fft.rfft(test, n) * np.conj(np.fft.rfft(reference, n)), n)
    lags = np.r_[0 : max_lag + 1]
    lag = int(lags[np.argmax(xc[lags])])
    m = min(len(reference), len(test) - lag)
    return snr_db(reference[:m], test[lag : lag + m])


def split(x: np.ndarray, size: int) -> list[np.ndarray]:
    return [x[i : i + size] for i in range(0, len(x) - size + 1, size)]


def path_report(signal_8k, decoded_in, ins, wide, outs_in, narrow, back, float_back, us_per_20ms) -> dict:
    """The same measurements for either path: delays each way, SNRs, CPU per 20 ms chunk."""
    return {
        "delay_ms_in": round(1e3 * delay_s(ins, wide, 8000, 24000), 3),
        "delay_ms_out": round(1e3 * delay_s(outs_in, narrow, 24000, 8000), 3),
        "snr_db": round(aligned_snr(decoded_in, back), 2),
        "snr_db_300_3400": round(aligned_snr(decoded_in, back, band=True), 2),
        "snr_db_vs_source": round(aligned_snr(signal_8k, back), 2),
        "resample_snr_db": round(aligned_snr(signal_8k, float_back), 2),
        "us_per_20ms": round(us_per_20ms, 1),
    }


def measure_ours(signal_8k: np.ndarray, repeats: int) -> dict:
    ulaw = ulaw_encode(signal_8k)
    decoded_in = ulaw_decode(ulaw)
    up, down = StreamingResampler(8000, 24000), StreamingResampler(24000, 8000)
    ins = split(decoded_in, IN_CHUNK)
    wide = [up.process(c) for c in ins]
    wide_all = np.concatenate(wide)
    outs_in = split(wide_all, OUT_CHUNK)
    narrow = [down.process(c) for c in outs_in]
    back = ulaw_decode(ulaw_encode(np.concatenate(narrow)))

    up2, down2 = StreamingResampler(8000, 24000), StreamingResampler(24000, 8000)
    float_back = np.concatenate(
        [
            down2.process(c)
            for c in split(np.concatenate([up2.process(c) for c in split(signal_8k, IN_CHUNK)]), OUT_CHUNK)
        ]
    )

    chunks = [ulaw[i : i + IN_CHUNK] for i in range(0, len(ulaw) - IN_CHUNK + 1, IN_CHUNK)]
    timings = {}
    for name, kind in (("streaming", StreamingResampler), ("block", BlockResampler)):
        up3, down3 = kind(8000, 24000), kind(24000, 8000)
        start = time.perf_counter()
        for _ in range(repeats):
            for c in chunks:
                ulaw_encode(down3.process(up3.process(ulaw_decode(c))))  # inbound, then outbound
        timings[name] = 1e6 * (time.perf_counter() - start) / (repeats * len(chunks))
    report = path_report(
        signal_8k, decoded_in, ins, wide, outs_in, narrow, back, float_back, timings["streaming"]
    )
    report["us_per_20ms_block"] = round(timings["block"], 1)  # the variant the Twilio bridge runs
    return report


async def measure_pipecat(signal_8k: np.ndarray, repeats: int) -> dict:
    from pipecat.audio.utils import create_stream_resampler, pcm_to_ulaw, ulaw_to_pcm
    from pipecat.frames.frames import InputAudioRawFrame, OutputAudioRawFrame
    from pipecat.serializers.twilio import TwilioFrameSerializer

    # Default parameters except the hang-up, which needs Twilio credentials and is not audio.
    ser = TwilioFrameSerializer("MZ-bench", params=TwilioFrameSerializer.InputParams(auto_hang_up=False))
    await ser.setup(types.SimpleNamespace(audio_in_sample_rate=24000, audio_out_sample_rate=24000))
    ulaw = ulaw_encode(signal_8k)
    decoded_in = ulaw_decode(ulaw)
    ins, wide = [], []
    for i in range(0, len(ulaw) - IN_CHUNK + 1, IN_CHUNK):
        chunk = ulaw[i : i + IN_CHUNK]
        message = {"event": "media", "media": {"payload": base64.b64encode(chunk).decode()}}
        frame = await ser.deserialize(json.dumps(message))
        ins.append(ulaw_decode(chunk))
        pcm = np.zeros(0, np.int16)
        if isinstance(frame, InputAudioRawFrame):
            pcm = np.frombuffer(frame.audio, np.int16)
        wide.append(pcm.astype(np.float32) / 32768)
    wide_all = np.concatenate(wide)
    outs_in, narrow = [], []
    for chunk in split(wide_all, OUT_CHUNK):
        pcm16 = np.clip(np.rint(chunk * 32768), -32768, 32767).astype(np.int16)
        out = await ser.serialize(
            OutputAudioRawFrame(audio=pcm16.tobytes(), sample_rate=24000, num_channels=1)
        )
        outs_in.append(chunk)
        payload = base64.b64decode(json.loads(out)["media"]["payload"]) if out else b""
        narrow.append(ulaw_decode(payload))
    back = np.concatenate(narrow)

    # the resamplers alone (no μ-law): Pipecat's stream resampler as the serializer creates it
    up, down = create_stream_resampler(), create_stream_resampler()
    pcm8 = np.clip(np.rint(signal_8k * 32768), -32768, 32767).astype(np.int16)
    wide16 = b"".join([await up.resample(c.tobytes(), 8000, 24000) for c in split(pcm8, IN_CHUNK)])
    wide16 = np.frombuffer(wide16, np.int16)
    back16 = b"".join([await down.resample(c.tobytes(), 24000, 8000) for c in split(wide16, OUT_CHUNK)])
    float_back = np.frombuffer(back16, np.int16).astype(np.float32) / 32768

    chunks = [ulaw[i : i + IN_CHUNK] for i in range(0, len(ulaw) - IN_CHUNK + 1, IN_CHUNK)]
    r_in, r_out = create_stream_resampler(), create_stream_resampler()
    start = time.perf_counter()
    for _ in range(repeats):
        for c in chunks:
            pcm = await ulaw_to_pcm(c, 8000, 24000, r_in)
            await pcm_to_ulaw(pcm, 24000, 8000, r_out)
    elapsed = time.perf_counter() - start
    us = 1e6 * elapsed / (repeats * len(chunks))
    return path_report(signal_8k, decoded_in, ins, wide, outs_in, narrow, back, float_back, us)


def stopband_db(taps: np.ndarray, rate: int, stop_hz: float) -> float:
    f = np.linspace(stop_hz, rate / 2, 4000)
    response = np.abs(np.exp(-2j * np.pi * np.outer(f / rate, np.arange(len(taps)))) @ taps)
    return float(20 * np.log10(response.max() / taps.sum()))


def worst_image_db(process_up, process_down) -> tuple[float, float]:
    """Image level (8->24 kHz: energy above 4 kHz for tones of 0.3-3.4 kHz) and alias level
    (24->8 kHz: tones of 4.6-11 kHz, which fold into the telephone band), in dB below the tone,
    worst case."""
    worst_image = worst_alias = -200.0
    for hz in (300, 1000, 2000, 3000, 3400):
        t = np.arange(8000) / 8000
        y = np.concatenate([process_up(c) for c in split(np.sin(2 * np.pi * hz * t).astype(np.float32), 160)])
        y = y[2400:]
        spec = np.abs(np.fft.rfft(y * np.hanning(len(y))))
        f = np.fft.rfftfreq(len(y), 1 / 24000)
        worst_image = max(worst_image, 20 * np.log10(spec[f >= 4000].max() / spec.max()))
    for hz in (4600, 5000, 7000, 9000, 11000):
        t = np.arange(24000) / 24000
        y = np.concatenate(
            [process_down(c) for c in split(np.sin(2 * np.pi * hz * t).astype(np.float32), 480)]
        )
        y = y[800:]
        spec = np.abs(np.fft.rfft(y * np.hanning(len(y))))
        # a full-scale tone through a unity-gain path peaks at sum(window)/2
        worst_alias = max(worst_alias, 20 * np.log10(spec.max() / (np.hanning(len(y)).sum() / 2)))
    return round(float(worst_image), 1), round(float(worst_alias), 1)


def candidates(signal_8k: np.ndarray) -> None:
    """The alternatives we measured before choosing the low-delay FIR (docs/audio.md)."""
    import soxr

    wide_ref = resample(signal_8k, 8000, 24000)
    ours = StreamingResampler(8000, 24000)
    taps = ours._taps_by_phase[:, ::-1].T.reshape(-1)  # back to the prototype's tap order
    image, alias = worst_image_db(
        StreamingResampler(8000, 24000).process, StreamingResampler(24000, 8000).process
    )
    print(
        f"ours: low-delay LS FIR, {len(taps)} taps at 24 kHz, group delay 1.5 ms, "
        f"stopband {stopband_db(taps, 24000, 4000):.1f} dB, measured images {image} dB, aliases {alias} dB"
    )
    for n in (97, 145, 193, 257):
        lin = design_lowdelay_lowpass(24000, 3400.0, 4000.0, n, (n - 1) / 2, 3.0)
        print(
            f"linear-phase FIR {n} taps: delay {(n - 1) / 2 / 24:.2f} ms, "
            f"stopband {stopband_db(lin, 24000, 4000):.1f} dB"
        )
    for quality in ("QQ", "LQ", "MQ", "HQ", "VHQ"):
        delays = []
        for a, b, x, size in ((8000, 24000, signal_8k, IN_CHUNK), (24000, 8000, wide_ref, OUT_CHUNK)):
            stream = soxr.ResampleStream(a, b, 1, dtype="float32", quality=quality)
            ins = split(x, size)
            outs = [stream.resample_chunk(c) for c in ins]
            delays.append(1e3 * delay_s(ins, outs, a, b))
        image, alias = worst_image_db(
            soxr.ResampleStream(8000, 24000, 1, dtype="float32", quality=quality).resample_chunk,
            soxr.ResampleStream(24000, 8000, 1, dtype="float32", quality=quality).resample_chunk,
        )
        print(
            f"soxr ResampleStream {quality}, 20 ms chunks: delay 8->24 {delays[0]:.2f} ms, "
            f"24->8 {delays[1]:.2f} ms, images {image} dB, aliases {alias} dB"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timing passes over the signal")
    parser.add_argument("--candidates", action="store_true", help="also print the design comparison")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        speech, rate = espeak_speech(Path(tmp))
    signal_8k = telephone_speech(speech, rate)
    if args.candidates:
        candidates(signal_8k)
    ours = measure_ours(signal_8k, args.repeats)
    pipecat = asyncio.run(measure_pipecat(signal_8k, args.repeats))
    ratios = {
        "round_trip_delay_ms_saved": round(
            pipecat["delay_ms_in"] + pipecat["delay_ms_out"] - ours["delay_ms_in"] - ours["delay_ms_out"], 2
        ),
        "cpu_ratio_ours_over_pipecat": round(ours["us_per_20ms"] / pipecat["us_per_20ms"], 2),
    }
    print(json.dumps({"ours": ours, "pipecat": pipecat, "ratios": ratios}))


if __name__ == "__main__":
    main()
