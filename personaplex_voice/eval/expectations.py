"""Expectations checked against one call, and their pass rates over a scenario's repeats.

Each `Expectation` of a scenario gives one `Outcome` per call: passed or not, with a message
that says what happened and, for the per-turn ones, which turn (`turn 2 (say 'When is my next
pickup?'): answered after 1840 ms, limit 800 ms`). `agent_says` and `agent_never_says` are decided
on the words heard in the agent's audio (the recogniser) when the run hears them, and also
checked on the model's own text: that second verdict is kept beside the first, and a call where
the two disagree says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .measures import CallMeasures, Piece, Word
from .scenario import NO_ACTION, Expectation


@dataclass(frozen=True)
class Outcome:
    label: str
    passed: bool
    message: str
    by_text: bool | None = None  # the same check on the model's own text (words checks, when heard)
    text_message: str = ""

    @property
    def disagrees(self) -> bool:
        """The audio and the model's text give different verdicts."""
        return self.by_text is not None and self.by_text != self.passed


@dataclass(frozen=True)
class FiredAction:
    """An action rule that fired during the call (as the bridge's call record has it)."""

    t: float  # seconds into the call, when it took effect (after its after_s)
    rule: int
    kind: str
    trigger: str
    what: str
    ends_call: bool


@dataclass(frozen=True)
class Transcript:
    """Text to match patterns on, and when each part of it was said."""

    text: str
    marks: tuple[tuple[int, float], ...]  # (offset just past a piece or word, its time)
    source: str  # "heard" (the recogniser on the audio) or "text" (the model's text stream)

    @classmethod
    def of_pieces(cls, pieces: Sequence[Piece]) -> Transcript:
        marks, seen = [], 0
        for p in pieces:
            seen += len(p.text)
            marks.append((seen, p.t))
        return cls("".join(p.text for p in pieces), tuple(marks), "text")

    @classmethod
    def of_words(cls, words: Sequence[Word]) -> Transcript:
        marks, seen = [], 0
        for w in words:
            seen += len(w.text) + 1
            marks.append((seen, w.start))
        return cls(" ".join(w.text for w in words), tuple(marks), "heard")

    def time_at(self, offset: int) -> float:
        for end, t in self.marks:
            if offset < end:
                return t
        return self.marks[-1][1] if self.marks else 0.0


@dataclass
class CallEvidence:
    """What the expectations look at: the measures, what the agent said (heard, when the run
    hears it, and its own text), the actions, and the barge-ins whose cue never came (turn
    label, after_agent_speech_ms)."""

    measures: CallMeasures
    text: Transcript  # the model's own text stream
    actions: Sequence[FiredAction]
    heard: Transcript | None = None  # the recogniser's words, None with --words text
    missed_barge_ins: Sequence[tuple[str, int]] = field(default_factory=list)

    @property
    def words(self) -> Transcript:
        """The transcript that decides: heard when there is one."""
        return self.heard if self.heard is not None else self.text


def check(exp: Expectation, ev: CallEvidence) -> Outcome:
    if exp.key in _WORD_CHECKS:
        checker = _WORD_CHECKS[exp.key]
        passed, message = checker(exp, ev.words)
        if ev.heard is None:
            return Outcome(exp.label, passed, message)
        by_text, text_message = checker(exp, ev.text)
        if by_text != passed:
            message += f"; its own text disagrees: {text_message}"
        return Outcome(exp.label, passed, message, by_text, text_message)
    passed, message = _CHECKS[exp.key](exp, ev)
    return Outcome(exp.label, passed, message)


