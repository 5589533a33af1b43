"""How much faster `personaplex-voice eval` runs a suite batched than one call at a time.

    .venv/bin/python bench/eval_speed.py [--scenarios 16] [--seconds 30] [--model demo]
        [--device cpu] [--skip-solo] [--words heard|text] [--agent model|scripted]

Builds `--scenarios` scripted calls of about `--seconds` each (greeting wait, questions, a pause,
a barge-in, keys; alternating the wideband and Twilio lines) and runs the whole eval pipeline on
them twice in this process: batched (one engine with a slot per call, one SessionManager) and one
at a time (a one-slot engine, each call its own run). Each: wall seconds, seconds of call audio
per wall second (x real time), the engine's share, and the recogniser's (pocketsphinx hearing
each agent's speech: `--words heard`, the default, as `eval` runs); then the speed-up. Everything
the eval does is counted (engine, line codecs, VAD, recogniser and measures, report and files).
`--agent scripted` answers with the scripted agent (espeak-ng speech, silero-vad ears) instead of
`--model`: the demo model babbles sounds the VAD does not take for speech, so only a talking
agent shows what hearing its words costs. On a GPU, e.g. `--scenarios 64 --device cuda
--skip-solo`. Last line: one JSON object. Printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from personaplex_voice.engine.base import SAMPLE_RATE
from personaplex_voice.engine.factory import build_engine
from personaplex_voice.engine.options import configure_threads
from personaplex_voice.engine.scripted import Reply, ScriptedEngine
from personaplex_voice.eval.scenario import load_scenarios
from personaplex_voice.eval.speech import ClipBook, synthesize
from personaplex_voice.eval.steps import CallerVoice
from personaplex_voice.eval.suite import plan_calls, run_suite

AGENT_VOICE = CallerVoice(voice="en-us+f2", rate=150)
REPLIES = (
    "Thank you for calling CitySan Services, how can I help you today?",
    "Let me look up the collection schedule for your street.",
    "Your next pickup is on Tuesday the fourteenth.",
)
LINES = [
    "Hello, I am calling about my waste collection.",
    "My address is twenty three Oak Street,",
    "apartment nine. When is the next pickup?",
    "And what about the recycling bins?",
    "Sorry, I meant the garden waste.",
    "Thank you, that is all for today.",
]


def scenario_file(folder: Path, count: int, seconds: float) -> Path:
    speech_s = sum(len(synthesize(line, CallerVoice())) for line in LINES) / SAMPLE_RATE
    fixed_s = speech_s + 2.0 + 2.0 + 0.8 + 2.5 + 0.6 + 1.5 + 0.2  # silences, pause, cue wait, key
    text = ["scenarios:"]
    for i in range(count):
        fill = max(1.0, seconds - fixed_s - 0.08 * (i % 5))
        text += [
            f"  - name: call{i:02d}",
            f"    persona: {{text_prompt: 'You work for CitySan Services. Call {i}.', voice: NATF2}}",
            f"    line: {'twilio' if i % 2 else 'wideband'}",
            "    script:",
            f"      - silence: {2.0 + 0.08 * (i % 5):.2f}s",
            f"      - say: {LINES[0]!r}",
            "      - silence: 2s",
            f"      - say: {LINES[1]!r}",
            "      - pause: 0.8s",
            f"      - say: {LINES[2]!r}",
            "      - silence: 2.5s",
            f"      - say: {LINES[3]!r}",
            f"      - barge_in: {{after_agent_speech_ms: 600, say: {LINES[4]!r}, max_wait: 3s}}",
            "      - silence: 1.5s",
            '      - dtmf: "9"',
            f"      - say: {LINES[5]!r}",
            f"      - silence: {fill:.1f}s",
            "    expect: {responds_within_ms: 1000, max_pause_takeovers: 0}",
        ]
    path = folder / "bench.yaml"
    path.write_text("\n".join(text) + "\n", encoding="utf-8")
    return path


def make_engine(args: argparse.Namespace, slots: int):
    if args.agent == "scripted":
        replies = [Reply(text, synthesize(text, AGENT_VOICE)) for text in REPLIES]
        return ScriptedEngine(slots, replies=replies, respond_after_ms=300, stop_after_ms=200, greet=True)
    engine = build_engine(args.model, num_slots=slots, device=args.device)
    configure_threads(args.threads, engine)
    return engine


async def batched(args: argparse.Namespace, scenarios, clips: ClipBook, out: Path) -> dict:
    plans = plan_calls(scenarios)
    engine = make_engine(args, len(plans))
    started = time.perf_counter()
    summary, _ = await run_suite(scenarios, plans, clips, out, engine=engine, words=args.words)
    wall = time.perf_counter() - started
    run = summary.run
    return {
        **run,
        "wall_s": round(wall, 2),
        "x_realtime": round(run["audio_s"] / wall, 2),
        "engine_share": round(run["engine_s"] / wall, 3),
        "recognizer_share": round(run.get("recognizer_s", 0.0) / wall, 3),
    }


async def one_at_a_time(args: argparse.Namespace, scenarios, clips: ClipBook, out: Path) -> dict:
    engine = make_engine(args, 1)
    started = time.perf_counter()
    audio = engine_s = ticks = heard_s = heard_audio = 0.0
    for i, scenario in enumerate(scenarios):
        summary, _ = await run_suite(
            [scenario], plan_calls([scenario]), clips, out / str(i), engine=engine, words=args.words
        )
        audio += summary.run["audio_s"]
        engine_s += summary.run["engine_s"]
        ticks += summary.run["ticks"]
        heard_s += summary.run.get("recognizer_s", 0.0)
        heard_audio += summary.run.get("recognized_audio_s", 0.0)
    wall = time.perf_counter() - started
    return {
        "calls": len(scenarios),
        "audio_s": round(audio, 2),
        "wall_s": round(wall, 2),
        "x_realtime": round(audio / wall, 2),
        "engine_s": round(engine_s, 2),
        "ticks": int(ticks),
        "recognizer_s": round(heard_s, 2),
        "recognized_audio_s": round(heard_audio, 2),
        "engine_share": round(engine_s / wall, 3),
        "recognizer_share": round(heard_s / wall, 3),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenarios", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--skip-solo", action="store_true", help="only the batched run")
    parser.add_argument("--words", choices=("heard", "text"), default="heard", help="recogniser on or off")
    parser.add_argument("--agent", choices=("model", "scripted"), default="model", help="who answers")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="eval-speed-") as tmp:
        root = Path(tmp)
        scenarios = load_scenarios([scenario_file(root, args.scenarios, args.seconds)])
        clips = ClipBook()
        clips.add_scenarios(scenarios)
        report: dict = {
            "scenarios": args.scenarios,
            "seconds": args.seconds,
            "model": args.model if args.agent == "model" else "scripted agent",
            "device": args.device,
            "words": args.words,
        }
        report["batched"] = await batched(args, scenarios, clips, root / "batched")
        print(f"batched:        {json.dumps(report['batched'])}", flush=True)
        if not args.skip_solo:
            report["one_at_a_time"] = await one_at_a_time(args, scenarios, clips, root / "solo")
            print(f"one at a time:  {json.dumps(report['one_at_a_time'])}", flush=True)
            report["speedup"] = round(report["one_at_a_time"]["wall_s"] / report["batched"]["wall_s"], 2)
            print(f"speed-up (wall, one at a time / batched): {report['speedup']}x", flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    asyncio.run(main())
