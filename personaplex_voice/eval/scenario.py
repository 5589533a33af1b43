"""Scenario files: who answers, on which line, what the caller does, what must happen.

```yaml
personas_file: twilio_personas.yaml        # optional; relative to this file
defaults: {persona: waste-service, line: twilio}   # any scenario key but name/script
scenarios:
  - name: address-question
    persona: waste-service                 # a name from personas_file, or an inline persona
    variables: {customer_name: Omar Torres}
    line: twilio                           # wideband | twilio | browser (see lines.py)
    caller: {voice: en-us, rate: 165}      # espeak-ng voice, words per minute, pitch
    script:
      - silence: 1.5s
      - say: "When is my next pickup?"
      - pause: 0.8s                        # the caller keeps the floor
      - barge_in: {after_agent_speech_ms: 800, say: "Sorry, I meant recycling."}
      - dtmf: "0"
      - wav: clips/hello.wav
    expect:
      agent_says: ["tuesday"]
      agent_never_says: ["pizza"]
      responds_within_ms: 800
      stops_within_ms: 600
      max_talk_over_ms: 500
      max_pause_takeovers: 0
      action: transfer
    pass_rate: 0.8                         # of the repeats an expectation must hold in
```
Everything is checked when the file loads; a problem is one `ScenarioError` naming the file and
the line (docs/eval.md has the format in full).
"""

from __future__ import annotations

import difflib
import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from personaplex_voice.audio.io import read_audio
from personaplex_voice.engine.base import SAMPLE_RATE, PersonaError
from personaplex_voice.errors import UserError

from . import fdb_spec, phone
from .lines import LINES
from .steps import BargeIn, CallerVoice, Dtmf, Pause, Say, Silence, Step, Wav, waits_for_answer
from .yaml_source import Located, LocatedList, ScenarioError, load

DTMF_KEYS = frozenset("0123456789*#ABCD")
NO_ACTION = "none"
MAX_STEP_S = 600.0  # one silence, pause or wav
MAX_SCRIPT_S = 3600.0  # the fixed-length steps of one script together
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(ms|s|sec|min)?\s*$")
_UNIT_S = {None: 1.0, "s": 1.0, "sec": 1.0, "ms": 0.001, "min": 60.0}

_TOP_KEYS = ("personas_file", "defaults", "scenarios")
_SCENARIO_KEYS = (
    "name",
    "description",
    "persona",
    "variables",
    "line",
    "seed",
    "caller",
    "script",
    "expect",
    "pass_rate",
    "fdb",
)
_DEFAULT_KEYS = tuple(k for k in _SCENARIO_KEYS if k not in ("name", "script", "description", "fdb"))
_STEP_KEYS = ("say", "wav", "silence", "pause", "barge_in", "dtmf")
_SAY_KEYS = ("text", "voice", "rate", "pitch")
_BARGE_KEYS = ("after_agent_speech_ms", "say", "wav", "max_wait", "voice", "rate", "pitch")
_CALLER_KEYS = ("voice", "rate", "pitch")
_EXPECT_KEYS = (
    "agent_says",
    "agent_never_says",
    "responds_within_ms",
    "stops_within_ms",
    "max_talk_over_ms",
    "max_pause_takeovers",
    "action",
)


@dataclass(frozen=True)
class Expectation:
    """One checked promise; `value` is an int (limits), a compiled pattern (agent_says,
    agent_never_says) or a tuple of action kinds (action)."""

    key: str
    value: Any
    where: str

    @property
    def label(self) -> str:
        if isinstance(self.value, re.Pattern):
            return f"{self.key} /{self.value.pattern}/"
        if isinstance(self.value, tuple):
            return f"{self.key} {'|'.join(self.value)}"
        return f"{self.key} {self.value}"


