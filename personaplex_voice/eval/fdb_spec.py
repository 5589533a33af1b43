"""`fdb:` in a scenario file: the scenario is one Full-Duplex-Bench sample, one event.

Full-Duplex-Bench (v1.0, `v1_v1.5/evaluation/eval_*.py` in github.com/DanielLin94144/
Full-Duplex-Bench) scores each sample as a single event over its whole `output.wav`: every word
the model says anywhere in the sample counts (pause handling: any turn at all is a takeover;
smooth turn-taking: the *first* word is the answer). A whole call that opens with the agent's
greeting would score a takeover and a zero latency every time, so a sample is a scenario that
plays exactly one stimulus, from its first frame, shaped for its task:

| task | script (S: say/wav, P: pause, Q: silence, B: barge_in) | the event |
| --- | --- | --- |
| `smooth_turn_taking` | S Q | the end of S: the agent should answer |
| `pause_handling` | S (P S)+ | the pauses: the agent should not take the turn |
| `backchannel` | S (P? S)* | a monologue: short backchannels only |
| `user_interruption` | S Q S Q, S B Q or S Q B Q | the second speech cuts in: yield, answer it |

No leading silence (an agent may greet into it, and FDB would count the greeting), no keys. A
scenario can instead name one of FDB's own sample folders (`sample: path/to/12`): its
`input.wav` is the script and its annotation file (`pause.json`, `turn_taking.json`,
`interrupt.json`) goes into the export unchanged. Each sample has an `id`, its folder name in
the export: given, the sample folder's number, or the next free number in file order. The
backchannel scorer looks the id up in its table of human backchannel timing for FDB's ICC
samples (`icc_gt_distribution.json`, ids 0-54), so a backchannel sample must say which ICC
sample it plays.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .steps import BargeIn, Dtmf, Pause, Silence, Step, speech_of
from .yaml_source import Located, ScenarioError

TASKS = ("smooth_turn_taking", "pause_handling", "backchannel", "user_interruption")
ANNOTATION_FILES = {
    "smooth_turn_taking": "turn_taking.json",
    "pause_handling": "pause.json",
    "user_interruption": "interrupt.json",
}
_SHAPES = {
    "smooth_turn_taking": (re.compile(r"SQ"), "one speech step, then a silence for the answer"),
    "pause_handling": (re.compile(r"S(PS)+"), "speech with at least one pause inside it, ending on speech"),
    "backchannel": (re.compile(r"S(P?S)*"), "speech steps and pauses only (a monologue), ending on speech"),
    "user_interruption": (
        re.compile(r"S(Q[SB]|B)Q"),
        "the context speech, a silence, the interrupting speech (or a barge_in), then a silence",
    ),
}
_KEYS = ("task", "id", "sample")


@dataclass(frozen=True)
class FdbSpec:
    task: str
    id: int | None  # the sample folder's name in the export (assigned at load when not given)
    where: str
    sample: Path | None = None  # one of FDB's sample folders: its input.wav is the script
    annotation: tuple[dict[str, Any], ...] | None = None  # that folder's annotation, as FDB wrote it


def parse(raw: Any, where: str, base: Path) -> FdbSpec:
    """`fdb: pause_handling` or `fdb: {task: ..., id: 3, sample: dir}` (paths relative to `base`)."""
    if isinstance(raw, str):
        raw = {"task": raw}
    elif not isinstance(raw, Located):
        raise ScenarioError(
            where, f"fdb is a task name or a mapping (task, id, sample); tasks: {', '.join(TASKS)}"
        )
    for key in raw:
        if key not in _KEYS:
            raise ScenarioError(
                raw.where(key) if isinstance(raw, Located) else where,
                f"unknown key {key!r} in fdb (allowed: {', '.join(_KEYS)})",
            )
    task = raw.get("task")
    if task not in TASKS:
        raise ScenarioError(where, f"fdb needs a task, one of {', '.join(TASKS)}")
    sample_id = raw.get("id")
    if sample_id is not None and (
        not isinstance(sample_id, int) or isinstance(sample_id, bool) or sample_id < 0
    ):
        raise ScenarioError(where, "fdb id must be a whole number >= 0 (the sample's folder name)")
    sample = annotation = None
    if raw.get("sample") is not None:
        sample, annotation = _sample(task, raw["sample"], where, base)
        if sample_id is None and sample.name.isdigit():
            sample_id = int(sample.name)
    if task == "backchannel" and sample_id is None:
        raise ScenarioError(
            where,
            "fdb backchannel needs an id: FDB's scorer compares the agent's backchannels with the human "
            "timing it holds for the ICC sample of that number (0-54), the sample the script plays",
        )
    return FdbSpec(task, sample_id, where, sample, annotation)


def _sample(task: str, raw: Any, where: str, base: Path) -> tuple[Path, tuple[dict[str, Any], ...] | None]:
    if not isinstance(raw, str) or not raw.strip():
        raise ScenarioError(where, "fdb sample must be the path of an FDB sample folder (holding input.wav)")
    folder = Path(raw) if Path(raw).is_absolute() else base / raw
    if not (folder / "input.wav").is_file():
        raise ScenarioError(where, f"fdb sample {folder}: no input.wav in it")
    name = ANNOTATION_FILES.get(task)
    if name is None:
        return folder, None
    path = folder / name
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ScenarioError(where, f"fdb sample {folder}: cannot read {name} ({exc})") from None
    need = ("timestamp", "context", "interrupt") if task == "user_interruption" else ("timestamp",)
    if (
        not isinstance(data, list)
        or not data
        or not all(isinstance(e, dict) and all(k in e for k in need) for e in data)
        or not all(_span(e["timestamp"]) for e in data)
    ):
        raise ScenarioError(
            where,
            f"fdb sample {folder}: {name} must be a list of {{{', '.join(need)}}} with [start, end] times",
        )
    return folder, tuple(data)


def _span(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
    )


def check_script(spec: FdbSpec, script: tuple[Step, ...]) -> None:
    """A written script must be one stimulus of the task's shape (module docstring)."""
    if any(isinstance(s, Dtmf) for s in script):
        raise ScenarioError(spec.where, "an fdb sample plays speech only: no dtmf steps")
    if isinstance(script[0], Silence):
        raise ScenarioError(
            spec.where,
            "an fdb sample starts with its speech: FDB scores every word of the sample, so a leading "
            "silence invites a greeting that counts as taking the turn",
        )
    tokens = "".join(_token(s) for s in script)
    shape, what = _SHAPES[spec.task]
    if not shape.fullmatch(tokens):
        raise ScenarioError(spec.where, f"an fdb {spec.task} script is {what}")


def _token(step: Step) -> str:
    if isinstance(step, BargeIn):
        return "B"
    if speech_of(step) is not None:
        return "S"
    return "P" if isinstance(step, Pause) else "Q"
