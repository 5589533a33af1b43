"""Helpers for the eval tests: scenario files from text, the scripted agent, one in-process run
(optionally with each call's line tapped for the clean audio: the truth the measures are held to)."""

from __future__ import annotations

import textwrap
from dataclasses import replace
from functools import cache
from pathlib import Path

import numpy as np

from personaplex_voice.engine.base import SAMPLE_RATE
from personaplex_voice.engine.scripted import Reply, ScriptedEngine
from personaplex_voice.eval.lines import Line
from personaplex_voice.eval.scenario import Scenario, load_scenarios
from personaplex_voice.eval.speech import ClipBook, synthesize
from personaplex_voice.eval.steps import CallerVoice
from personaplex_voice.eval.suite import plan_calls, run_suite
from personaplex_voice.eval.validation import Tap

ROOT = Path(__file__).resolve().parents[1]

# A voice and lines pocketsphinx hears well (espeak's other voices it often mishears).
AGENT_VOICE = CallerVoice(voice="en-us+f2", rate=150)
GREETING = "Thank you for calling. How can I help you today?"
ANSWER = "We are closed on Sunday. I will transfer you now."


@cache
def reply(text: str) -> Reply:
    return Reply(text, synthesize(text, AGENT_VOICE))


def scripted_engine(
    slots: int = 2, *, respond_ms: float = 400, stop_ms: float = 240, greet: bool = False, replies=(ANSWER,)
) -> ScriptedEngine:
    """The scripted agent (it hears with silero-vad), its replies in `AGENT_VOICE`; a reply is a
    text (said as written) or a (text, what its audio says) pair."""
    return ScriptedEngine(
        slots,
        replies=[reply(t) if isinstance(t, str) else Reply(t[0], reply(t[1]).pcm) for t in replies],
        respond_after_ms=respond_ms,
        stop_after_ms=stop_ms,
        greet=greet,
    )


def scenario_file(folder: Path, text: str, name: str = "scenarios.yaml") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    return path


def load(folder: Path, text: str) -> list[Scenario]:
    return load_scenarios([scenario_file(folder, text)])


async def run(
    scenarios: list[Scenario], out: Path, engine, *, repeat: int = 1, line: str | None = None, **kw
):
    """One in-process run: (summary, traces)."""
    plans = plan_calls(scenarios, repeat=repeat, line=line)
    clips = ClipBook()
    clips.add_scenarios(scenarios)
    return await run_suite(scenarios, plans, clips, out, engine=engine, **kw)


async def run_tapped(scenarios: list[Scenario], out: Path, engine, **kw):
    """A run whose calls' lines are tapped (no noise): (summary, {call id: TappedCodec}) so a test
    can hold the measures to the clean audio's own timing."""
    taps: dict[str, Tap] = {}
    plans = []
    for plan in plan_calls(scenarios):
        tap = taps[plan.id] = Tap(plan.line, np.zeros(SAMPLE_RATE, np.float32))
        plans.append(replace(plan, line=Line(plan.line.name, plan.line.rate, plan.line.summary, tap.open)))
    clips = ClipBook()
    clips.add_scenarios(scenarios)
    summary, _ = await run_suite(scenarios, plans, clips, out, engine=engine, **kw)
    return summary, {name: tap.codec for name, tap in taps.items()}