def _shorten(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _agent_says(exp: Expectation, said: Transcript) -> tuple[bool, str]:
    match = exp.value.search(said.text)
    heard = said.source == "heard"
    if match:
        verb = "heard" if heard else "said"
        return True, f"{verb} {match.group(0).strip()!r} at {said.time_at(match.start()):.2f} s"
    what = _shorten(said.text) or "nothing"
    if heard:
        return False, f"the agent was never heard saying /{exp.value.pattern}/ (heard: {what!r})"
    return False, f"the agent never said /{exp.value.pattern}/ (it said: {what!r})"


def _agent_never_says(exp: Expectation, said: Transcript) -> tuple[bool, str]:
    match = exp.value.search(said.text)
    heard = said.source == "heard"
    if match is None:
        return True, f"never {'heard' if heard else 'said'} /{exp.value.pattern}/"
    verb = "the agent was heard saying" if heard else "the agent said"
    return False, f"{verb} {match.group(0).strip()!r} at {said.time_at(match.start()):.2f} s"


def _responds_within(exp: Expectation, ev: CallEvidence) -> tuple[bool, str]:
    limit = exp.value
    problems, seen = [], []
    for turn in ev.measures.turns:
        if turn.then != "answer":
            continue
        if turn.response_ms is None:
            problems.append(f"{turn.label}: no answer before the caller spoke again or the call ended")
        elif turn.response_ms > limit:
            problems.append(f"{turn.label}: answered after {turn.response_ms:.0f} ms, limit {limit} ms")
        else:
            seen.append(f"turn {turn.number} {turn.response_ms:.0f} ms")
    if problems:
        return False, "; ".join(problems)
    return True, "answered: " + ", ".join(seen)


def _stops_within(exp: Expectation, ev: CallEvidence) -> tuple[bool, str]:
    limit = exp.value
    problems = [
        f"{label}: the agent never spoke for {after} ms, so the caller never barged in"
        for label, after in ev.missed_barge_ins
    ]
    seen = []
    for turn in ev.measures.turns:
        if turn.stop_ms is None:
            continue
        if turn.stop_ms > limit:
            problems.append(f"{turn.label}: the agent went on for {turn.stop_ms:.0f} ms, limit {limit} ms")
        else:
            seen.append(f"turn {turn.number} {turn.stop_ms:.0f} ms")
    if problems:
        return False, "; ".join(problems)
    return True, "stopped: " + ", ".join(seen)


def _max_talk_over(exp: Expectation, ev: CallEvidence) -> tuple[bool, str]:
    total = ev.measures.talk_over_ms
    parts = [f"turn {t.number} {t.talk_over_ms:.0f} ms" for t in ev.measures.turns if t.talk_over_ms > 0]
    where = f" ({', '.join(parts)})" if parts else ""
    if total > exp.value:
        return False, f"the agent talked over the caller for {total:.0f} ms{where}, limit {exp.value} ms"
    return True, f"talk-over {total:.0f} ms{where}"


def _max_pause_takeovers(exp: Expectation, ev: CallEvidence) -> tuple[bool, str]:
    pauses = ev.measures.pauses
    taken = [p for p in pauses if p.taken_over]
    if len(taken) > exp.value:
        where = ", ".join(
            f"the pause after turn {p.after_turn} (agent at {p.agent_start:.2f} s)" for p in taken
        )
        return False, f"took the floor in {len(taken)} of {len(pauses)} pauses, limit {exp.value}: {where}"
    return True, f"took the floor in {len(taken)} of {len(pauses)} pauses"


def _action(exp: Expectation, ev: CallEvidence) -> tuple[bool, str]:
    fired = ", ".join(f"{a.what} ({a.trigger}) at {a.t:.2f} s" for a in ev.actions) or "none"
    if exp.value == (NO_ACTION,):
        return (not ev.actions), f"actions fired: {fired}"
    kinds = {a.kind for a in ev.actions}
    missing = [k for k in exp.value if k not in kinds]
    if missing:
        return False, f"expected {' and '.join(missing)}; actions fired: {fired}"
    return True, f"actions fired: {fired}"


_WORD_CHECKS = {"agent_says": _agent_says, "agent_never_says": _agent_never_says}
_CHECKS = {
    "responds_within_ms": _responds_within,
    "stops_within_ms": _stops_within,
    "max_talk_over_ms": _max_talk_over,
    "max_pause_takeovers": _max_pause_takeovers,
    "action": _action,
}


@dataclass
class ExpectationSummary:
    """One expectation over a scenario's repeats: passed when it held in at least the
    scenario's `pass_rate` of them."""

    label: str
    where: str
    runs: int
    passes: int
    required_rate: float
    failures: list[tuple[int, str]]  # (repeat, message)
    messages: list[str]

    @property
    def pass_rate(self) -> float:
        return self.passes / self.runs if self.runs else 0.0

    @property
    def passed(self) -> bool:
        return self.runs > 0 and self.pass_rate + 1e-9 >= self.required_rate


def summarize(
    exp: Expectation, outcomes: Sequence[tuple[int, Outcome]], required_rate: float
) -> ExpectationSummary:
    return ExpectationSummary(
        label=exp.label,
        where=exp.where,
        runs=len(outcomes),
        passes=sum(o.passed for _, o in outcomes),
        required_rate=required_rate,
        failures=[(r, o.message) for r, o in outcomes if not o.passed],
        messages=[o.message for _, o in outcomes],
    )
