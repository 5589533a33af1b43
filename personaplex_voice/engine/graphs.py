"""`CUDAGraphed`: replay a tensor function as one CUDA graph (in the spirit of moshi's CUDAGraphed).

It knows nothing of what it runs. The function must have static shapes, keep its state in
tensors it updates in place, and have no data-dependent Python control flow; its tensor
arguments are copied into static input buffers, and its outputs are static buffers too (read
them before the next call).

Capture follows what vLLM and SGLang do: one dedicated stream, the function warmed up on that
stream first (kernel selection, lazy initialisation, allocator growth happen there, not inside
the capture), then captured on the same stream into a private memory pool, whose size is
measured and kept in `info`. The first call (or `warm`) captures; every later call replays.

`idle_args`: a function of no arguments giving inputs on which `fn` changes nothing (for the
engine's tick: an all-false `active` mask). Warm-up and capture then run on those, so they never
advance anyone's state; without it they run on the first call's real inputs.

A capture that fails raises `GraphCaptureError` (one line: why), never a silent eager fallback:
eager replay of a whole tick costs tens of milliseconds of launches, so whoever asked for graphs
must hear it. `enabled=False` runs the same static-buffer path eagerly from the start (the
explicit choice, and CPU tests). The CUDA calls go through a `GraphBackend`, so tests can inject
one that records or fails on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)
WARMUP_RUNS = 3
MIB = 2**20


class GraphCaptureError(RuntimeError):
    """The CUDA graph could not be captured; the message is one line saying why."""


class GraphBackend(Protocol):
    """The CUDA primitives a capture needs (torch.cuda by default; fakes in CPU tests)."""

    def new_stream(self, device: torch.device) -> Any:
        """A stream of its own, ordered after the work already queued on the current one."""

    def on_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]: ...

    def synchronize(self, device: torch.device) -> None: ...

    def new_pool(self) -> Any: ...

    def new_graph(self) -> Any: ...

    def capture(self, graph: Any, pool: Any, stream: Any, run: Callable[[], Any]) -> Any:
        """Record `run()` into `graph` (on `stream`, allocating from `pool`); returns its outputs,
        which every `graph.replay()` refreshes in place."""

    def reserved_bytes(self, device: torch.device) -> int: ...


class TorchCudaBackend:
    """The real thing: torch.cuda streams, graphs and memory pools."""

    def new_stream(self, device: torch.device) -> Any:
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        return stream

    def on_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def new_graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    def capture(self, graph: Any, pool: Any, stream: Any, run: Callable[[], Any]) -> Any:
        # thread_local: another thread (a voice being encoded for `prepare`) may use the GPU.
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            return run()

    def reserved_bytes(self, device: torch.device) -> int:
        return int(torch.cuda.memory_reserved(device))


@dataclass
class CaptureInfo:
    """What a capture did: whether it happened, how long it took, what its pool holds."""

    captured: bool = False
    capture_s: float | None = None
    pool_mib: float | None = None  # memory reserved by the capture (its private pool)
    warmup_runs: int = 0
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "captured": self.captured,
            "capture_s": self.capture_s,
            "pool_mib": self.pool_mib,
            "warmup_runs": self.warmup_runs,
            "error": self.error,
        }


class CUDAGraphed:
    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        idle_args: Callable[[], tuple[torch.Tensor, ...]] | None = None,
        enabled: bool = True,
        warmup_runs: int = WARMUP_RUNS,
        backend: GraphBackend | None = None,
        pool_of: CUDAGraphed | None = None,
    ):
        self._fn = fn
        # another graph whose memory pool this one shares (they never replay at the same time)
        self._pool_of = pool_of
        self._idle_args = idle_args
        self.enabled = enabled
        self._warmup_runs = warmup_runs
        self._backend: GraphBackend = backend or TorchCudaBackend()
        self._inputs: tuple[torch.Tensor, ...] | None = None
        self._graph: Any = None
        self._pool: Any = None
        self._outputs: Any = None
        self.info = CaptureInfo()

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
        backend = self._backend
        started = time.perf_counter()
        try:
            backend.synchronize(device)
            before = backend.reserved_bytes(device)
            stream = backend.new_stream(device)
            with backend.on_stream(stream):
                for _ in range(self._warmup_runs):
                    self._fn(*self._inputs)
                    self.info.warmup_runs += 1
            backend.synchronize(device)
            shared = self._pool_of._pool if self._pool_of is not None else None
            self._pool = shared if shared is not None else backend.new_pool()
            graph = backend.new_graph()
            inputs = self._inputs
            outputs = backend.capture(graph, self._pool, stream, lambda: self._fn(*inputs))
            backend.synchronize(device)
        except Exception as exc:  # a kernel that cannot be captured, out of memory, ...
            self._graph = self._outputs = self._pool = None
            with contextlib.suppress(Exception):
                backend.synchronize(device)
            reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
            self.info.error = reason
            raise GraphCaptureError(f"CUDA graph capture failed ({reason})") from exc
        self._graph, self._outputs = graph, outputs
        self.info.captured = True
        self.info.capture_s = round(time.perf_counter() - started, 3)
        self.info.pool_mib = round(max(0, backend.reserved_bytes(device) - before) / MIB, 1)
        log.info(
            "CUDA graph captured in %.2f s after %d warm-up runs on its own stream; private pool %.0f MiB",
            self.info.capture_s,
            self.info.warmup_runs,
            self.info.pool_mib,
        )
