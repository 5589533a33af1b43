"""`CUDAGraphed`: replay a tensor function as one CUDA graph (in the spirit of moshi's CUDAGraphed).

It knows nothing of what it runs. The function must have static shapes, keep its state in
tensors it updates in place, and have no data-dependent Python control flow; its tensor
arguments are copied into static input buffers, and its outputs are static buffers too (read
them before the next call). The first call warms the function up on a side stream (kernel
selection, allocator growth) and captures it; every later call replays it.

`idle_args`: a function of no arguments giving inputs on which `fn` changes nothing (for the
engine's tick: an all-false `active` mask). Warm-up and capture then run on those, so they never
advance anyone's state; without it they run on the first call's real inputs.

A capture that fails (a kernel that cannot be captured) is logged and the function runs eagerly
from then on, from the same static buffers. `enabled=False` runs that eager path from the start
(CPU tests of the static-buffer path).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)
WARMUP_RUNS = 3


class CUDAGraphed:
    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        idle_args: Callable[[], tuple[torch.Tensor, ...]] | None = None,
        enabled: bool = True,
        warmup_runs: int = WARMUP_RUNS,
    ):
        self._fn = fn
        self._idle_args = idle_args
        self.enabled = enabled
        self._warmup_runs = warmup_runs
        self._inputs: tuple[torch.Tensor, ...] | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._outputs: Any = None

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def _load(self, args: tuple[torch.Tensor, ...]) -> None:
        if self._inputs is None:
            self._inputs = tuple(a.detach().clone() for a in args)
            return
        for buffer, value in zip(self._inputs, args, strict=True):
            buffer.copy_(value)

    @torch.no_grad()
    def warm(self, *args: torch.Tensor) -> None:
        """Capture now (before the first real call) with inputs shaped like `args`."""
        self._load(args)
        if self.enabled and self._graph is None:
            self._capture()

    @torch.no_grad()
    def __call__(self, *args: torch.Tensor) -> Any:
        self._load(args)
        if self.enabled and self._graph is None:
            self._capture()
            self._load(args)  # the capture ran on idle inputs: put the real ones back
        if self._graph is None:
            assert self._inputs is not None
            return self._fn(*self._inputs)
        self._graph.replay()
        return self._outputs

    def _capture(self) -> None:
        assert self._inputs is not None
        if self._idle_args is not None:
            for buffer, value in zip(self._inputs, self._idle_args(), strict=True):
                buffer.copy_(value)
        device = self._inputs[0].device
        try:
            stream = torch.cuda.Stream(device=device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(self._warmup_runs):
                    self._fn(*self._inputs)
            torch.cuda.current_stream(device).wait_stream(stream)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread (a voice being encoded for `prepare`) may use the GPU.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self._outputs = self._fn(*self._inputs)
            self._graph = graph
        except RuntimeError as exc:
            log.warning("CUDA graph capture failed (%s); running eagerly", exc)
            self._graph = None
            self._outputs = None
            self.enabled = False
            torch.cuda.synchronize(device)
