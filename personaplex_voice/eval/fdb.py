"""`--fdb DIR`: the calls in Full-Duplex-Bench's layout, so its own scorers run on them unchanged.

Full-Duplex-Bench (v1/v1.5) scores a task folder of samples, each sample a folder holding the
user's stream `input.wav` and the model's time-synchronous `output.wav` (its `asr.py` then adds
the time-aligned `output.json` the scorers read), plus the task's annotation file:

```
DIR/<task>/<id>/input.wav        the caller as the engine heard it, 16 kHz mono 16-bit
DIR/<task>/<id>/output.wav       the agent, same timeline and length
DIR/user_interruption/<id>/interrupt.json   [{"timestamp": [start, end], "context": ..., "interrupt": ...}]
DIR/smooth_turn_taking/<id>/turn_taking.json [{"timestamp": [caller turn end, call end], "text": ...}]
DIR/pause_handling/<id>/pause.json          [{"timestamp": [start, end]}, ...]  one per pause
DIR/index.json                    {"samples": {<task>/<id>: call, scenario, repeat, seed},
                                   "skipped": {call: why}}  (outside the task folders, whose
                                  scorers take every entry of a task folder for a sample)
```
A call is skipped when it failed, or when its task's annotation has nothing to hold (a
turn-taking sample with no caller turn that waits for an answer, an interruption sample whose
barge-in never came): the scorers need it in every sample.
Sample ids are numbers (the backchannel scorer only reads numeric folders). A scenario's task
is its `fdb_task`, else `user_interruption` when it has a barge-in, `pause_handling` when it has
pauses, else `smooth_turn_taking`. Times come from the VAD of the caller's side.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import soundfile

from personaplex_voice.audio.resample import resample

from .results import CallResult
from .scenario import BargeIn, Pause, Scenario

FDB_RATE = 16_000


def task_of(scenario: Scenario) -> str:
    if scenario.fdb_task:
        return scenario.fdb_task
    if any(isinstance(s, BargeIn) for s in scenario.script):
        return "user_interruption"
    if any(isinstance(s, Pause) for s in scenario.script):
        return "pause_handling"
    return "smooth_turn_taking"


def _annotation(task: str, result: CallResult) -> tuple[str, list[dict[str, Any]]] | None:
    turns = result.measures.turns
    if task == "user_interruption":
        barges = [t for t in turns if t.kind == "barge_in"]
        if not barges:
            return None
        barge = barges[0]
        context = " ".join(t.text for t in turns if t.number < barge.number)
        return "interrupt.json", [
            {
                "timestamp": [round(barge.start, 3), round(barge.end, 3)],
                "context": context,
                "interrupt": barge.text,
            }
        ]
    if task == "smooth_turn_taking":
        answered = [t for t in turns if t.then == "answer"]
        if not answered:
            return None
        last = answered[-1]
        end = round(result.trace.duration_s, 3)
        return "turn_taking.json", [{"timestamp": [round(last.end, 3), end], "text": last.text}]
    if task == "pause_handling":
        return "pause.json", [
            {"timestamp": [round(p.start, 3), round(p.end, 3)]} for p in result.measures.pauses
        ]
    return None


class FdbWriter:
    """Writes each finished call as a sample of its task; `close` writes `index.json`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.index: dict[str, dict[str, Any]] = {}
        self.skipped: dict[str, str] = {}
        self._counts: dict[str, int] = {}

    def add(self, result: CallResult) -> None:
        plan = result.trace.plan
        task = task_of(plan.scenario)
        annotation = _annotation(task, result)
        if result.trace.error is not None:
            self.skipped[result.id] = f"the call failed: {result.trace.error}"
            return
        if annotation is None and task != "backchannel":
            self.skipped[result.id] = f"no {task.replace('_', ' ')} in the call to annotate"
            return
        sample = str(self._counts.get(task, 0))
        self._counts[task] = int(sample) + 1
        folder = self.root / task / sample
        folder.mkdir(parents=True, exist_ok=True)
        rate = plan.line.rate
        for name, pcm in (("input.wav", result.trace.caller), ("output.wav", result.trace.agent)):
            soundfile.write(
                folder / name, resample(pcm, rate, FDB_RATE), FDB_RATE, subtype="PCM_16", format="WAV"
            )
        if annotation is not None:
            name, data = annotation
            (folder / name).write_text(json.dumps(data, indent=1, ensure_ascii=False), encoding="utf-8")
        self.index[f"{task}/{sample}"] = {
            "call": result.id,
            "scenario": plan.scenario.name,
            "repeat": plan.repeat + 1,
            "seed": plan.seed,
        }

    def close(self) -> None:
        data = {"samples": self.index, "skipped": self.skipped}
        (self.root / "index.json").write_text(json.dumps(data, indent=1), encoding="utf-8")
