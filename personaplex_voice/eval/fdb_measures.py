"""Full-Duplex-Bench's own measures of one sample, restated from its published scorers and
computed here from our audio and the words the recogniser heard, beside our measures.

Sources (github.com/DanielLin94144/Full-Duplex-Bench, `v1_v1.5/`): `evaluation/eval_pause_handling.py`,
`eval_smooth_turn_taking.py`, `eval_user_interruption.py`, `eval_backchannel.py` and
`get_transcript/asr.py`. Their rules, in our words:

- **Takes the turn** (TOR = 1): the sample's words (ASR word chunks with times) are not empty, and
  they span at least 1 s from the first word's start to the last word's end or number more than
  3. No words, or fewer than 4 words within under a second: TOR = 0.
- **Pause handling**: TOR over every word of the sample. Lower is better.
- **Smooth turn-taking**: TOR over every word; when it took the turn, the latency is the first
  word's start minus the annotated end of the user's turn (`turn_taking.json` `timestamp[0]`),
  counted as 0 when negative in the average.
- **User interruption**: the same, over the words of the output *after* the interruption's end
  (`asr.py --task user_interruption` crops the audio there and shifts the times back); latency
  from the interruption's end (`interrupt.json` `timestamp[1]`). FDB also has GPT-4 rate the
  answer's relevance (0-5): that needs OpenAI and is not computed here.
- **Backchannel**: silero-vad's `get_speech_timestamps` with its default settings over the
  output (seconds, 0.1 s resolution). Going through the segments in order, a segment over 3 s is
  a turn (TOR = 1) and ends the walk; any other is counted as a backchannel and sets TOR: 0 when
  it is under 1 s with at most 2 words overlapping it, else 1 (the last such segment decides).
  The frequency is the segments counted over the sample's duration. The JSD against human
  timing needs FDB's `icc_gt_distribution.json` and is left to its scorer.

The recogniser here is pocketsphinx, FDB's is NVIDIA parakeet-tdt-0.6b-v2: same rules, other
ears, so the values are FDB's measures of our audio, not FDB's published numbers (docs/eval.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .fdb_spec import FdbSpec
from .measures import CallMeasures, Word
from .vad import Segment

TURN_S = 1.0  # FDB: turn_duration_threshold
TURN_WORDS = 3  # FDB: turn_num_words_threshold
BACKCHANNEL_MAX_S = 3.0  # FDB's backchannel scorer: time_threshold


@dataclass
class FdbScore:
    """One sample's values under FDB's rules."""

    task: str
    tor: int  # 1: the agent took the turn
    latency_s: float | None = None  # smooth_turn_taking, user_interruption: as FDB computes it
    backchannels: int | None = None  # backchannel: segments FDB counts as backchannels
    frequency: float | None = None  # backchannel: per second of the sample
    words: list[Word] = field(default_factory=list)  # the words it judged

    def as_json(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "tor": self.tor,
            "latency_s": None if self.latency_s is None else round(self.latency_s, 3),
            "backchannels": self.backchannels,
            "frequency": None if self.frequency is None else round(self.frequency, 4),
            "words": [[w.text, w.start, w.end] for w in self.words],
        }


def takes_turn(words: Sequence[Word]) -> bool:
    if not words:
        return False
    span = words[-1].end - words[0].start
    return span >= TURN_S or len(words) > TURN_WORDS


def turn_score(task: str, words: Sequence[Word], event_end: float | None) -> FdbScore:
    """Pause handling (no event end), smooth turn-taking and user interruption."""
    tor = takes_turn(words)
    latency = words[0].start - event_end if tor and event_end is not None else None
    return FdbScore(task, int(tor), latency, words=list(words))


def backchannel_score(segments: Sequence[Segment], words: Sequence[Word], duration_s: float) -> FdbScore:
    tor = 0
    counted = 0
    for seg in segments:
        if seg.duration > BACKCHANNEL_MAX_S:
            tor = 1
            break
        n = sum(1 for w in words if _overlaps(w, seg))
        tor = _short_tor(seg.duration, n)
        counted += 1
    freq = counted / duration_s if duration_s > 0 else 0.0
    return FdbScore("backchannel", tor, None, counted, freq, list(words))


def _short_tor(duration: float, n_words: int) -> int:
    """A segment of at most 3 s is a turn unless it is under 1 s with at most 2 words (FDB tests
    more than 3 words first, then the duration, then at most 2 words: the same set)."""
    return 0 if duration < TURN_S and n_words <= 2 else 1


def _overlaps(word: Word, seg: Segment) -> bool:
    """FDB's test of a word against a segment: inside it, or across its end, or across its start."""
    inside = word.start >= seg.start and word.end <= seg.end
    across_end = word.start <= seg.end < word.end
    across_start = word.start <= seg.start < word.end
    return inside or across_end or across_start


def mean_latency(scores: Sequence[FdbScore]) -> float | None:
    """FDB's average latency: over the samples that took the turn, negative ones counted as 0."""
    values = [max(0.0, s.latency_s) for s in scores if s.tor and s.latency_s is not None]
    return sum(values) / len(values) if values else None


def annotation(spec: FdbSpec, measures: CallMeasures, duration_s: float) -> list[dict[str, Any]] | None:
    """The sample's annotation file as FDB's scorers read it: the FDB sample's own when the
    scenario plays one, else made from the call (the caller's speech as the VAD heard it).
    None when the event did not happen (the barge-in never came) or the task has no file."""
    if spec.annotation is not None:
        return [dict(entry) for entry in spec.annotation]
    turns = measures.turns
    if spec.task == "smooth_turn_taking":
        turn = turns[0]
        return [{"text": turn.text, "timestamp": [round(turn.end, 3), round(duration_s, 3)]}]
    if spec.task == "pause_handling":
        return [
            {"text": "[PAUSE]", "timestamp": [round(p.start, 3), round(p.end, 3)]} for p in measures.pauses
        ]
    if spec.task == "user_interruption":
        if len(turns) < 2:
            return None
        context, cut_in = turns[0], turns[1]
        return [
            {
                "context": context.text,
                "interrupt": cut_in.text,
                "timestamp": [round(cut_in.start, 3), round(cut_in.end, 3)],
            }
        ]
    return None
