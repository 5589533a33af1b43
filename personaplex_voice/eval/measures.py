"""Full-duplex measures of one call, from who spoke when (VAD segments) and the agent's words.

Pure functions of their inputs: the caller's turns as the script played them (`ScriptTurn`,
`ScriptPause`), the speech segments of both sides (`vad.Segment`, seconds on the call's
timeline) and the agent's words with their times (`Word`: heard by the recogniser, or the
model's own text pieces with `--words text`). Definitions (docs/eval.md, *Measures*):

- a caller turn's speech: the caller's segments, cut to the window from 100 ms before its clip
  started to 300 ms after it ended (or to the next turn's clip, if sooner); the first start to
  the last end (pieces under 60 ms, another turn's edge, are left out). When the VAD heard
  nothing there, the clip's own span, flagged `heard: false`.
- short agent speech: a segment under `SHORT_S` carrying at most `SHORT_WORDS` words; the
  words of a segment are those whose middle lies inside it, widened by the words' `Slack`
  (heard words carry the audio's own times; the model's text runs a little ahead of its audio).
- response latency (turns where the caller then waits): the start of the first agent segment
  that ends after the caller's speech ends and starts before the caller's next turn (or the end
  of the call), minus that speech end; short segments that began during the caller's speech do
  not count. Negative: the agent was already talking when the caller stopped. None: no answer.
- stop latency (barge-in turns): the end of the agent segment under way when the barge-in
  speech starts, minus that start (0 when the agent was already silent).
- backchannel: short agent speech starting during a caller turn's speech.
- talk-over: time the caller and the agent both speak within agent segments (not short) that
  *started* during the caller's speech; overlap the caller causes by barging in is not the
  agent's talk-over (that is the stop latency).
- overlap: all time both sides speak, whoever started.
- takeover at a pause: agent speech that is not short starting inside a `pause` step's silence
  (from the caller's speech end before it to the caller's next speech start).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .vad import Segment

SHORT_S = 1.0
SHORT_WORDS = 2
TURN_LEAD_S = 0.1
TURN_TAIL_S = 0.3
MIN_PIECE_S = 0.06


@dataclass(frozen=True)
class ScriptTurn:
    """Caller speech as the script played it."""

    number: int  # 1-based among the script's caller speech
    kind: str  # "say", "wav" or "barge_in"
    text: str  # the line said (a wav: its file name)
    start: float
    end: float
    then: str  # "answer" (the caller waits), "pause" (holds the floor) or "continue"


@dataclass(frozen=True)
class ScriptPause:
    after_turn: int  # the turn number before it
    start: float
    end: float


@dataclass(frozen=True)
class Piece:
    """An agent text piece at its time on the call's timeline."""

    t: float
    text: str


@dataclass(frozen=True)
class Word:
    """One agent word on the call's timeline: heard (a recogniser's word and times) or meant
    (a word of the model's text stream, at its piece's time)."""

    text: str
    start: float
    end: float

    @property
    def mid(self) -> float:
        return (self.start + self.end) / 2


@dataclass(frozen=True)
class Slack:
    """How far outside a speech segment a word's middle may lie and still belong to it."""

    before: float
    after: float


HEARD_SLACK = Slack(0.05, 0.05)  # the recogniser's word edges vs the VAD's: tens of ms
TEXT_SLACK = Slack(0.16, 0.08)  # a text piece comes up to two frames before its sound


def words_of_pieces(pieces: Sequence[Piece]) -> list[Word]:
    """The model's own words: each whitespace word of a text piece, at the piece's time."""
    return [Word(w, p.t, p.t) for p in pieces for w in p.text.split()]


@dataclass
class TurnMeasures:
    number: int
    kind: str
    text: str
    then: str
    start: float  # the caller's speech as heard (see `heard`)
    end: float
    heard: bool
    response_ms: float | None = None
    stop_ms: float | None = None
    overlap_ms: float = 0.0
    talk_over_ms: float = 0.0
    backchannels: int = 0

    @property
    def label(self) -> str:
        line = self.text if len(self.text) <= 40 else self.text[:39] + "…"
        return f"turn {self.number} ({self.kind.replace('_', '-')} {line!r})"


@dataclass
class PauseMeasures:
    after_turn: int
    start: float
    end: float
    taken_over: bool
    agent_start: float | None = None


