"""A system prompt run into one slot a chunk at a time (the `SlotPrefill` of `Engine.begin_start`).

Chunk sizes are fixed by the engine (prompt positions or generator steps), never by the caller's
timing, so a slot prefilled in many small pieces between ticks ends in the same state as one
prefilled at once. Both kinds know nothing of the engine: it hands them what to run per chunk
and what to do once the prompt is in.

Every chunk ends with `sync` (a device synchronisation on a GPU), so the time a caller measures
around `run_chunk` is the chunk's real cost: the scheduler decides from it whether the next chunk
fits before the next tick. Each chunk's milliseconds are kept in `chunk_ms`.

The parallel prefill pads its last chunk to the full chunk length (the padding is computed but
written nowhere: `StreamingTransformer.forward(..., real=)`), so every chunk has one shape and
no new shape (a new kernel plan, a new allocation) ever shows up after warm-up.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def _no_sync() -> None:
    pass


class ParallelPrefill:
    """The prompt's input embeddings [P, dim] as transformer forwards of `chunk` positions.

    `run_positions(inputs [chunk, dim], real)`: the first `real` rows are prompt positions, the
    rest padding (`real` == chunk when there is none).
    """

    def __init__(
        self,
        inputs: torch.Tensor | None,
        run_positions: Callable[[torch.Tensor, int], None],
        finish: Callable[[], None],
        chunk: int,
        *,
        pad: bool = True,
        sync: Callable[[], None] = _no_sync,
    ):
        self._inputs = inputs
        self._run = run_positions
        self._finish = finish
        self._done = 0  # positions run
        self._total = 0 if inputs is None else int(inputs.shape[0])
        self._chunk = max(1, chunk)
        self._pad = pad
        self._sync = sync
        self.chunk_ms: list[float] = []

    @property
    def remaining(self) -> int:
        return -(-(self._total - self._done) // self._chunk) if self._inputs is not None else 0

    @torch.no_grad()
    def run_chunk(self) -> bool:
        started = time.perf_counter()
        if self._inputs is not None and self._done < self._total:
            end = min(self._total, self._done + self._chunk)
            piece = self._inputs[self._done : end]
            real = end - self._done
            if self._pad and real < self._chunk:
                padding = piece.new_zeros(self._chunk - real, piece.shape[1])
                piece = torch.cat([piece, padding])
            self._run(piece, real)
            self._done = end
            if end < self._total:
                self._sync()
                self.chunk_ms.append(1000 * (time.perf_counter() - started))
                return False
        self._inputs = None
        self._finish()
        self._sync()
        self.chunk_ms.append(1000 * (time.perf_counter() - started))
        return True


class StepwisePrefill:
    """The prompt replayed step by step through the tick's own code (the published behaviour),
    `chunk` generator steps at a time."""

    def __init__(
        self,
        steps: int,
        run_step: Callable[[int], None],
        finish: Callable[[], None],
        chunk: int,
        *,
        sync: Callable[[], None] = _no_sync,
    ):
        self._steps = steps
        self._run_step = run_step
        self._finish = finish
        self._next = 0
        self._chunk = max(1, chunk)
        self._sync = sync
        self.chunk_ms: list[float] = []

    @property
    def remaining(self) -> int:
        return -(-(self._steps - self._next) // self._chunk)

    @torch.no_grad()
    def run_chunk(self) -> bool:
        started = time.perf_counter()
        end = min(self._steps, self._next + self._chunk)
        for i in range(self._next, end):
            self._run_step(i)
        self._next = end
        done = end >= self._steps
        if done:
            self._finish()
        self._sync()
        self.chunk_ms.append(1000 * (time.perf_counter() - started))
        return done
