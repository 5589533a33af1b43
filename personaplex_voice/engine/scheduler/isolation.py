"""A batched step that fails ends only the sessions it fails for.

An engine that can tell which slots are at fault raises `SlotError` before touching any state:
those sessions end and the others are stepped again at once. Any other error is isolated by
stepping each half of the batch on its own, recursively, until each failing session is alone;
every healthy session is stepped exactly once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from personaplex_voice.engine.base import Engine, SlotError, StepOutput
from personaplex_voice.engine.scheduler.records import ScheduledSession

log = logging.getLogger("personaplex_voice.engine.scheduler")

# fail(record, error, first): end that session; `first` is True for the first failure of a tick
# (the one logged with its traceback).
Fail = Callable[[ScheduledSession, BaseException, bool], None]
Results = list[tuple[ScheduledSession, StepOutput]]


def step_isolating(engine: Engine, records: list[ScheduledSession], pcm: np.ndarray, fail: Fail) -> Results:
    """`engine.step` for `records` (each in its slot); the sessions a failure is pinned on are
    handed to `fail`, the others come back with the output of the step that ran them."""
    return _step(engine, records, pcm, fail, first=True)


def _step(
    engine: Engine, records: list[ScheduledSession], pcm: np.ndarray, fail: Fail, first: bool
) -> Results:
    active = np.zeros(engine.num_slots, bool)
    for record in records:
        active[record.slot] = True
    try:
        out = engine.step(pcm, active)
    except SlotError as exc:
        guilty = [r for r in records if r.slot in exc.slots]
        if not guilty:  # it names no slot of this batch: treat it as unattributed
            return _bisect(engine, records, pcm, fail, exc, first)
        for record in guilty:
            fail(record, exc, first)
            first = False
        rest = [r for r in records if r not in guilty]
        return _step(engine, rest, pcm, fail, first=False) if rest else []
    except Exception as exc:
        return _bisect(engine, records, pcm, fail, exc, first)
    return [(r, out) for r in records]


def _bisect(
    engine: Engine, records: list[ScheduledSession], pcm: np.ndarray, fail: Fail, exc: Exception, first: bool
) -> Results:
    if len(records) == 1:
        fail(records[0], exc, first)
        return []
    if first:
        log.error(
            "engine.step failed for a batch of %d: %s; isolating the failing slot(s)",
            len(records),
            exc,
            exc_info=exc,
        )
    half = len(records) // 2
    return _step(engine, records[:half], pcm, fail, False) + _step(engine, records[half:], pcm, fail, False)
