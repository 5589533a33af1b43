"""Helpers for the eval tests: scenario files from text, the scripted agent, one in-process run."""

from __future__ import annotations

import textwrap
from functools import cache
from pathlib import Path

from personaplex_voice.engine.scripted import Reply, ScriptedEngine
from personaplex_voice.eval.scenario import Scenario, load_scenarios
from personaplex_voice.eval.speech import ClipBook, synthesize
from personaplex_voice.eval.steps import CallerVoice
from personaplex_voice.eval.suite import plan_calls, run_suite

ROOT = Path(__file__).resolve().parents[1]

AGENT_VOICE = CallerVoice(voice="en-us+f3", rate=175)
GREETING = "Thank you for calling. How can I help you today?"
ANSWER = "I see. I will transfer you to a colleague now."


@cache
def reply(text: str) -> Reply:
    return Reply(text, synthesize(text, AGENT_VOICE))


def scripted_engine(
    slots: int = 2, *, respond_ms: float = 400, stop_ms: float = 240, greet: bool = False, replies=(ANSWER,)
) -> ScriptedEngine:
    return ScriptedEngine(
        slots,
        replies=[reply(t) for t in replies],
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
