"""A Twilio call's echo delay when its prompt takes a while: does the start leave lasting delay?

    .venv/bin/python bench/twilio_start_delay.py [--prefill-s 0 0.3 0.6]

The Twilio bridge on the real server app (in this process, Twilio's cloud faked by the test
simulator), the loopback engine with a system prompt of `--prefill-s`. The simulated caller's
line sends silence from the moment the stream starts (as Twilio's does) until the agent's audio
comes, then a 1 kHz tone; the tone's echo delay (mouth to ear, as tests/test_twilio_e2e.py
measures it) shows whether the audio kept from the prefill, caught up by the engine, stayed as
delay on the line. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support_twilio import RATE, bridge_harness, tone
from test_twilio_e2e import echo_delay_and_snr, wait_audio

from personaplex_voice.engine.loopback import LoopbackEngine

PERSONAS = "default: desk\npersonas:\n  desk: {text_prompt: 'Front desk.'}\n"


async def one_call(prefill_s: float) -> dict[str, float]:
    engine = LoopbackEngine(num_slots=2, prefill_s=prefill_s)
    with (
        tempfile.TemporaryDirectory() as tmp,
        bridge_harness(PERSONAS, Path(tmp), engine=engine, manager_options={"cache_bytes": 0}) as h,
    ):
        call_sid, url, params = await asyncio.to_thread(h.sim.answer)
        lead, signal = np.zeros(6 * 640, np.float32), tone(1000.0, 1.5)
        async with h.sim.media_stream(url, params, call_sid=call_sid) as call:
            primed = await wait_audio(call)
            await call.play(lead)
            await call.play(signal)
            await call.play(np.zeros(RATE // 2, np.float32))
        delay, _ = echo_delay_and_snr(call.played_audio(), signal, primed + len(lead))
        metrics = h.manager.metrics
        return {
            "line_silence_before_ready_s": primed / RATE,
            "echo_delay_ms": 1000 * delay,
            "catchup_frames": metrics.catchup_frames.value,
            "catchup_silent_frames": metrics.catchup_silent_frames.value,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill-s", type=float, nargs="+", default=[0.0, 0.3, 0.6])
    args = parser.parse_args()
    rows = {}
    for prefill_s in args.prefill_s:
        row = asyncio.run(one_call(prefill_s))
        rows[f"prefill {prefill_s:g} s"] = row
        print(f"prefill {prefill_s:.1f} s: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