@dataclass(frozen=True)
class Scenario:
    name: str
    file: Path
    where: str
    persona_name: str
    spec: phone.PersonaSpec
    line: str
    script: tuple[Step, ...]
    expectations: tuple[Expectation, ...]
    variables: Mapping[str, str] = field(default_factory=dict)
    seed: int | None = None
    pass_rate: float = 1.0
    fdb: fdb_spec.FdbSpec | None = None  # a Full-Duplex-Bench sample (one event), see fdb_spec
    description: str = ""
    persona_where: str = ""  # where the persona was given (the engine's refusals point there)

    def call_facts(self) -> dict[str, str]:
        """The call's own From/To/CallSid for prompt templates (a scenario may set them)."""
        facts = {"From": "+15550100000", "To": "+15550100001", "CallSid": f"CAeval-{self.name}"}
        facts.update({k: v for k, v in self.variables.items() if k in phone.CALL_FACTS})
        return facts


# ---- loading ----------------------------------------------------------------------------------


def load_scenarios(paths: Sequence[Path]) -> list[Scenario]:
    """Every scenario of every file, validated; names are unique across the files."""
    if not paths:
        raise UserError("give at least one scenario file")
    scenarios: list[Scenario] = []
    seen: dict[str, str] = {}
    for path in paths:
        for scenario in _load_file(Path(path)):
            if scenario.name in seen:
                raise ScenarioError(
                    scenario.where,
                    f"scenario name {scenario.name!r} is already used at {seen[scenario.name]}",
                )
            seen[scenario.name] = scenario.where
            scenarios.append(scenario)
    return _number_fdb_samples(scenarios)


def _number_fdb_samples(scenarios: list[Scenario]) -> list[Scenario]:
    """Every fdb sample gets its id: the one given (unique within its task), else the next free
    number in file order, so a sample keeps its folder name from run to run."""
    taken: dict[tuple[str, int], str] = {}
    for sc in scenarios:
        if sc.fdb is not None and sc.fdb.id is not None:
            key = (sc.fdb.task, sc.fdb.id)
            if key in taken:
                raise ScenarioError(
                    sc.fdb.where, f"fdb {sc.fdb.task} id {sc.fdb.id} is already used at {taken[key]}"
                )
            taken[key] = sc.fdb.where
    out = []
    for sc in scenarios:
        if sc.fdb is not None and sc.fdb.id is None:
            free = next(i for i in itertools.count() if (sc.fdb.task, i) not in taken)
            taken[(sc.fdb.task, free)] = sc.fdb.where
            sc = replace(sc, fdb=replace(sc.fdb, id=free))
        out.append(sc)
    return out


def _load_file(path: Path) -> list[Scenario]:
    data = load(path)
    if not isinstance(data, Located):
        raise ScenarioError(f"{path}:1", "a scenario file is a mapping with `scenarios:` (see docs/eval.md)")
    _check_keys(data, _TOP_KEYS, "the file")
    book = None
    if "personas_file" in data:
        raw = data["personas_file"]
        if not isinstance(raw, str) or not raw.strip():
            raise ScenarioError(data.where("personas_file"), "personas_file must be a path")
        book_path = (path.parent / raw).resolve() if not Path(raw).is_absolute() else Path(raw)
        try:
            book = phone.load_book(book_path)
        except UserError as exc:
            raise ScenarioError(data.where("personas_file"), str(exc)) from None
    defaults = data.get("defaults") or Located()
    if not isinstance(defaults, Located):
        raise ScenarioError(data.where("defaults"), "defaults must be a mapping of scenario keys")
    _check_keys(defaults, _DEFAULT_KEYS, "defaults")
    items = data.get("scenarios")
    if not isinstance(items, LocatedList) or not items:
        raise ScenarioError(data.where("scenarios"), "`scenarios:` must be a non-empty list")
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, Located):
            raise ScenarioError(items.where(i), "each scenario is a mapping (name, script, expect, ...)")
        out.append(_scenario(path, item, defaults, book))
    return out


_RENAMED = {"fdb_task": "fdb_task is now `fdb: <task>` (or `fdb: {task, id, sample}`), see docs/eval.md"}


