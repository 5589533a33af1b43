"""The personas file: who answers which phone number.

```yaml
default: receptionist            # persona used for numbers not listed below
personas:
  receptionist:
    text_prompt: "You work for Acme's front desk. Greet the caller and ask how you can help."
    voice: NATF2                 # a voice name the engine knows (never a path)
    seed: 42                     # optional
    sampling: {text_temperature: 0.7, audio_topk: 250}   # optional, see engine Sampling
numbers:
  "+15551230001": receptionist   # called number (E.164) -> persona name
```
JSON with the same structure works too (`.json`). Without a file there is one persona, `default`,
with an empty prompt and the engine's default voice.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from personaplex_voice.engine.base import Persona, PersonaError, Sampling
from personaplex_voice.errors import UserError

DEFAULT_NAME = "default"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_PERSONA_KEYS = {"text_prompt", "voice", "seed", "sampling"}


def normalize_number(number: str) -> str:
    """'+1 (555) 123-0001' -> '+15551230001'; SIP URIs and client names pass through stripped."""
    number = number.strip()
    digits = re.sub(r"[\s().-]", "", number)
    return digits if re.fullmatch(r"\+?\d+", digits) else number


def persona_from_dict(name: str, spec: dict[str, Any]) -> Persona:
    if not isinstance(spec, dict):
        raise PersonaError(f"persona {name!r} must be a mapping")
    unknown = set(spec) - _PERSONA_KEYS
    if unknown:
        raise PersonaError(
            f"persona {name!r}: unknown keys {sorted(unknown)} (allowed: {sorted(_PERSONA_KEYS)})"
        )
    sampling_spec = spec.get("sampling") or {}
    if not isinstance(sampling_spec, dict):
        raise PersonaError(f"persona {name!r}: sampling must be a mapping")
    try:
        sampling = Sampling(**sampling_spec)
    except TypeError as exc:
        raise PersonaError(f"persona {name!r}: bad sampling ({exc})") from None
    seed = spec.get("seed")
    if seed is not None and not isinstance(seed, int):
        raise PersonaError(f"persona {name!r}: seed must be an integer")
    voice = spec.get("voice")
    if voice is not None and not isinstance(voice, str):
        raise PersonaError(f"persona {name!r}: voice must be a name")
    return Persona(text_prompt=str(spec.get("text_prompt", "")), voice=voice, sampling=sampling, seed=seed)


@dataclass
class PersonaBook:
    personas: dict[str, Persona] = field(default_factory=lambda: {DEFAULT_NAME: Persona()})
    numbers: dict[str, str] = field(default_factory=dict)
    default: str = DEFAULT_NAME

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PersonaBook:
        if not isinstance(data, dict):
            raise PersonaError("the personas file must hold a mapping with `personas`, `numbers`, `default`")
        unknown = set(data) - {"personas", "numbers", "default"}
        if unknown:
            raise PersonaError(f"unknown top-level keys {sorted(unknown)}")
        raw = data.get("personas") or {}
        if not isinstance(raw, dict):
            raise PersonaError("`personas` must map names to persona settings")
        personas: dict[str, Persona] = {}
        for name, spec in raw.items():
            if not isinstance(name, str) or not _NAME.match(name):
                raise PersonaError(f"bad persona name {name!r} (letters, digits, _ . -)")
            personas[name] = persona_from_dict(name, spec)
        default = data.get("default", DEFAULT_NAME)
        if default not in personas:
            if default != DEFAULT_NAME or personas:
                raise PersonaError(f"default persona {default!r} is not defined under `personas`")
            personas[DEFAULT_NAME] = Persona()
        numbers: dict[str, str] = {}
        for number, name in (data.get("numbers") or {}).items():
            if name not in personas:
                raise PersonaError(f"number {number}: persona {name!r} is not defined under `personas`")
            numbers[normalize_number(str(number))] = name
        return cls(personas=personas, numbers=numbers, default=default)

    @classmethod
    def load(cls, path: Path | None) -> PersonaBook:
        if path is None:
            return cls()
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise UserError(f"personas file {path}: {exc.strerror or exc}") from None
        try:
            if Path(path).suffix.lower() == ".json":
                data = json.loads(text)
            else:
                import yaml  # the twilio extra brings pyyaml

                data = yaml.safe_load(text)
        except Exception as exc:  # any parser error, reported with the file name
            raise UserError(f"personas file {path}: not valid YAML/JSON ({exc})") from None
        try:
            return cls.from_dict(data or {})
        except PersonaError as exc:
            raise UserError(f"personas file {path}: {exc}") from None

    def for_number(self, called: str) -> str:
        """Persona name for a called number (the default when the number is not listed)."""
        return self.numbers.get(normalize_number(called), self.default)

    def get(self, name: str) -> Persona:
        try:
            return self.personas[name]
        except KeyError:
            raise PersonaError(f"unknown persona {name!r}") from None
