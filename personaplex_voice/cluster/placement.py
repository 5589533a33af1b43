"""Where a new session goes: the engine worker with a free slot, preferring one whose persona
cache holds the persona, without piling every call of a popular persona onto one worker.

Pure functions over what the front-end last heard from each worker (its STATUS), so the rule
is tested without processes. Workers report the personas in their cache as fingerprints
(`persona_fingerprint`), never the prompts themselves.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

from personaplex_voice.engine.base import Persona


def persona_fingerprint(persona: Persona) -> str:
    """What identifies a persona's slot state after its system prompt: the voice and the text
    prompt (sampling and seed are not part of it). 16 hex characters."""
    voice = (persona.voice or "").removesuffix(".pt")
    digest = hashlib.sha256(json.dumps([voice, persona.text_prompt]).encode()).hexdigest()
    return digest[:16]


@dataclass(frozen=True)
class Candidate:
    """One engine worker as placement sees it."""

    worker_id: str
    free: int  # slots an unticketed open could take there now (its report minus our opens in flight)
    cached: bool  # its persona cache holds the persona
    saturated: bool = False  # it has no real-time headroom left (its STATUS says so)


def choose_worker(candidates: Sequence[Candidate], turn: int = 0) -> str | None:
    """The worker for the next session, or None when none has a free slot.

    A saturated worker is skipped whatever its free slots: the calls it carries would pay for
    one more (engine/headroom.py). A worker holding the persona in cache wins when it has at
    least half the free slots of the emptiest worker: a cache hit saves a prefill (hundreds of
    ms of GPU on the real model), but filling one GPU while another idles makes every call on
    it slower. Otherwise the emptiest worker; `turn` breaks ties in turn, so equal workers share
    the load.
    """
    open_ones = [c for c in candidates if c.free > 0 and not c.saturated]
    if not open_ones:
        return None
    most_free = max(c.free for c in open_ones)
    warm = [c for c in open_ones if c.cached and 2 * c.free >= most_free]
    pool = warm or open_ones
    best = max(c.free for c in pool)
    tied = sorted((c for c in pool if c.free == best), key=lambda c: c.worker_id)
    return tied[turn % len(tied)].worker_id
