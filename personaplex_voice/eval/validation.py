"""How far eval's measures are from the truth, on conversations nobody scripted for them.

Each conversation is made of its own speakers (espeak-ng voices, each line's tempo and pitch
changed by sox), has its own timing (silences, when the caller cuts in) and its own noise (sox's
pink, brown or white noise at 15-25 dB below the speech), and runs through eval as usual: the
caller's lines as `wav:` steps, the agent the `ScriptedEngine` (which hears with silero-vad, so
its timing is whatever its ears make it), over a line (24 kHz, or μ-law at 8 kHz). The noise goes
in on both sides before the line's codec.

The truth comes from neither detector: the line is tapped before the noise and the codec, and
each side's *clean* audio, in the line's band (a sound the line cannot carry, like the high
hiss of a "th" on an 8 kHz line, is not heard by the caller either), gives where its sound is:
10 ms blocks within 40 dB of the side's loud blocks and above the noise laid over them (a
sound under the noise is heard by nobody), edges to the sample, gaps under 200 ms closed.
From that truth, each measure is computed by its definition (docs/eval.md) and set
against what eval measured from the noisy, coded call:

- `response_ms`: the first agent sound that ends after the caller's turn and starts before the
  caller's next one, minus the end of the caller's sound;
- `stop_ms`: the end of the agent sound under way when the barge-in's sound starts, minus that start;
- `turn_end_ms`: where eval put the end of each caller turn, against the sound's end;
- `first_word_ms` (with `--words heard`): the first word the recogniser heard in an answer,
  against the answer's first sound (what FDB's latency rests on).

    python -m personaplex_voice.eval.validation [--conversations 8] [--lines wideband,twilio]
        [--words text|heard] [--seed 0]

prints one JSON object: per line and measure, n, the mean error (bias) and the 50th/90th
percentile and maximum of the absolute error, in ms. tests/test_eval_validation.py holds it to
a 90th percentile within 120 ms for the response and stop latencies.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import soundfile

from personaplex_voice.audio.resample import resample
from personaplex_voice.engine.base import FRAME_SIZE, SAMPLE_RATE
from personaplex_voice.engine.scripted import Reply, ScriptedEngine
from personaplex_voice.errors import UserError

from .lines import Line, LineCodec, get_line
from .results import CallResult
from .scenario import load_scenarios
from .speech import ClipBook, synthesize
from .steps import CallerVoice
from .suite import plan_calls, run_suite
from .vad import Segment

TRUTH_LEVEL = 1e-3  # -60 dBFS: a sample of a clean synthetic clip with sound in it
TRUTH_DROP_DB = 40.0  # a clean block is sound when within this of the side's loud blocks
TRUTH_GAP_S = 0.2  # the measures' own gap: shorter silences inside a side's speech are closed
RESPOND_MS, STOP_MS = 350, 250  # the scripted agent's settings (its ears add their own lag)

CALLER_VOICES = (
    "en-us",
    "en-gb+m3",
    "en-us+f4",
    "en-us+m7",
    "en-gb-x-rp+f2",
    "en-us+m2",
    "en-gb+f3",
    "en-us+f1",
)
AGENT_VOICES = ("en-us+f2", "en-gb+m1", "en-us+f5")
QUESTIONS = (
    "Hello, I am calling about my bill for this month",
    "Can you tell me when the office opens tomorrow",
    "I would like to change the address on my account",
    "My order has not arrived yet and I am worried",
    "Do you have any appointments left on Friday",
    "I think there is a mistake on my last invoice",
    "Could you help me reset the password for my account",
    "We need a plumber at our house this week",
)
FOLLOW_UPS = (
    "And what about the late fee",
    "Is there parking near the building",
    "Should I send you a copy of the lease",
    "Can I get a refund for the shipping",
    "Would the morning be possible",
    "It says I paid twice for the same thing",
    "I also lost my phone last week",
    "The kitchen sink is leaking too",
)
CUT_INS = (
    "Sorry, wait, I meant the other bill",
    "Hold on, actually never mind that",
    "Sorry to cut in, it is the old address",
    "Wait, I just got a message from the courier",
    "Excuse me, Thursday would also work",
    "Sorry, let me find the invoice number first",
    "One moment, my email changed too",
    "Hold on, my wife says it is the bathroom",
)
REPLIES = (
    "Of course, let me pull up your account details right now",
    "Thank you for waiting, I can see the record here on my screen",
    "Alright, I understand, let us sort that out together",
)
NOISES = ("pinknoise", "brownnoise", "whitenoise")


def _block_levels(pcm: np.ndarray, rate: int) -> np.ndarray:
    block = rate // 100
    n = len(pcm) // block
    power = np.mean(pcm[: n * block].reshape(n, block).astype(np.float64) ** 2, axis=1)
    return 10 * np.log10(power + 1e-12)


def sound_segments(clean: np.ndarray, rate: int, noise: np.ndarray | None = None) -> list[Segment]:
    """Where a clean signal has sound a listener could hear: its 10 ms blocks within
    `TRUTH_DROP_DB` of its loud blocks (their 95th percentile), above -70 dBFS and, when the
    `noise` laid over it is given, above that noise's own level in the same block (a sound under
    the noise is heard by nobody); gaps under `TRUTH_GAP_S` closed, edges to the first and last
    sample above `TRUTH_LEVEL` inside the edge blocks."""
    block = rate // 100
    level = _block_levels(clean, rate)
    if level.size == 0 or not np.any(level > -70.0):
        return []
    floor = np.full(level.shape, -70.0)
    if noise is not None:
        floor = np.maximum(floor, _block_levels(noise[: len(clean)], rate)[: len(level)])
    loud_level = float(np.percentile(level[level > -70.0], 95))
    loud = np.flatnonzero((level >= loud_level - TRUTH_DROP_DB) & (level > floor))
    if loud.size == 0:
        return []
    gap = round(TRUTH_GAP_S * 100)
    breaks = np.flatnonzero(np.diff(loud) > gap)
    starts = np.concatenate([[loud[0]], loud[breaks + 1]]) * block
    ends = (np.concatenate([loud[breaks], [loud[-1]]]) + 1) * block
    out = []
    for s, e in zip(starts, ends, strict=True):
        above = np.flatnonzero(np.abs(clean[s:e]) > TRUTH_LEVEL)
        if above.size:
            out.append(Segment((s + above[0]) / rate, (s + above[-1] + 1) / rate))
    return out


class TappedCodec:
    """A line's codec with the truth tapped off before it: records both sides' clean 24 kHz
    frames, then adds this call's noise to each and hands them to the line."""

    def __init__(self, inner: LineCodec, noise: np.ndarray) -> None:
        self.inner = inner
        self.noise = noise
        self.caller: list[np.ndarray] = []
        self.agent: list[np.ndarray] = []
        self.caller_noise: list[np.ndarray] = []
        self.agent_noise: list[np.ndarray] = []

    def _noise(self, at: int) -> np.ndarray:
        start = (at * FRAME_SIZE) % (len(self.noise) - FRAME_SIZE)
        return self.noise[start : start + FRAME_SIZE]

    def uplink(self, caller: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.caller.append(np.asarray(caller, np.float32).copy())
        self.caller_noise.append(self._noise(len(self.caller)))
        return self.inner.uplink(caller + self.caller_noise[-1])

    def downlink(self, agent: np.ndarray) -> np.ndarray:
        self.agent.append(np.asarray(agent, np.float32).copy())
        self.agent_noise.append(self._noise(len(self.agent) + 7919))
        return self.inner.downlink(agent + self.agent_noise[-1])

    def truth(self, rate: int) -> tuple[list[Segment], list[Segment]]:
        """(caller, agent) sound as a listener on a line at `rate` could hear it."""

        def heard(clean: list[np.ndarray], noise: list[np.ndarray]) -> list[Segment]:
            pcm, over = (resample(np.concatenate(x), SAMPLE_RATE, rate) for x in (clean, noise))
            return sound_segments(pcm, rate, over if np.any(over) else None)

        return heard(self.caller, self.caller_noise), heard(self.agent, self.agent_noise)


@dataclass
class Tap:
    """One call's tap: makes its codec (a Line's `open`) and keeps it for the truth."""

    line: Line
    noise: np.ndarray
    codec: TappedCodec | None = None

    def open(self) -> TappedCodec:
        self.codec = TappedCodec(self.line.open(), self.noise)
        return self.codec


@dataclass
class Material:
    """Everything a validation run plays: the scenario file (caller lines as wav files), the
    agent's replies, each conversation's noise."""

    folder: Path
    scenario_file: Path
    replies: list[Reply]
    noise: dict[str, np.ndarray] = field(default_factory=dict)  # scenario name -> 24 kHz noise


def _need(tool: str) -> str:
    exe = shutil.which(tool)
    if exe is None:
        raise UserError(f"the validation needs {tool} (Debian/Ubuntu: apt install {tool})")
    return exe


def _sox(args: list[str], data: bytes | None = None) -> np.ndarray:
    done = subprocess.run([_need("sox"), *args], input=data, capture_output=True, check=False, timeout=60)
    if done.returncode != 0:
        raise UserError(f"sox {' '.join(args)} failed: {done.stderr.decode(errors='replace').strip()}")
    pcm, rate = soundfile.read(io.BytesIO(done.stdout), dtype="float32")
    assert rate == SAMPLE_RATE
    return pcm if pcm.ndim == 1 else pcm.mean(axis=1)


def _speaker(text: str, voice: str, tempo: float, cents: int) -> np.ndarray:
    """One line by one speaker: espeak-ng, then sox changes its tempo and pitch (24 kHz)."""
    spoken = subprocess.run(
        [_need("espeak-ng"), "-v", voice, "--stdout"], input=text.encode(), capture_output=True, check=True
    ).stdout
    return _sox(
        [
            "-t",
            "wav",
            "-",
            "-r",
            str(SAMPLE_RATE),
            "-t",
            "wav",
            "-",
            "tempo",
            f"{tempo:.3f}",
            "pitch",
            str(cents),
        ],
        spoken,
    )


def _active_rms(pcm: np.ndarray) -> float:
    loud = pcm[np.abs(pcm) > TRUTH_LEVEL * 10]
    return float(np.sqrt(np.mean(loud.astype(np.float64) ** 2))) if loud.size else 0.1


def build(folder: Path, conversations: int = 8, seed: int = 0) -> Material:
    """Write the conversations' caller lines and scenario file into `folder`."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    replies = [
        Reply(text, synthesize(text, CallerVoice(voice=voice, rate=rng.choice((150, 165, 175)))))
        for text, voice in zip(REPLIES, AGENT_VOICES, strict=True)
    ]
    noises = {
        kind: _sox(
            ["-n", "-r", str(SAMPLE_RATE), "-c", "1", "-b", "16", "-t", "wav", "-", "synth", "7", kind]
        )
        for kind in NOISES
    }
    speech_rms = _active_rms(replies[0].pcm)
    lines = ["defaults:", '  persona: {text_prompt: "You answer the phone.", voice: NATF2}', "scenarios:"]
    material = Material(folder, folder / "conversations.yaml", replies)
    for i in range(conversations):
        voice = CALLER_VOICES[i % len(CALLER_VOICES)]
        tempo, cents = rng.uniform(0.88, 1.15), rng.randint(-250, 250)
        files = []
        for part, text in (("ask", QUESTIONS), ("more", FOLLOW_UPS), ("cut", CUT_INS)):
            path = folder / f"c{i}-{part}.wav"
            soundfile.write(
                path, _speaker(text[i % len(text)], voice, tempo, cents), SAMPLE_RATE, subtype="FLOAT"
            )
            files.append(path.name)
        first_reply = len(replies[0].pcm) / SAMPLE_RATE
        wait = RESPOND_MS / 1000 + first_reply + rng.uniform(0.6, 1.2)
        snr_db = rng.uniform(15.0, 25.0)
        kind = NOISES[i % len(NOISES)]
        cue_ms = rng.randrange(300, 900, 20)
        noise = noises[kind]
        material.noise[f"conv{i}"] = (noise / _active_rms(noise) * speech_rms * 10 ** (-snr_db / 20)).astype(
            np.float32
        )
        lines += [
            f"  - name: conv{i}",
            f"    description: {voice}, tempo {tempo:.2f}, {cents:+d} cents, {kind} {snr_db:.0f} dB SNR",
            "    script:",
            f"      - wav: {files[0]}",
            f"      - silence: {wait:.2f}s",
            f"      - wav: {files[1]}",
            f"      - barge_in: {{after_agent_speech_ms: {cue_ms}, wav: {files[2]}, max_wait: 5s}}",
            f"      - silence: {RESPOND_MS / 1000 + 2.2:.2f}s",
        ]
    material.scenario_file.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return material


# ---- truth and errors ---------------------------------------------------------------------------


def _span(segs: list[Segment], lo: float, hi: float) -> tuple[float, float] | None:
    inside = [s for s in segs if s.end > lo and s.start < hi]
    return (max(inside[0].start, lo), min(inside[-1].end, hi)) if inside else None


def errors_of(result: CallResult, tap: TappedCodec) -> dict[str, list[float]]:
    """Measured minus true, in ms, for each turn of one call."""
    caller, agent = tap.truth(result.trace.plan.line.rate)
    duration = result.trace.duration_s
    turns = result.trace.log.turns
    truth = [_span(caller, t.start, t.end) for t in turns]
    out: dict[str, list[float]] = {"response_ms": [], "stop_ms": [], "turn_end_ms": [], "first_word_ms": []}
    for i, (turn, measured) in enumerate(zip(turns, result.measures.turns, strict=True)):
        if truth[i] is None:
            continue
        start, end = truth[i]
        out["turn_end_ms"].append(1000 * (measured.end - end))
        next_start = truth[i + 1][0] if i + 1 < len(truth) and truth[i + 1] is not None else duration
        if turn.then == "answer":
            answers = [a for a in agent if a.end > end and a.start < next_start]
            if answers and measured.response_ms is not None:
                out["response_ms"].append(measured.response_ms - 1000 * (answers[0].start - end))
                if result.heard is not None:
                    words = [w for w in result.heard if answers[0].start - 0.3 <= w.start < answers[0].end]
                    if words:
                        out["first_word_ms"].append(1000 * (words[0].start - answers[0].start))
        if turn.kind == "barge_in" and measured.stop_ms is not None:
            under_way = [a for a in agent if a.start <= start < a.end]
            true_stop = 1000 * (under_way[0].end - start) if under_way else 0.0
            out["stop_ms"].append(measured.stop_ms - true_stop)
    return out


def summarize(errors: list[float]) -> dict[str, Any]:
    if not errors:
        return {"n": 0}
    arr = np.asarray(errors, np.float64)
    absolute = np.abs(arr)
    return {
        "n": int(arr.size),
        "bias": round(float(arr.mean()), 1),
        "p50": round(float(np.percentile(absolute, 50)), 1),
        "p90": round(float(np.percentile(absolute, 90)), 1),
        "max": round(float(absolute.max()), 1),
    }


async def validate_line(
    material: Material, line_name: str, out: Path, *, words: str = "text"
) -> dict[str, Any]:
    """Run the conversations over one line; each measure's errors (raw lists under `errors`)."""
    scenarios = load_scenarios([material.scenario_file])
    base = get_line(line_name)
    taps: dict[str, Tap] = {}
    plans = []
    for plan in plan_calls(scenarios):
        tap = Tap(base, material.noise[plan.scenario.name])
        taps[plan.id] = tap
        plans.append(replace(plan, line=Line(base.name, base.rate, base.summary, tap.open)))
    clips = ClipBook()
    clips.add_scenarios(scenarios)
    engine = ScriptedEngine(
        len(plans), replies=material.replies, respond_after_ms=RESPOND_MS, stop_after_ms=STOP_MS
    )
    summary, _ = await run_suite(scenarios, plans, clips, out, engine=engine, words=words)
    pooled: dict[str, list[float]] = {}
    for sr in summary.scenarios:
        for call in sr.calls:
            codec = taps[call.id].codec
            assert codec is not None
            for name, values in errors_of(call, codec).items():
                pooled.setdefault(name, []).extend(values)
    return {
        "line": line_name,
        "calls": len(plans),
        "errors_ms": {name: summarize(values) for name, values in pooled.items()},
        "errors": pooled,
    }


async def _main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--lines", default="wideband,twilio")
    parser.add_argument("--words", choices=("text", "heard"), default="heard")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="eval-validation-") as tmp:
        material = build(Path(tmp) / "material", args.conversations, args.seed)
        report = {}
        for name in args.lines.split(","):
            found = await validate_line(material, name, Path(tmp) / name, words=args.words)
            report[name] = found["errors_ms"]
            print(f"{name}: {json.dumps(found['errors_ms'])}", flush=True)
    print(
        json.dumps(
            {"conversations": args.conversations, "seed": args.seed, "words": args.words, "lines": report}
        )
    )


if __name__ == "__main__":
    asyncio.run(_main())
