"""Files a run leaves in `--out`: per call a stereo WAV and a transcript, and `results.json`.

```
OUT/
  report.html  results.json  junit.xml
  calls/<scenario>-r<N>/call.wav         stereo 16-bit PCM at the line's rate: caller left, agent right
  calls/<scenario>-r<N>/transcript.json  both sides with times, keys, actions
  calls/<scenario>-r<N>/transcript.txt   the same, to read
```
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import soundfile

from .expectations import Outcome
from .results import MEASURES, CallResult, RunSummary, ScenarioResult

RESULTS_VERSION = 1
LINE_GAP_S = 0.5  # agent pieces further apart than this start a new line in transcript.txt


def call_dir(out: Path, result: CallResult) -> Path:
    return out / "calls" / result.id


def stereo(result: CallResult) -> np.ndarray:
    trace = result.trace
    return np.stack([trace.caller, trace.agent], axis=1).astype(np.float32)


def write_call_files(out: Path, result: CallResult) -> None:
    folder = call_dir(out, result)
    folder.mkdir(parents=True, exist_ok=True)
    trace = result.trace
    soundfile.write(folder / "call.wav", stereo(result), trace.plan.line.rate, subtype="PCM_16", format="WAV")
    (folder / "transcript.json").write_text(
        json.dumps(transcript(result), indent=1, ensure_ascii=False), encoding="utf-8"
    )
    (folder / "transcript.txt").write_text(transcript_text(result), encoding="utf-8")
    result.files = {
        "wav": f"calls/{result.id}/call.wav",
        "transcript": f"calls/{result.id}/transcript.json",
        "transcript_txt": f"calls/{result.id}/transcript.txt",
    }


def transcript(result: CallResult) -> dict[str, Any]:
    trace, plan = result.trace, result.trace.plan
    return {
        "call": result.id,
        "scenario": plan.scenario.name,
        "repeat": plan.repeat + 1,
        "seed": plan.seed,
        "line": plan.line.name,
        "persona": plan.scenario.persona_name,
        "prompt": plan.persona.text_prompt,
        "voice": plan.persona.voice,
        "duration_s": round(trace.duration_s, 3),
        "caller": [
            {
                "turn": t.number,
                "kind": t.kind,
                "text": t.text,
                "start": round(t.start, 3),
                "end": round(t.end, 3),
            }
            for t in trace.log.turns
        ],
        "keys": [{"t": round(t, 3), "key": k} for t, k in trace.log.keys],
        "agent": [{"t": p.t, "text": p.text} for p in trace.pieces],
        "agent_text": result.transcript.strip(),
        "agent_heard": _heard_json(result),
        "actions": [vars(a) for a in trace.actions],
        "ended_by": trace.ended_by,
        "error": trace.error,
    }


def transcript_text(result: CallResult) -> str:
    trace = result.trace
    events: list[tuple[float, str]] = [(t.start, f"caller: {t.text}") for t in trace.log.turns]
    events += [(t, f"caller presses {k}") for t, k in trace.log.keys]
    events += [(a.t, f"action: {a.what} ({a.trigger})") for a in trace.actions]
    line: list[str] = []
    start = last = -math.inf
    for piece in trace.pieces:
        if line and piece.t - last > LINE_GAP_S:
            events.append((start, "agent: " + "".join(line).strip()))
            line = []
        if not line:
            start = piece.t
        line.append(piece.text)
        last = piece.t
    if line:
        events.append((start, "agent: " + "".join(line).strip()))
    events += _heard_lines(result)
    lines = [f"{t:7.2f}  {text}" for t, text in sorted(events, key=lambda e: e[0])]
    if trace.ended_by:
        lines.append(f"{trace.duration_s:7.2f}  call ended by {trace.ended_by}")
    if trace.error:
        lines.append(f"error: {trace.error}")
    return "\n".join(lines) + "\n"


def _heard_lines(result: CallResult) -> list[tuple[float, str]]:
    """The recogniser's words, grouped like the text lines: what the caller heard."""
    out: list[tuple[float, str]] = []
    group: list[str] = []
    start = last = -math.inf
    for w in result.heard or []:
        if group and w.start - last > LINE_GAP_S:
            out.append((start, "agent (heard): " + " ".join(group)))
            group = []
        if not group:
            start = w.start
        group.append(w.text)
        last = w.end
    if group:
        out.append((start, "agent (heard): " + " ".join(group)))
    return out


# ---- results.json -----------------------------------------------------------------------------


