"""What a run found: per call (measures, expectation outcomes) and per scenario (pass rates and
aggregates over its repeats), and the run as a whole.

`analyze` turns finished calls (`CallTrace`) into `CallResult`s: both channels at 16 kHz through
the VAD in one batch, the recogniser on the agent's speech (the words heard), then the measures,
Full-Duplex-Bench's measures for its samples, and every expectation. `ScenarioResult` aggregates a
scenario's repeats: each expectation's pass rate, and for each measure its mean, 90th percentile,
minimum and maximum over the repeats (per-turn measures pooled over turns and repeats).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from personaplex_voice.audio.resample import resample
from personaplex_voice.engine.base import SAMPLE_RATE

from . import fdb_measures, vad
from .call import CallTrace
from .expectations import CallEvidence, ExpectationSummary, Outcome, Transcript, check, summarize
from .fdb_measures import FdbScore
from .measures import HEARD_SLACK, TEXT_SLACK, CallMeasures, Word, measure, words_of_pieces
from .recognizer import Recognizer
from .scenario import Scenario


@dataclass
class CallResult:
    trace: CallTrace
    caller_segments: list[vad.Segment]
    agent_segments: list[vad.Segment]
    measures: CallMeasures
    outcomes: list[Outcome]
    heard: list[Word] | None = None  # the recogniser's words (None with --words text)
    fdb: FdbScore | None = None  # FDB's measures, for a scenario that is an FDB sample
    fdb_annotation: list[dict[str, Any]] | None = None  # the sample's annotation file, as exported
    files: dict[str, str] = field(default_factory=dict)  # what outputs wrote, relative to --out
    media: Any = None  # the report's drawing of the call (report.CallMedia), made before the audio goes

    @property
    def id(self) -> str:
        return self.trace.plan.id

    @property
    def passed(self) -> bool:
        return self.trace.error is None and all(o.passed for o in self.outcomes)

    @property
    def transcript(self) -> str:
        """The model's own text stream."""
        return "".join(p.text for p in self.trace.pieces)

    @property
    def heard_text(self) -> str | None:
        return None if self.heard is None else " ".join(w.text for w in self.heard)

    @property
    def disagreements(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.disagrees]


def analyze(traces: Sequence[CallTrace], recognizer: Recognizer | None = None) -> list[CallResult]:
    """VAD both sides of every call in one batch, hear the agent (when a recogniser is given),
    then measure and check each call."""
    signals: list[np.ndarray] = []
    for trace in traces:
        rate = trace.plan.line.rate
        signals.append(resample(trace.caller, rate, vad.VAD_RATE))
        signals.append(resample(trace.agent, rate, vad.VAD_RATE))
    probs = vad.probabilities(signals)
    found = [vad.refine(vad.segments_from(p), s) for p, s in zip(probs, signals, strict=True)]
    results = []
    for i, trace in enumerate(traces):
        caller_segments, agent_segments = found[2 * i], found[2 * i + 1]
        agent = _recognizer_input(trace, signals[2 * i + 1])
        heard = None
        if recognizer is not None and trace.error is None:
            heard = recognizer.words(agent, agent_segments)
        words, slack = (
            (heard, HEARD_SLACK) if heard is not None else (words_of_pieces(trace.pieces), TEXT_SLACK)
        )
        measures = measure(
            trace.log.turns, trace.log.pauses, caller_segments, agent_segments, words, trace.duration_s, slack
        )
        evidence = CallEvidence(
            measures=measures,
            text=Transcript.of_pieces(trace.pieces),
            heard=Transcript.of_words(heard) if heard is not None else None,
            actions=trace.actions,
            missed_barge_ins=trace.log.missed_barge_ins,
        )
        if trace.error is not None:
            outcomes = [
                Outcome(e.label, False, f"the call failed: {trace.error}")
                for e in trace.plan.scenario.expectations
            ]
        else:
            outcomes = [check(e, evidence) for e in trace.plan.scenario.expectations]
        result = CallResult(trace, caller_segments, agent_segments, measures, outcomes, heard)
        spec = trace.plan.scenario.fdb
        if spec is not None and trace.error is None:
            result.fdb_annotation = fdb_measures.annotation(spec, measures, trace.duration_s)
            if result.fdb_annotation is not None or spec.task == "backchannel":
                result.fdb = _fdb_score(result, agent, probs[2 * i + 1], words, recognizer)
        results.append(result)
    return results


def _recognizer_input(trace: CallTrace, on_line: np.ndarray) -> np.ndarray:
    """The agent at 16 kHz as the engine made it (before the line's codec), else as it crossed."""
    if trace.agent_source is None or len(trace.agent_source) == 0:
        return on_line
    return resample(trace.agent_source, SAMPLE_RATE, vad.VAD_RATE)


def meant_words(trace: CallTrace) -> list[Word]:
    return words_of_pieces(trace.pieces)


