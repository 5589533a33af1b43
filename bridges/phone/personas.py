"""The personas file: who answers which phone number, knowing what, doing what.

```yaml
default: receptionist            # persona used for numbers not listed below
personas:
  receptionist:
    text_prompt: "You work for Acme's front desk. Greet the caller and ask how you can help."
    voice: NATF2                 # a voice name the engine knows (never a path)
    seed: 42                     # optional
    sampling: {text_temperature: 0.7, audio_topk: 250}   # optional, see engine Sampling
  billing:                       # a contact-center persona (docs/contact-center.md)
    text_prompt: "Verify customer name {customer_name}. Current schedule: {schedule}."
    variables: {customer_name: "unknown", schedule: "unknown"}   # every template field + default
    context_url: https://crm.example.com/context   # optional: POSTed the call's facts
    context_timeout_s: 1.5
    record: true                 # stereo recording under --records-dir
    webhook_url: https://crm.example.com/calls     # optional: the record, signed, after the call
    webhook_secret_env: CRM_WEBHOOK_SECRET         # optional: env var with this webhook's secret
    max_call_s: 600              # optional: then `goodbye` is said and the call ends
    goodbye: "We are out of time. Goodbye."
    actions: [...]               # see actions.py
numbers:
  "+15551230001": receptionist   # called number (E.164) -> persona name, on every carrier
carriers:                        # optional: pins for calls that come in through one carrier
  telnyx:
    default: billing             # that carrier's calls to numbers not listed anywhere
    numbers: {"+15551230002": billing}
```
A call's persona: the carrier's own pin for the number, else the number's, else the carrier's
default, else `default`. JSON with the same structure works too (`.json`). Without a file there
is one persona, `default`, with an empty prompt and the engine's default voice.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from personaplex_voice.engine.base import Persona, PersonaError, Sampling
from personaplex_voice.errors import UserError

from .actions import ActionRule, RuleError, parse_rules
from .context import CALL_FACTS, PromptTemplate, TemplateError, clean_value

DEFAULT_NAME = "default"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_VARIABLE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_ENGINE_KEYS = {"text_prompt", "voice", "seed", "sampling"}
_CONTACT_KEYS = {
    "variables",
    "context_url",
    "context_timeout_s",
    "record",
    "webhook_url",
    "webhook_secret_env",
    "max_call_s",
    "goodbye",
    "actions",
}
_PERSONA_KEYS = _ENGINE_KEYS | _CONTACT_KEYS
# Query parameters of our own webhook URL; never variables.
RESERVED_QUERY = frozenset({"persona", "outbound", "resume"})
DEFAULT_GOODBYE = "We have reached the time limit for this call. Thank you for calling, goodbye."


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


@dataclass(frozen=True)
class PersonaSpec:
    """A persona as the personas file defines it: the engine's Persona (its `text_prompt` a
    template) and what the bridge does around it. See the module docstring for the keys."""

    name: str
    persona: Persona
    template: PromptTemplate
    variables: Mapping[str, str] = field(default_factory=dict)  # declared, with their defaults
    context_url: str | None = None
    context_timeout_s: float = 1.5
    record: bool = False
    webhook_url: str | None = None
    webhook_secret_env: str | None = None
    max_call_s: float | None = None
    goodbye: str = DEFAULT_GOODBYE
    actions: tuple[ActionRule, ...] = ()

    def render(self, values: Mapping[str, str]) -> Persona:
        """The engine persona for one call: its prompt with the call's values filled in."""
        text = self.template.render({**self.variables, **values})
        return Persona(
            text_prompt=text, voice=self.persona.voice, sampling=self.persona.sampling, seed=self.persona.seed
        )


