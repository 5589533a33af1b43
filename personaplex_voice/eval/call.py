"""One scripted call, whatever carries it: the caller's script, the line's codec, the persona's
action rules, and the record of both sides.

The transport (the in-process runner or the `--url` client) asks `next_engine_frame()` for the
engine's next 80 ms of input and hands each 80 ms of agent output to `on_agent_frame()`, in
order. Frame k of either side covers [80k, 80k + 80) ms of the call's timeline: the agent's
frame k is what the engine said while hearing the caller's frame k (the published offline
convention, and Full-Duplex-Bench's time-synchronous `output.wav`).

Action rules fire as on a phone call: a DTMF key or the agent's text fires a rule, which takes
effect `after_s` later; an action that takes the caller away (transfer, hangup, redirect, play
then end) ends the call there, `play ... then: resume` is logged and the call goes on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from personaplex_voice.engine.base import FRAME_SIZE, SAMPLE_RATE, Persona

from . import phone
from .expectations import FiredAction
from .lines import Line
from .measures import Piece
from .scenario import Scenario
from .script import CallerScript, ScriptLog
from .speech import ClipBook
from .vad import SpeechClock

FRAME_S = FRAME_SIZE / SAMPLE_RATE


@dataclass(frozen=True)
class CallPlan:
    scenario: Scenario
    repeat: int  # 0-based
    seed: int
    persona: Persona  # rendered, seeded
    line: Line

    @property
    def id(self) -> str:
        return f"{self.scenario.name}-r{self.repeat + 1}"


@dataclass
class CallTrace:
    """A finished call: both sides as they crossed the line, and what happened."""

    plan: CallPlan
    caller: np.ndarray  # at plan.line.rate
    agent: np.ndarray
    pieces: list[Piece]
    log: ScriptLog
    actions: list[FiredAction]
    tokens: np.ndarray | None  # [frames, 1 + n_audio] when the engine reports tokens
    ended_by: str | None = None
    error: str | None = None
    session: dict = field(default_factory=dict)  # the session's stats at the end
    duration_s: float = 0.0
    # The agent as the engine made it (24 kHz, before the line): what the recogniser hears, since
    # its model is wideband and mishears a phone line's 4 kHz band (docs/eval.md, *Words*).
    agent_source: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.duration_s = len(self.caller) / self.plan.line.rate

    def release_audio(self) -> None:
        """Drop both sides' audio once everything that needs it has been written (long runs
        keep only results in memory)."""
        self.caller = self.caller[:0]
        self.agent = self.agent[:0]
        self.agent_source = None


@dataclass
class _Pending:
    at: float
    rule: phone.ActionRule
    trigger: str


class CallDriver:
    def __init__(self, plan: CallPlan, clips: ClipBook):
        self.plan = plan
        self.script = CallerScript(plan.scenario.script, clips)
        self.codec = plan.line.open()
        self.matcher = phone.ActionMatcher(plan.scenario.spec.actions)
        self.frames_out = 0  # caller frames made
        self.frames_in = 0  # agent frames taken
        self.end_at: float | None = None  # seconds: an action ended the call here
        self.ended_by: str | None = None
        self._caller: list[np.ndarray] = []
        self._agent: list[np.ndarray] = []
        self._source: list[np.ndarray] = []
        self._pieces: list[Piece] = []
        self._tokens: list[np.ndarray] = []
        self._pending: list[_Pending] = []
        self._fired: list[FiredAction] = []
        self._clock: SpeechClock | None = None

    # ---- the caller's side ---------------------------------------------------------------------

    @property
    def input_done(self) -> bool:
        """No more caller frames: the script is over or an action ended the call."""
        if self.end_at is not None and self.frames_out * FRAME_S >= self.end_at - 1e-9:
            return True
        return self.script.finished

    def next_engine_frame(self) -> np.ndarray | None:
        """The engine's next input frame (24 kHz, FRAME_SIZE samples), None when input is done."""
        if self.input_done:
            return None
        cue_ms = self._clock.speaking_ms if self._clock is not None else 0.0
        frame = self.script.next_frame(cue_ms)
        for t, key in self.script.take_keys():
            for rule in self.matcher.on_dtmf(key):
                self._pending.append(_Pending(t + rule.after_s, rule, f"dtmf {key}"))
        on_line, to_engine = self.codec.uplink(frame)
        self._caller.append(on_line)
        self.frames_out += 1
        self._apply_actions(self.frames_out * FRAME_S)
        return to_engine

    # ---- the agent's side ----------------------------------------------------------------------

    @property
    def output_done(self) -> bool:
        return self.input_done and self.frames_in >= self.frames_out

    def on_agent_frame(self, pcm: np.ndarray, text: str | None, tokens: np.ndarray | None = None) -> None:
        t = self.frames_in * FRAME_S
        heard = self.codec.downlink(pcm)
        self._agent.append(heard)
        self._source.append(np.asarray(pcm, np.float32).copy())
        self.frames_in += 1
        if tokens is not None:
            self._tokens.append(np.asarray(tokens))
        if self.script.waiting_for_cue:
            if self._clock is None:  # counts the agent's speech from the barge-in step's start
                self._clock = SpeechClock(self.plan.line.rate)
            self._clock.feed(heard)
        else:
            self._clock = None
        if text and (self.end_at is None or t < self.end_at):
            self._pieces.append(Piece(round(t, 3), text))
            for rule, phrase in self.matcher.on_agent_text(text):
                self._pending.append(_Pending(t + rule.after_s, rule, f"agent said {phrase!r}"))
        self._apply_actions(self.frames_out * FRAME_S)

    def _apply_actions(self, now: float) -> None:
        """Actions whose time has come take effect (the first that ends the call, ends it)."""
        due = sorted((p for p in self._pending if p.at <= now), key=lambda p: p.at)
        self._pending = [p for p in self._pending if p.at > now]
        for p in due:
            if self.end_at is not None and p.at >= self.end_at:
                continue  # the call was over by then
            ends = phone.ends_call(p.rule)
            self._fired.append(
                FiredAction(round(p.at, 3), p.rule.index, p.rule.kind, p.trigger, p.rule.describe(), ends)
            )
            if ends:
                self.end_at = p.at
                self.ended_by = f"action {p.rule.describe()} ({p.trigger})"

    # ---- the end -------------------------------------------------------------------------------

    def trace(self, error: str | None = None, session: dict | None = None) -> CallTrace:
        rate = self.plan.line.rate
        caller = np.concatenate(self._caller) if self._caller else np.zeros(0, np.float32)
        agent = np.concatenate(self._agent) if self._agent else np.zeros(0, np.float32)
        n = min(len(caller), len(agent)) if error is None else len(caller)
        if self.end_at is not None:
            n = min(n, round(self.end_at * rate))
            self.script.cut(self.end_at)
        caller = caller[:n]
        agent = np.pad(agent[:n], (0, n - min(n, len(agent))))
        limit = n / rate
        k = round(limit * SAMPLE_RATE)
        source = np.concatenate(self._source)[:k] if self._source else np.zeros(0, np.float32)
        source = np.pad(source, (0, k - len(source)))
        tokens = np.stack(self._tokens[: round(limit / FRAME_S + 0.4999)]) if self._tokens else None
        return CallTrace(
            plan=self.plan,
            caller=caller,
            agent=agent,
            pieces=[p for p in self._pieces if p.t < limit],
            log=self.script.log,
            actions=[a for a in self._fired if a.t <= limit],
            tokens=tokens,
            ended_by=self.ended_by,
            error=error,
            session=session or {},
            agent_source=source,
        )
