"""`--fdb DIR`: the run's Full-Duplex-Bench samples in FDB's layout, for its own scorers.

FDB v1.0 (github.com/DanielLin94144/Full-Duplex-Bench, `v1_v1.5/`) scores a task folder of sample
folders: each holds the user's stream `input.wav`, the model's time-synchronous `output.wav`,
the task's annotation file, and the `output.json` its `get_transcript/asr.py` makes from
`output.wav` (word chunks with times). Its scorers treat every entry of a task folder as a
sample (`eval_pause_handling.py` lists it and opens each entry as a folder,
`eval_user_interruption.py` walks every folder below), so a task folder holds sample folders
only. One repeat of the run is one FDB run:

```
DIR/r<repeat>/<task>/<id>/input.wav    the caller as the engine heard it, 16 kHz mono 16-bit
DIR/r<repeat>/<task>/<id>/output.wav   the agent as the caller heard it, same timeline and length
DIR/r<repeat>/<task>/<id>/pause.json | turn_taking.json | interrupt.json   (backchannel: none)
DIR/index.json     {"samples": {"r1/pause_handling/3": {call, scenario, repeat, seed}, ...},
                    "skipped": {call: why}, "not_samples": [scenario, ...]}
```

Only scenarios marked `fdb:` are samples (`fdb_spec`: one stimulus, one event, stable ids); a
whole call is not one, since FDB would score its greeting as taking the turn, and `run_suite`
says so. A sample whose event did not happen (a barge-in whose cue never came) or whose call
failed is listed under `skipped`: the scorers need the annotation in every sample.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import soundfile

from personaplex_voice.audio.resample import resample

from .fdb_spec import ANNOTATION_FILES
from .results import CallResult

FDB_RATE = 16_000


def sample_path(result: CallResult) -> str:
    """`r<repeat>/<task>/<id>` of a call whose scenario is an FDB sample."""
    plan = result.trace.plan
    spec = plan.scenario.fdb
    assert spec is not None and spec.id is not None
    return f"r{plan.repeat + 1}/{spec.task}/{spec.id}"


class FdbWriter:
    """Writes each finished sample call; `close` writes `index.json`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.index: dict[str, dict[str, Any]] = {}
        self.skipped: dict[str, str] = {}
        self.not_samples: set[str] = set()

    def add(self, result: CallResult) -> None:
        plan = result.trace.plan
        spec = plan.scenario.fdb
        if spec is None:
            self.not_samples.add(plan.scenario.name)
            return
        if result.trace.error is not None:
            self.skipped[result.id] = f"the call failed: {result.trace.error}"
            return
        if result.fdb_annotation is None and spec.task != "backchannel":
            self.skipped[result.id] = "the interruption never came (the agent never spoke long enough)"
            return
        sample = sample_path(result)
        folder = self.root / sample
        folder.mkdir(parents=True, exist_ok=True)
        rate = plan.line.rate
        for name, pcm in (("input.wav", result.trace.caller), ("output.wav", result.trace.agent)):
            soundfile.write(
                folder / name, resample(pcm, rate, FDB_RATE), FDB_RATE, subtype="PCM_16", format="WAV"
            )
        if result.fdb_annotation is not None:
            text = json.dumps(result.fdb_annotation, indent=1, ensure_ascii=False)
            (folder / ANNOTATION_FILES[spec.task]).write_text(text, encoding="utf-8")
        self.index[sample] = {
            "call": result.id,
            "scenario": plan.scenario.name,
            "repeat": plan.repeat + 1,
            "seed": plan.seed,
        }

    def close(self) -> None:
        data = {"samples": dict(sorted(self.index.items())), "skipped": self.skipped}
        data["not_samples"] = sorted(self.not_samples)
        (self.root / "index.json").write_text(json.dumps(data, indent=1), encoding="utf-8")
