"""What a run found: per call (measures, expectation outcomes) and per scenario (pass rates and
aggregates over its repeats), and the run as a whole.

`analyze` turns finished calls (`CallTrace`) into `CallResult`s: both channels at 16 kHz through
the VAD in one batch, then the measures and every expectation. `ScenarioResult` aggregates a
scenario's repeats: each expectation's pass rate, and for each measure its mean, 90th percentile,
minimum and maximum over the repeats (per-turn measures pooled over turns and repeats).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from personaplex_voice.audio.resample import resample

from . import vad
from .call import CallTrace
from .expectations import CallEvidence, ExpectationSummary, Outcome, check, summarize
from .measures import CallMeasures, measure
from .scenario import Scenario


@dataclass
class CallResult:
    trace: CallTrace
    caller_segments: list[vad.Segment]
    agent_segments: list[vad.Segment]
    measures: CallMeasures
    outcomes: list[Outcome]
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
        return "".join(p.text for p in self.trace.pieces)


def analyze(traces: Sequence[CallTrace]) -> list[CallResult]:
    """VAD both sides of every call in one batch, then measure and check each call."""
    signals: list[np.ndarray] = []
    for trace in traces:
        rate = trace.plan.line.rate
        signals.append(resample(trace.caller, rate, vad.VAD_RATE))
        signals.append(resample(trace.agent, rate, vad.VAD_RATE))
    found = vad.detect(signals)
    results = []
    for i, trace in enumerate(traces):
        caller_segments, agent_segments = found[2 * i], found[2 * i + 1]
        measures = measure(
            trace.log.turns, trace.log.pauses, caller_segments, agent_segments, trace.pieces, trace.duration_s
        )
        evidence = CallEvidence(
            measures=measures,
            transcript="".join(p.text for p in trace.pieces),
            pieces=[(p.t, p.text) for p in trace.pieces],
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
        results.append(CallResult(trace, caller_segments, agent_segments, measures, outcomes))
    return results


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
}


def measure_values(m: CallMeasures) -> dict[str, list[float]]:
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
        for name, values in measure_values(call.measures).items():
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
