"""A system prompt run into one slot a chunk at a time (the `SlotPrefill` of `Engine.begin_start`).

Chunk sizes are fixed by the engine (prompt positions or generator steps), never by the caller's
timing, so a slot prefilled in many small pieces between ticks ends in the same state as one
prefilled at once. Both kinds know nothing of the engine: it hands them what to run per chunk
and what to do once the prompt is in.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class ParallelPrefill:
    """The prompt's input embeddings [P, dim] as transformer forwards of `chunk` positions."""

    def __init__(
        self,
        inputs: torch.Tensor | None,
        run_positions: Callable[[torch.Tensor], None],
        finish: Callable[[], None],
        chunk: int,
    ):
        self._inputs = inputs
        self._run = run_positions
        self._finish = finish
        self._done = 0  # positions run
        self._total = 0 if inputs is None else int(inputs.shape[0])
        self._chunk = max(1, chunk)

    @property
    def remaining(self) -> int:
        return -(-(self._total - self._done) // self._chunk) if self._inputs is not None else 0

    @torch.no_grad()
    def run_chunk(self) -> bool:
        if self._inputs is not None and self._done < self._total:
            end = min(self._total, self._done + self._chunk)
            self._run(self._inputs[self._done : end])
            self._done = end
            if end < self._total:
                return False
        self._inputs = None
        self._finish()
        return True


class StepwisePrefill:
    """The prompt replayed step by step through the tick's own code (the published behaviour),
    `chunk` generator steps at a time."""

    def __init__(self, steps: int, run_step: Callable[[int], None], finish: Callable[[], None], chunk: int):
        self._steps = steps
        self._run_step = run_step
        self._finish = finish
        self._next = 0
        self._chunk = max(1, chunk)

    @property
    def remaining(self) -> int:
        return -(-(self._steps - self._next) // self._chunk)

    @torch.no_grad()
    def run_chunk(self) -> bool:
        end = min(self._steps, self._next + self._chunk)
        for i in range(self._next, end):
            self._run_step(i)
        self._next = end
        if end < self._steps:
            return False
        self._finish()
        return True