def _check_keys(mapping: Located, allowed: Sequence[str], what: str) -> None:
    for key in mapping:
        if key in _RENAMED and key not in allowed:
            raise ScenarioError(mapping.where(key), _RENAMED[key])
        if key not in allowed:
            hint = difflib.get_close_matches(str(key), allowed, n=1)
            more = f" (did you mean {hint[0]!r}?)" if hint else f" (allowed: {', '.join(allowed)})"
            raise ScenarioError(mapping.where(key), f"unknown key {key!r} in {what}{more}")


def _pick(item: Located, defaults: Located, key: str) -> tuple[Any, str | None]:
    """A scenario key's value and where it was written (the scenario's own, else the defaults')."""
    if key in item:
        return item[key], item.where(key)
    if key in defaults:
        return defaults[key], defaults.where(key)
    return None, None


def _scenario(path: Path, item: Located, defaults: Located, book: phone.PersonaBook | None) -> Scenario:
    _check_keys(item, _SCENARIO_KEYS, "a scenario")
    name = item.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ScenarioError(
            item.where("name"), "every scenario needs a `name` (letters, digits, _ . -; at most 64)"
        )
    where = item.where("name")
    description = item.get("description", "")
    if not isinstance(description, str):
        raise ScenarioError(item.where("description"), "description must be text")

    persona_name, spec = _persona(item, defaults, book, name, where)
    persona_where = _pick(item, defaults, "persona")[1] or where
    variables = _variables(item, defaults, spec, persona_name)

    line, line_where = _pick(item, defaults, "line")
    line = "wideband" if line is None else line
    if line not in LINES:
        hint = difflib.get_close_matches(str(line), list(LINES), n=1)
        more = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ScenarioError(line_where or where, f"unknown line {line!r}{more}; lines: {', '.join(LINES)}")

    seed, seed_where = _pick(item, defaults, "seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise ScenarioError(seed_where or where, "seed must be a whole number >= 0")

    voice = _caller(item, defaults)
    fdb = None
    if "fdb_task" in item or "fdb_task" in defaults:
        at = item.where("fdb_task") if "fdb_task" in item else defaults.where("fdb_task")
        raise ScenarioError(
            at, "fdb_task is now `fdb: <task>` (or `fdb: {task, id, sample}`), see docs/eval.md"
        )
    if "fdb" in item:
        fdb = fdb_spec.parse(item["fdb"], item.where("fdb"), path.parent)
    if fdb is not None and fdb.sample is not None:
        if "script" in item:
            raise ScenarioError(
                item.where("script"), "an fdb sample's script is its input.wav: give sample or script"
            )
        script: tuple[Step, ...] = (_wav(path, str(fdb.sample / "input.wav"), fdb.where),)
    else:
        script = _script(path, item, voice, where)
        if fdb is not None:
            fdb_spec.check_script(fdb, script)

    pass_rate, rate_where = _pick(item, defaults, "pass_rate")
    if pass_rate is None:
        pass_rate = 1.0
    elif not _number(pass_rate) or not 0 < pass_rate <= 1:
        raise ScenarioError(rate_where or where, "pass_rate must be a number in (0, 1]")

    expectations = _expectations(item, defaults, where)
    _check_expectations_fit(expectations, script, spec, persona_name)
    return Scenario(
        name=name,
        file=path,
        where=where,
        persona_name=persona_name,
        spec=spec,
        line=line,
        script=script,
        expectations=expectations,
        variables=variables,
        seed=seed,
        pass_rate=float(pass_rate),
        fdb=fdb,
        description=description,
        persona_where=persona_where,
    )


def _persona(
    item: Located, defaults: Located, book: phone.PersonaBook | None, name: str, where: str
) -> tuple[str, phone.PersonaSpec]:
    raw, raw_where = _pick(item, defaults, "persona")
    if raw is None:
        raise ScenarioError(where, f"scenario {name!r} has no persona (give `persona:` here or in defaults)")
    assert raw_where is not None
    if isinstance(raw, Located) and set(raw) == {"name"}:
        raw = raw["name"]
    if isinstance(raw, str):
        if book is None:
            raise ScenarioError(
                raw_where, f"persona {raw!r} is a name, but the file has no personas_file to look it up in"
            )
        if raw not in book.specs:
            known = ", ".join(sorted(book.specs))
            raise ScenarioError(raw_where, f"unknown persona {raw!r} (the personas file has: {known})")
        return raw, book.specs[raw]
    if isinstance(raw, Located):
        inline_name = f"{name}-persona"
        try:
            return inline_name, phone.spec_from_mapping(inline_name, raw)
        except PersonaError as exc:
            raise ScenarioError(raw_where, f"bad inline persona: {exc}") from None
    raise ScenarioError(
        raw_where, "persona must be a name from personas_file or a mapping (text_prompt, voice...)"
    )


def _variables(
    item: Located, defaults: Located, spec: phone.PersonaSpec, persona_name: str
) -> dict[str, str]:
    merged: dict[str, str] = {}
    for source in (defaults, item):
        raw = source.get("variables")
        if raw is None:
            continue
        if not isinstance(raw, Located):
            raise ScenarioError(source.where("variables"), "variables must map names to values")
        for key, value in raw.items():
            if key not in spec.variables and key not in phone.CALL_FACTS:
                if source is defaults:
                    continue  # shared defaults may be meant for the file's other personas
                declared = ", ".join(sorted(spec.variables)) or "none"
                raise ScenarioError(
                    raw.where(key),
                    f"persona {persona_name!r} does not declare the variable {key!r} (declared: {declared})",
                )
            if isinstance(value, Located | LocatedList) or value is None:
                raise ScenarioError(raw.where(key), f"variable {key!r} must be text or a number")
            merged[str(key)] = str(value)
    return merged


def _caller(item: Located, defaults: Located) -> CallerVoice:
    values: dict[str, Any] = {}
    for source in (defaults, item):
        raw = source.get("caller")
        if raw is None:
            continue
        if not isinstance(raw, Located):
            raise ScenarioError(source.where("caller"), "caller must be a mapping (voice, rate, pitch)")
        _check_keys(raw, _CALLER_KEYS, "caller")
        values.update({k: (v, raw.where(k)) for k, v in raw.items()})
    return _voice(CallerVoice(), values)


def _voice(base: CallerVoice, values: Mapping[str, tuple[Any, str]]) -> CallerVoice:
    voice, rate, pitch = base.voice, base.rate, base.pitch
    if "voice" in values:
        raw, where = values["voice"]
        if not isinstance(raw, str) or not re.fullmatch(r"[A-Za-z0-9_+\-]{1,40}", raw):
            raise ScenarioError(where, "voice must be an espeak-ng voice name such as en-us or en-gb+f3")
        voice = raw
    if "rate" in values:
        raw, where = values["rate"]
        if not isinstance(raw, int) or isinstance(raw, bool) or not 80 <= raw <= 450:
            raise ScenarioError(where, "rate must be words per minute, 80-450")
        rate = raw
    if "pitch" in values:
        raw, where = values["pitch"]
        if not isinstance(raw, int) or isinstance(raw, bool) or not 0 <= raw <= 99:
            raise ScenarioError(where, "pitch must be 0-99")
        pitch = raw
    return CallerVoice(voice, rate, pitch)


# ---- the script -------------------------------------------------------------------------------


def parse_duration(value: Any, where: str, what: str) -> float:
    """'2s', '1.5 s', '800ms', '1min' or a number of seconds; within (0, MAX_STEP_S]."""
    if _number(value):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.match(value)):
        seconds = float(match.group(1)) * _UNIT_S[match.group(2)]
    else:
        raise ScenarioError(where, f"bad duration {value!r} for {what} (write it like 2s, 1.5s or 800ms)")
    if not 0 < seconds <= MAX_STEP_S:
        raise ScenarioError(
            where, f"{what} must last more than 0 and at most {MAX_STEP_S:g} s, got {value!r}"
        )
    return seconds


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