def _call_json(result: CallResult) -> dict[str, Any]:
    m = result.measures
    trace = result.trace
    return {
        "call": result.id,
        "repeat": trace.plan.repeat + 1,
        "seed": trace.plan.seed,
        "passed": result.passed,
        "error": trace.error,
        "ended_by": trace.ended_by,
        "duration_s": round(trace.duration_s, 3),
        "files": result.files,
        "measures": {
            "caller_talk_s": round(m.caller_talk_s, 3),
            "agent_talk_s": round(m.agent_talk_s, 3),
            "agent_words": m.agent_words,
            "overlap_ms": round(m.overlap_ms, 1),
            "talk_over_ms": round(m.talk_over_ms, 1),
            "backchannels": m.backchannels,
            "pause_takeovers": m.pause_takeovers,
        },
        "turns": [
            {
                "turn": t.number,
                "kind": t.kind,
                "text": t.text,
                "then": t.then,
                "speech": [round(t.start, 3), round(t.end, 3)],
                "heard": t.heard,
                "response_ms": None if t.response_ms is None else round(t.response_ms, 1),
                "stop_ms": None if t.stop_ms is None else round(t.stop_ms, 1),
                "overlap_ms": round(t.overlap_ms, 1),
                "talk_over_ms": round(t.talk_over_ms, 1),
                "backchannels": t.backchannels,
            }
            for t in m.turns
        ],
        "pauses": [
            {
                "after_turn": p.after_turn,
                "silence": [round(p.start, 3), round(p.end, 3)],
                "taken_over": p.taken_over,
            }
            for p in m.pauses
        ],
        "vad": {
            "caller": [[s.start, s.end] for s in result.caller_segments],
            "agent": [[s.start, s.end] for s in result.agent_segments],
        },
        "agent_text": result.transcript.strip(),
        "agent_heard": _heard_json(result),
        "actions": [vars(a) for a in trace.actions],
        "expectations": [_outcome_json(o) for o in result.outcomes],
        "disagreements": [o.label for o in result.disagreements],
        "fdb": _fdb_json(result),
        "session": {
            k: v for k, v in trace.session.items() if k in ("cache_hit", "prefill_ms", "queue_wait_ms")
        },
    }


def _heard_json(result: CallResult) -> dict[str, Any] | None:
    """The recogniser's words on the agent's audio (None when the run judged the model's text)."""
    if result.heard is None:
        return None
    return {"text": result.heard_text, "words": [[w.text, w.start, w.end] for w in result.heard]}


def _outcome_json(o: Outcome) -> dict[str, Any]:
    out: dict[str, Any] = {"expectation": o.label, "passed": o.passed, "message": o.message}
    if o.by_text is not None:  # a words check decided on the audio: the model's text beside it
        out.update(by_text=o.by_text, text_message=o.text_message, disagrees=o.disagrees)
    return out


def _fdb_json(result: CallResult) -> dict[str, Any] | None:
    spec = result.trace.plan.scenario.fdb
    if spec is None:
        return None
    return {
        "sample": f"r{result.trace.plan.repeat + 1}/{spec.task}/{spec.id}",
        "annotation": result.fdb_annotation,
        "measures": result.fdb.as_json() if result.fdb is not None else None,
    }


def _scenario_json(sr: ScenarioResult) -> dict[str, Any]:
    sc = sr.scenario
    return {
        "scenario": sc.name,
        "file": str(sc.file),
        "where": sc.where,
        "description": sc.description,
        "persona": sc.persona_name,
        "line": sr.calls[0].trace.plan.line.name if sr.calls else sc.line,
        "repeats": len(sr.calls),
        "passed": sr.passed,
        "pass_rate": round(sr.pass_rate, 4),
        "required_pass_rate": sc.pass_rate,
        "expectations": [
            {
                "expectation": e.label,
                "where": e.where,
                "passed": e.passed,
                "pass_rate": round(e.pass_rate, 4),
                "failures": [{"repeat": r + 1, "message": msg} for r, msg in e.failures],
            }
            for e in sr.expectations
        ],
        "fdb_task": sc.fdb.task if sc.fdb is not None else None,
        "aggregates": {name: {"unit": MEASURES[name][0], **values} for name, values in sr.aggregates.items()},
        "calls": [_call_json(c) for c in sr.calls],
    }


def results_json(summary: RunSummary) -> dict[str, Any]:
    passed, total = summary.checks
    return {
        "version": RESULTS_VERSION,
        "run": summary.run,
        "pass_rate": round(summary.pass_rate, 4),
        "checks": {"passed": passed, "total": total},
        "scenarios": [_scenario_json(sr) for sr in summary.scenarios],
    }


def write_results(out: Path, summary: RunSummary) -> Path:
    path = out / "results.json"
    path.write_text(json.dumps(results_json(summary), indent=1, ensure_ascii=False), encoding="utf-8")
    return path
