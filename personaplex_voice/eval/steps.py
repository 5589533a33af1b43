"""The steps of a caller's script (what `script:` holds once loaded) and two facts about them
every layer needs: which speech a step plays, and whether a turn then waits for an answer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CallerVoice:
    """How espeak-ng speaks the caller's `say` lines."""

    voice: str = "en-us"
    rate: int = 165  # words per minute
    pitch: int = 50  # 0-99


@dataclass(frozen=True)
class Say:
    text: str
    voice: CallerVoice
    where: str


@dataclass(frozen=True)
class Wav:
    path: Path
    where: str


@dataclass(frozen=True)
class Silence:
    seconds: float
    where: str


@dataclass(frozen=True)
class Pause:
    """Silence inside the caller's turn: the agent should not take the floor."""

    seconds: float
    where: str


@dataclass(frozen=True)
class BargeIn:
    """Wait until the agent has spoken for `after_agent_speech_ms`, then talk over it."""

    after_agent_speech_ms: int
    speech: Say | Wav
    max_wait_s: float
    where: str


@dataclass(frozen=True)
class Dtmf:
    keys: str
    where: str


Step = Say | Wav | Silence | Pause | BargeIn | Dtmf


def speech_of(step: Step) -> Say | Wav | None:
    """The caller speech a step plays (a barge-in's included), None for the others."""
    if isinstance(step, Say | Wav):
        return step
    if isinstance(step, BargeIn):
        return step.speech
    return None


def waits_for_answer(script: Sequence[Step], index: int) -> bool:
    """Whether the caller speech of step `index` ends a turn: the caller then waits (silence,
    keys, a barge-in's wait, or the end of the script) rather than pausing or going on."""
    if speech_of(script[index]) is None:
        return False
    following = script[index + 1] if index + 1 < len(script) else None
    return following is None or isinstance(following, Silence | Dtmf | BargeIn)