def _script(path: Path, item: Located, voice: CallerVoice, where: str) -> tuple[Step, ...]:
    raw = item.get("script")
    if not isinstance(raw, LocatedList) or not raw:
        raise ScenarioError(
            item.where("script") if "script" in item else where, "script must be a non-empty list of steps"
        )
    steps: list[Step] = []
    fixed_s = 0.0
    for i, entry in enumerate(raw):
        step = _step(path, entry, raw.where(i), voice)
        steps.append(step)
        if isinstance(step, Silence | Pause):
            fixed_s += step.seconds
    if fixed_s > MAX_SCRIPT_S:
        raise ScenarioError(
            item.where("script"), f"the script's silences add up to more than {MAX_SCRIPT_S:g} s"
        )
    return tuple(steps)


def _step(path: Path, entry: Any, where: str, voice: CallerVoice) -> Step:
    if not isinstance(entry, Located):
        raise ScenarioError(where, f"each step is one of {', '.join(k + ':' for k in _STEP_KEYS)}")
    _check_keys(entry, _STEP_KEYS, "a script step")
    if len(entry) != 1:
        raise ScenarioError(where, f"a step has exactly one of {', '.join(k + ':' for k in _STEP_KEYS)}")
    ((kind, value),) = entry.items()
    at = entry.where(kind)
    if kind == "say":
        return _say(value, at, voice)
    if kind == "wav":
        return _wav(path, value, at)
    if kind == "silence":
        return Silence(parse_duration(value, at, "silence"), at)
    if kind == "pause":
        return Pause(parse_duration(value, at, "pause"), at)
    if kind == "dtmf":
        keys = str(value) if isinstance(value, str | int) and not isinstance(value, bool) else ""
        if not keys or len(keys) > 20 or set(keys) - DTMF_KEYS:
            raise ScenarioError(at, 'dtmf must be 1-20 keys of 0-9 * # A-D, e.g. dtmf: "0"')
        return Dtmf(keys, at)
    return _barge_in(path, value, at, voice)