@dataclass
class CallMeasures:
    duration_s: float
    caller_talk_s: float
    agent_talk_s: float
    agent_words: int
    overlap_ms: float
    talk_over_ms: float
    backchannels: int
    pause_takeovers: int
    turns: list[TurnMeasures] = field(default_factory=list)
    pauses: list[PauseMeasures] = field(default_factory=list)

    @property
    def response_ms(self) -> list[float]:
        return [t.response_ms for t in self.turns if t.response_ms is not None]

    @property
    def stop_ms(self) -> list[float]:
        return [t.stop_ms for t in self.turns if t.stop_ms is not None]


def _overlap(a: Segment, b: Segment) -> float:
    return max(0.0, min(a.end, b.end) - max(a.start, b.start))


def _overlap_all(a: Sequence[Segment], b: Sequence[Segment]) -> float:
    return sum(_overlap(x, y) for x in a for y in b)


def words_in(segment: Segment, words: Sequence[Word], slack: Slack) -> int:
    lo, hi = segment.start - slack.before, segment.end + slack.after
    return sum(1 for w in words if lo <= w.mid <= hi)


def is_short(segment: Segment, words: Sequence[Word], slack: Slack) -> bool:
    return segment.duration < SHORT_S and words_in(segment, words, slack) <= SHORT_WORDS


def measure(
    turns: Sequence[ScriptTurn],
    pauses: Sequence[ScriptPause],
    caller: Sequence[Segment],
    agent: Sequence[Segment],
    words: Sequence[Word],
    duration_s: float,
    slack: Slack = HEARD_SLACK,
) -> CallMeasures:
    measured: list[TurnMeasures] = []
    own: list[list[Segment]] = []  # each turn's caller segments
    for i, turn in enumerate(turns):
        lo = turn.start - TURN_LEAD_S
        hi = turn.end + TURN_TAIL_S
        if i + 1 < len(turns):
            hi = min(hi, turns[i + 1].start)
        cut = (Segment(max(s.start, lo), min(s.end, hi)) for s in caller if s.end > lo and s.start < hi)
        mine = [c for c in cut if c.duration >= MIN_PIECE_S]  # not another turn's edge
        own.append(mine)
        if mine:
            start, end, heard = mine[0].start, max(s.end for s in mine), True
        else:
            start, end, heard = turn.start, turn.end, False
        measured.append(TurnMeasures(turn.number, turn.kind, turn.text, turn.then, start, end, heard))

    for i, tm in enumerate(measured):
        span = Segment(tm.start, tm.end)
        next_start = measured[i + 1].start if i + 1 < len(measured) else duration_s
        started_inside = [a for a in agent if tm.start <= a.start < tm.end]
        for a in started_inside:
            if is_short(a, words, slack):
                tm.backchannels += 1
            else:
                tm.talk_over_ms += 1000.0 * _overlap_all([a], own[i])
        tm.overlap_ms = 1000.0 * _overlap_all(agent, own[i])
        if tm.then == "answer":
            answers = [
                a
                for a in agent
                if a.end > tm.end
                and a.start < next_start
                and not (a.start < tm.end and is_short(a, words, slack))
            ]
            if answers:
                tm.response_ms = 1000.0 * (answers[0].start - tm.end)
        if tm.kind == "barge_in":
            under_way = [a for a in agent if a.start <= span.start < a.end]
            tm.stop_ms = 1000.0 * (under_way[0].end - span.start) if under_way else 0.0

    by_number = {tm.number: tm for tm in measured}
    pause_measures: list[PauseMeasures] = []
    for pause in pauses:
        before = by_number.get(pause.after_turn)
        after = by_number.get(pause.after_turn + 1)
        start = before.end if before is not None and before.heard else pause.start
        end = after.start if after is not None and after.heard else pause.end
        start = min(start, end)
        takers = [a for a in agent if start <= a.start < end and not is_short(a, words, slack)]
        pause_measures.append(
            PauseMeasures(pause.after_turn, start, end, bool(takers), takers[0].start if takers else None)
        )

    return CallMeasures(
        duration_s=duration_s,
        caller_talk_s=sum(s.duration for s in caller),
        agent_talk_s=sum(s.duration for s in agent),
        agent_words=len(words),
        overlap_ms=1000.0 * _overlap_all(caller, agent),
        talk_over_ms=sum(t.talk_over_ms for t in measured),
        backchannels=sum(t.backchannels for t in measured),
        pause_takeovers=sum(p.taken_over for p in pause_measures),
        turns=measured,
        pauses=pause_measures,
    )
