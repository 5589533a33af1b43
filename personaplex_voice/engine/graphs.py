"""CUDA-graph capture of the engine's batched tick.

The tick (`PersonaPlexEngine._step_tensors`) has static shapes (fixed slot count, fixed ring and
cache sizes), keeps all its state in tensors updated in place, and has no data-dependent Python
control flow: which slots run is a tensor mask, sampling settings are per-slot tensors and the
random noise is drawn per slot before the replay. So it is captured once and replayed every tick.

Capture safety: the warm-up runs and the capture use an all-false `active` mask, and the exec
mask guarantees that no slot's state is modified by them. Starting, restoring and releasing
slots happen outside the graph and write the same tensors in place, so the graph always sees
the current state.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from personaplex_voice.engine.base import FRAME_SIZE

if TYPE_CHECKING:
    from personaplex_voice.engine.generator import PersonaPlexEngine

log = logging.getLogger(__name__)
WARMUP_RUNS = 3


class GraphedStep:
    """Runs the engine's tick from static input/output buffers, replayed as one CUDA graph.

    `use_cuda_graph=False` runs the very same static-buffer path eagerly (CPU tests).
    """

    def __init__(self, engine: PersonaPlexEngine, use_cuda_graph: bool = True):
        self.engine = engine
        self.use_cuda_graph = use_cuda_graph
        device = engine.device
        B = engine.num_slots
        self.pcm_in = torch.zeros(B, FRAME_SIZE, device=device)
        self.active = torch.zeros(B, dtype=torch.bool, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None
        self.pcm_out: torch.Tensor | None = None
        # The captured graph always contains the sampling math (greedy slots select the argmax).
        engine.sampler.always_full = True

    @torch.no_grad()
    def capture(self) -> None:
        engine = self.engine
        self.active.zero_()
        stream = torch.cuda.Stream(device=engine.device)
        stream.wait_stream(torch.cuda.current_stream(engine.device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                engine._step_tensors(engine._full, self.pcm_in, self.active, True)
        torch.cuda.current_stream(engine.device).wait_stream(stream)
        torch.cuda.synchronize(engine.device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: prepare() may encode a voice on the GPU from a worker thread meanwhile.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.out, self.pcm_out = engine._step_tensors(engine._full, self.pcm_in, self.active, True)
        self.graph = graph

    @torch.no_grad()
    def run(self, pcm: np.ndarray, active: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        self.pcm_in.copy_(torch.from_numpy(pcm))
        self.active.copy_(torch.from_numpy(np.asarray(active, dtype=bool)))
        if not self.use_cuda_graph:
            return self.engine._step_tensors(self.engine._full, self.pcm_in, self.active, True)
        if self.graph is None:
            try:
                self.capture()
            except RuntimeError as exc:  # a kernel that cannot be captured: keep serving, eagerly
                log.warning("CUDA graph capture failed (%s); running the tick eagerly", exc)
                self.graph = None
                self.use_cuda_graph = False
                torch.cuda.synchronize(self.engine.device)
                return self.engine._step_tensors(self.engine._full, self.pcm_in, self.active, True)
            self.active.copy_(torch.from_numpy(np.asarray(active, dtype=bool)))
        assert self.graph is not None and self.out is not None and self.pcm_out is not None
        self.graph.replay()
        return self.out, self.pcm_out