def _say(value: Any, where: str, voice: CallerVoice) -> Say:
    if isinstance(value, Located):
        _check_keys(value, _SAY_KEYS, "say")
        text = value.get("text")
        voice = _voice(voice, {k: (value[k], value.where(k)) for k in _CALLER_KEYS if k in value})
    else:
        text = value
    if isinstance(text, int | float) and not isinstance(text, bool):
        text = str(text)
    if not isinstance(text, str) or not text.strip() or len(text) > 2000:
        raise ScenarioError(where, "say needs text of 1-2000 characters")
    return Say(" ".join(text.split()), voice, where)


def _wav(path: Path, value: Any, where: str) -> Wav:
    if not isinstance(value, str) or not value.strip():
        raise ScenarioError(where, "wav must be the path of an audio file (relative to this file)")
    file = Path(value) if Path(value).is_absolute() else (path.parent / value)
    try:
        pcm = read_audio(file, SAMPLE_RATE)
    except UserError as exc:
        raise ScenarioError(where, str(exc)) from None
    if pcm.size == 0:
        raise ScenarioError(where, f"{file}: the audio file holds no samples")
    if pcm.size > MAX_STEP_S * SAMPLE_RATE:
        raise ScenarioError(where, f"{file}: longer than {MAX_STEP_S:g} s")
    return Wav(file, where)


def _barge_in(path: Path, value: Any, where: str, voice: CallerVoice) -> BargeIn:
    if not isinstance(value, Located):
        raise ScenarioError(where, 'barge_in is a mapping: {after_agent_speech_ms: 800, say: "..."}')
    _check_keys(value, _BARGE_KEYS, "barge_in")
    after = value.get("after_agent_speech_ms")
    if not isinstance(after, int) or isinstance(after, bool) or not 0 <= after <= 60_000:
        raise ScenarioError(
            value.where("after_agent_speech_ms") if "after_agent_speech_ms" in value else where,
            "barge_in needs after_agent_speech_ms: a whole number of ms, 0-60000",
        )
    if ("say" in value) == ("wav" in value):
        raise ScenarioError(where, "barge_in needs exactly one of say: or wav:")
    if "say" in value:
        voice = _voice(voice, {k: (value[k], value.where(k)) for k in _CALLER_KEYS if k in value})
        speech: Say | Wav = _say(value["say"], value.where("say"), voice)
    else:
        speech = _wav(path, value["wav"], value.where("wav"))
    max_wait = 20.0
    if "max_wait" in value:
        max_wait = parse_duration(value["max_wait"], value.where("max_wait"), "barge_in max_wait")
    return BargeIn(after, speech, max_wait, where)