def _http_url(name: str, key: str, value: object) -> str:
    parts = urlsplit(value) if isinstance(value, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
        raise PersonaError(f"persona {name!r}: {key} must be an http(s) URL")
    return str(value)


def spec_from_dict(name: str, spec: dict[str, Any]) -> PersonaSpec:
    persona = persona_from_dict(name, spec)
    raw_vars = spec.get("variables") or {}
    if not isinstance(raw_vars, dict):
        raise PersonaError(f"persona {name!r}: variables must map names to default values")
    variables: dict[str, str] = {}
    for var, default in raw_vars.items():
        if not isinstance(var, str) or not _VARIABLE.match(var) or var in CALL_FACTS or var in RESERVED_QUERY:
            raise PersonaError(
                f"persona {name!r}: bad variable name {var!r} (letters, digits, _; not "
                f"{', '.join((*CALL_FACTS, *sorted(RESERVED_QUERY)))})"
            )
        value = clean_value("" if default is None else default)
        if value is None:
            raise PersonaError(f"persona {name!r}: the default of {var!r} must be text or a number")
        variables[var] = value
    try:
        template = PromptTemplate.parse(persona.text_prompt)
        template.check(variables)
    except TemplateError as exc:
        raise PersonaError(f"persona {name!r}: {exc}") from None
    context_url = spec.get("context_url")
    if context_url is not None:
        context_url = _http_url(name, "context_url", context_url)
    timeout = spec.get("context_timeout_s", 1.5)
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not 0.05 <= timeout <= 10:
        raise PersonaError(f"persona {name!r}: context_timeout_s must be 0.05-10 seconds")
    webhook_url = spec.get("webhook_url")
    if webhook_url is not None:
        webhook_url = _http_url(name, "webhook_url", webhook_url)
    secret_env = spec.get("webhook_secret_env")
    if secret_env is not None and (not isinstance(secret_env, str) or not _VARIABLE.match(secret_env)):
        raise PersonaError(f"persona {name!r}: webhook_secret_env must name an environment variable")
    max_call_s = spec.get("max_call_s")
    if max_call_s is not None and (
        not isinstance(max_call_s, int | float) or isinstance(max_call_s, bool) or max_call_s <= 0
    ):
        raise PersonaError(f"persona {name!r}: max_call_s must be a positive number of seconds")
    goodbye = spec.get("goodbye", DEFAULT_GOODBYE)
    if not isinstance(goodbye, str) or not goodbye.strip():
        raise PersonaError(f"persona {name!r}: goodbye must be text")
    record = spec.get("record", False)
    if not isinstance(record, bool):
        raise PersonaError(f"persona {name!r}: record must be true or false")
    try:
        actions = parse_rules(spec.get("actions"))
    except RuleError as exc:
        raise PersonaError(f"persona {name!r}: {exc}") from None
    return PersonaSpec(
        name=name,
        persona=persona,
        template=template,
        variables=variables,
        context_url=context_url,
        context_timeout_s=float(timeout),
        record=record,
        webhook_url=webhook_url,
        webhook_secret_env=secret_env,
        max_call_s=None if max_call_s is None else float(max_call_s),
        goodbye=goodbye.strip(),
        actions=actions,
    )


def plain_spec(name: str, persona: Persona) -> PersonaSpec:
    """A spec around a persona given whole (a one-off outbound persona): its text is literal."""
    return PersonaSpec(name=name, persona=persona, template=PromptTemplate(((persona.text_prompt, None),)))


@dataclass(frozen=True)
class CarrierPins:
    """The personas file's `carriers.<name>`: numbers and a default for that carrier's calls."""

    numbers: Mapping[str, str] = field(default_factory=dict)
    default: str | None = None


def _numbers(raw: object, specs: Mapping[str, PersonaSpec], where: str) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise PersonaError(f"{where} must map numbers to persona names")
    numbers: dict[str, str] = {}
    for number, name in raw.items():
        if name not in specs:
            raise PersonaError(f"number {number}: persona {name!r} is not defined under `personas`")
        numbers[normalize_number(str(number))] = name
    return numbers


def _carrier_pins(raw: object, specs: Mapping[str, PersonaSpec]) -> dict[str, CarrierPins]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise PersonaError("`carriers` must map carrier names to {numbers, default}")
    pins: dict[str, CarrierPins] = {}
    for carrier, spec in raw.items():
        if not isinstance(carrier, str) or not _VARIABLE.match(carrier):
            raise PersonaError(f"carriers: bad carrier name {carrier!r}")
        if not isinstance(spec, dict) or set(spec) - {"numbers", "default"}:
            raise PersonaError(f"carriers.{carrier} takes `numbers` and `default` only")
        default = spec.get("default")
        if default is not None and default not in specs:
            raise PersonaError(
                f"carriers.{carrier}: default persona {default!r} is not defined under `personas`"
            )
        pins[carrier.lower()] = CarrierPins(
            _numbers(spec.get("numbers"), specs, f"carriers.{carrier}.numbers"), default
        )
    return pins


@dataclass
class PersonaBook:
    specs: dict[str, PersonaSpec] = field(
        default_factory=lambda: {DEFAULT_NAME: plain_spec(DEFAULT_NAME, Persona())}
    )
    numbers: dict[str, str] = field(default_factory=dict)
    default: str = DEFAULT_NAME
    carriers: dict[str, CarrierPins] = field(default_factory=dict)

    @property
    def personas(self) -> dict[str, Persona]:
        """Name -> the engine persona as defined (its text_prompt may be a template)."""
        return {name: spec.persona for name, spec in self.specs.items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PersonaBook:
        if not isinstance(data, dict):
            raise PersonaError("the personas file must hold a mapping with `personas`, `numbers`, `default`")
        unknown = set(data) - {"personas", "numbers", "default", "carriers"}
        if unknown:
            raise PersonaError(f"unknown top-level keys {sorted(unknown)}")
        raw = data.get("personas") or {}
        if not isinstance(raw, dict):
            raise PersonaError("`personas` must map names to persona settings")
        specs: dict[str, PersonaSpec] = {}
        for name, spec in raw.items():
            if not isinstance(name, str) or not _NAME.match(name):
                raise PersonaError(f"bad persona name {name!r} (letters, digits, _ . -)")
            if not isinstance(spec, dict):
                raise PersonaError(f"persona {name!r} must be a mapping")
            specs[name] = spec_from_dict(name, spec)
        default = data.get("default", DEFAULT_NAME)
        if default not in specs:
            if default != DEFAULT_NAME or specs:
                raise PersonaError(f"default persona {default!r} is not defined under `personas`")
            specs[DEFAULT_NAME] = plain_spec(DEFAULT_NAME, Persona())
        numbers = _numbers(data.get("numbers"), specs, "`numbers`")
        carriers = _carrier_pins(data.get("carriers"), specs)
        return cls(specs=specs, numbers=numbers, default=default, carriers=carriers)

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
                import yaml  # the phone extra brings pyyaml

                data = yaml.safe_load(text)
        except Exception as exc:  # any parser error, reported with the file name
            raise UserError(f"personas file {path}: not valid YAML/JSON ({exc})") from None
        try:
            return cls.from_dict(data or {})
        except PersonaError as exc:
            raise UserError(f"personas file {path}: {exc}") from None

    def for_number(self, called: str, carrier: str | None = None) -> str:
        """Persona name for a called number: the carrier's pin for it, the number's, the
        carrier's default, the default."""
        number = normalize_number(called)
        pins = self.carriers.get(carrier or "")
        if pins is not None and number in pins.numbers:
            return pins.numbers[number]
        if number in self.numbers:
            return self.numbers[number]
        if pins is not None and pins.default is not None:
            return pins.default
        return self.default

    def spec(self, name: str) -> PersonaSpec:
        try:
            return self.specs[name]
        except KeyError:
            raise PersonaError(f"unknown persona {name!r}") from None

    def get(self, name: str) -> Persona:
        """The engine persona as defined (a template prompt is not rendered: use `spec().render`)."""
        return self.spec(name).persona
