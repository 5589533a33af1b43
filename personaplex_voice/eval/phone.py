"""Everything `eval` takes from the phone-call code, in one place.

A scenario's persona is a persona as the phone call knows it (personas file, prompt template
and variables, action rules), and its phone lines are the phone call's own audio path in each
carrier's format. All of it is the carrier-neutral phone package's (`personaplex_phone`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from personaplex_phone.actions import ACTION_KINDS, ActionMatcher, ActionRule
from personaplex_phone.audio_path import InboundAudio, OutboundAudio, codec_for
from personaplex_phone.carrier import AudioFormat
from personaplex_phone.context import CALL_FACTS
from personaplex_phone.personas import PersonaBook, PersonaSpec, spec_from_dict

from personaplex_voice.engine.base import Persona

__all__ = [
    "ACTION_KINDS",
    "CALL_FACTS",
    "ActionMatcher",
    "ActionRule",
    "AudioFormat",
    "InboundAudio",
    "OutboundAudio",
    "PersonaBook",
    "PersonaSpec",
    "codec_for",
    "ends_call",
    "load_book",
    "render",
    "spec_from_mapping",
]


def load_book(path: Path) -> PersonaBook:
    """The personas file (raises UserError naming the file and the problem)."""
    return PersonaBook.load(path)


def spec_from_mapping(name: str, spec: Mapping[str, Any]) -> PersonaSpec:
    """An inline persona, with exactly the keys of a personas file entry (raises PersonaError)."""
    return spec_from_dict(name, dict(spec))


def render(spec: PersonaSpec, variables: Mapping[str, str], facts: Mapping[str, str]) -> Persona:
    """The engine persona of one call: the template filled as the bridge fills it (declared
    defaults, then the call's values), `facts` being the call's own From/To/CallSid."""
    return spec.render({**variables, **facts})


def ends_call(rule: ActionRule) -> bool:
    """Whether the action takes the caller away from the agent on a real call (the bridge then
    ends the stream): every action but `play ... then: resume`."""
    return not (rule.kind == "play" and rule.then == "resume")