# ---- expectations -----------------------------------------------------------------------------


def _expectations(item: Located, defaults: Located, where: str) -> tuple[Expectation, ...]:
    merged: dict[str, tuple[Any, str]] = {}
    for source in (defaults, item):
        raw = source.get("expect")
        if raw is None:
            continue
        if not isinstance(raw, Located):
            raise ScenarioError(source.where("expect"), "expect must be a mapping of expectations")
        _check_keys(raw, _EXPECT_KEYS, "expect")
        merged.update({k: (v, raw.where(k)) for k, v in raw.items()})
    out: list[Expectation] = []
    for key in _EXPECT_KEYS:  # a fixed order: the report and the JUnit file read the same
        if key not in merged:
            continue
        value, at = merged[key]
        if key in ("agent_says", "agent_never_says"):
            out.extend(Expectation(key, pattern, w) for pattern, w in _patterns(key, value, at))
        elif key == "action":
            out.append(Expectation(key, _action_kinds(value, at), at))
        else:
            minimum = 1 if key in ("responds_within_ms", "stops_within_ms") else 0
            if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= 600_000:
                raise ScenarioError(at, f"{key} must be a whole number >= {minimum}")
            out.append(Expectation(key, value, at))
    return tuple(out)


def _patterns(key: str, value: Any, where: str) -> list[tuple[re.Pattern[str], str]]:
    items = value if isinstance(value, LocatedList) else [value]
    lines = [value.where(i) for i in range(len(items))] if isinstance(value, LocatedList) else [where]
    if not items:
        raise ScenarioError(where, f"{key} needs at least one regular expression")
    out = []
    for text, at in zip(items, lines, strict=True):
        if not isinstance(text, str) or not text:
            raise ScenarioError(at, f"{key}: each entry is a regular expression (text)")
        try:
            out.append((re.compile(text, re.IGNORECASE), at))
        except re.error as exc:
            raise ScenarioError(at, f"{key}: {text!r} is not a regular expression ({exc})") from None
    return out


def _action_kinds(value: Any, where: str) -> tuple[str, ...]:
    kinds = list(value) if isinstance(value, LocatedList) else [value]
    allowed = (*phone.ACTION_KINDS, NO_ACTION)
    if not kinds or any(k not in allowed for k in kinds):
        raise ScenarioError(where, f"action must be one of {', '.join(allowed)} (or a list of them)")
    if NO_ACTION in kinds and len(kinds) > 1:
        raise ScenarioError(where, f"action {NO_ACTION!r} cannot be listed with other actions")
    return tuple(kinds)


def _check_expectations_fit(
    expectations: tuple[Expectation, ...], script: tuple[Step, ...], spec: phone.PersonaSpec, persona: str
) -> None:
    """Expectations the script cannot exercise are mistakes in the file, said at load time."""
    for exp in expectations:
        if exp.key == "responds_within_ms" and not any(
            waits_for_answer(script, i) for i in range(len(script))
        ):
            raise ScenarioError(
                exp.where,
                "responds_within_ms: no caller turn waits for an answer (say/wav then silence or the end)",
            )
        if exp.key == "stops_within_ms" and not any(isinstance(s, BargeIn) for s in script):
            raise ScenarioError(exp.where, "stops_within_ms needs a barge_in step in the script")
        if exp.key == "max_pause_takeovers" and not any(isinstance(s, Pause) for s in script):
            raise ScenarioError(exp.where, "max_pause_takeovers needs a pause step in the script")
        if exp.key == "action":
            kinds = {rule.kind for rule in spec.actions}
            missing = [k for k in exp.value if k != NO_ACTION and k not in kinds]
            if missing:
                have = ", ".join(sorted(kinds)) or "no action rules"
                raise ScenarioError(
                    exp.where, f"persona {persona!r} has no rule that can {missing[0]} (it has: {have})"
                )