def _fdb_score(
    result: CallResult, agent: np.ndarray, probs: np.ndarray, words: list[Word], recognizer: Recognizer | None
) -> FdbScore:
    spec = result.trace.plan.scenario.fdb
    assert spec is not None
    duration = result.trace.duration_s
    if spec.task == "backchannel":
        return fdb_measures.backchannel_score(vad.fdb_segments(probs, len(agent)), words, duration)
    annotation = result.fdb_annotation or []
    if spec.task == "smooth_turn_taking":
        return fdb_measures.turn_score(spec.task, words, float(annotation[0]["timestamp"][0]))
    if spec.task == "user_interruption":
        end = float(annotation[0]["timestamp"][1])
        if recognizer is not None:  # asr.py --task user_interruption: the audio from the end on
            cut = round(end * vad.VAD_RATE)
            after = [
                vad.Segment(max(0.0, s.start - end), s.end - end)
                for s in result.agent_segments
                if s.end > end
            ]
            shifted = recognizer.words(agent[cut:], after)
            words = [Word(w.text, round(w.start + end, 3), round(w.end + end, 3)) for w in shifted]
        else:
            words = [w for w in words if w.start >= end]
        return fdb_measures.turn_score(spec.task, words, end)
    return fdb_measures.turn_score(spec.task, words, None)


# ---- aggregation ------------------------------------------------------------------------------

# name -> (unit, what it is); per-turn measures are pooled over turns.
MEASURES: dict[str, tuple[str, str]] = {
    "response_ms": ("ms", "response latency, per turn that waits for an answer"),
    "stop_ms": ("ms", "interruption stop latency, per barge-in"),
    "talk_over_ms": ("ms", "agent talk-over, per call"),
    "overlap_ms": ("ms", "both speaking, per call"),
    "backchannels": ("", "backchannels, per call"),
    "pause_takeovers": ("", "pauses the agent took over, per call"),
    "agent_talk_s": ("s", "agent speaking time, per call"),
    "agent_words": ("", "agent words, per call"),
    "caller_talk_s": ("s", "caller speaking time, per call"),
    # Full-Duplex-Bench's own measures (its rules, our recogniser), for scenarios that are its samples
    "fdb_tor": ("rate", "FDB take-turn rate (TOR), per sample"),
    "fdb_latency_s": ("s", "FDB latency (first word heard after the event; < 0 counted as 0), per sample"),
    "fdb_backchannel_freq": ("/s", "FDB backchannel frequency, per sample"),
}
FDB_MEASURES = ("fdb_tor", "fdb_latency_s", "fdb_backchannel_freq")


def measure_values(call: CallResult) -> dict[str, list[float]]:
    m, fdb = call.measures, call.fdb
    return {
        "response_ms": m.response_ms,
        "stop_ms": m.stop_ms,
        "talk_over_ms": [m.talk_over_ms],
        "overlap_ms": [m.overlap_ms],
        "backchannels": [float(m.backchannels)],
        "pause_takeovers": [float(m.pause_takeovers)],
        "agent_talk_s": [m.agent_talk_s],
        "agent_words": [float(m.agent_words)],
        "caller_talk_s": [m.caller_talk_s],
        "fdb_tor": [float(fdb.tor)] if fdb is not None else [],
        "fdb_latency_s": [max(0.0, fdb.latency_s)] if fdb is not None and fdb.latency_s is not None else [],
        "fdb_backchannel_freq": [fdb.frequency] if fdb is not None and fdb.frequency is not None else [],
    }


def stats(values: Sequence[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0, "mean": None, "p90": None, "min": None, "max": None}
    arr = np.asarray(values, np.float64)
    return {
        "n": int(arr.size),
        "mean": round(float(arr.mean()), 3),
        "p90": round(float(np.percentile(arr, 90)), 3),
        "min": round(float(arr.min()), 3),
        "max": round(float(arr.max()), 3),
    }


@dataclass
class ScenarioResult:
    scenario: Scenario
    calls: list[CallResult]  # in repeat order
    expectations: list[ExpectationSummary]
    aggregates: dict[str, dict[str, Any]]

    @property
    def pass_rate(self) -> float:
        """Fraction of the repeats in which every expectation held."""
        return sum(c.passed for c in self.calls) / len(self.calls) if self.calls else 0.0

    @property
    def passed(self) -> bool:
        return all(e.passed for e in self.expectations) and all(c.trace.error is None for c in self.calls)


def aggregate(scenario: Scenario, calls: list[CallResult]) -> ScenarioResult:
    calls = sorted(calls, key=lambda c: c.trace.plan.repeat)
    summaries = [
        summarize(exp, [(c.trace.plan.repeat, c.outcomes[i]) for c in calls], scenario.pass_rate)
        for i, exp in enumerate(scenario.expectations)
    ]
    pooled: dict[str, list[float]] = {name: [] for name in MEASURES}
    for call in calls:
        for name, values in measure_values(call).items():
            pooled[name].extend(values)
    return ScenarioResult(scenario, calls, summaries, {name: stats(v) for name, v in pooled.items()})


@dataclass
class RunSummary:
    scenarios: list[ScenarioResult]
    run: dict[str, Any]  # how it ran: engine or url, calls, audio seconds, wall seconds, ticks...

    @property
    def checks(self) -> tuple[int, int]:
        """(expectation checks passed, checks made): every expectation of every call."""
        passed = total = 0
        for sr in self.scenarios:
            for e in sr.expectations:
                passed += e.passes
                total += e.runs
        return passed, total

    @property
    def pass_rate(self) -> float:
        passed, total = self.checks
        return passed / total if total else 1.0
