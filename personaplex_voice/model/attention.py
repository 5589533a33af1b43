"""Which scaled-dot-product-attention kernel runs, chosen by measurement and pinned.

torch picks an SDPA backend per call from what is legal for the shapes, dtype and mask; on a
Hopper GPU with a boolean mask that may be cuDNN attention, whose per-shape plan is built on the
host the first time a shape is seen. The engine measures the legal backends at the shapes it
runs (`time_backends`), keeps the fastest that agrees with the math backend, and pins it for that
phase (`sdpa_context`) around the temporal transformer, so the choice is a measured fact, not a
default that changes with the torch version.

`sdpa_context` uses `torch.nn.attention.sdpa_kernel` where it exists (torch >= 2.3) and the
older `torch.backends.cuda` flags otherwise. Backend names: "flash", "efficient", "cudnn",
"math".
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn import functional as F

BACKENDS = ("cudnn", "flash", "efficient", "math")
_ENUM_NAMES = {
    "cudnn": "CUDNN_ATTENTION",
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}
_LEGACY_FLAGS = {  # torch.backends.cuda.enable_<x>_sdp / <x>_sdp_enabled
    "cudnn": "cudnn",
    "flash": "flash",
    "efficient": "mem_efficient",
    "math": "math",
}
# A backend whose output is further than this from the math backend's (relative to the output's
# scale) is not pinned, however fast: bfloat16 attention agrees to a few 1e-3.
AGREEMENT_TOLERANCE = 2e-2


def available_backends() -> list[str]:
    """The backend names this torch knows (whether a shape is legal is found by running it)."""
    try:
        from torch.nn.attention import SDPBackend
    except ImportError:
        return [b for b in BACKENDS if hasattr(torch.backends.cuda, f"enable_{_LEGACY_FLAGS[b]}_sdp")]
    return [b for b in BACKENDS if hasattr(SDPBackend, _ENUM_NAMES[b])]


def sdpa_context(backends: Sequence[str] | None) -> contextlib.AbstractContextManager[Any]:
    """Only these SDPA backends inside the context (None or empty: torch's own choice)."""
    if not backends:
        return contextlib.nullcontext()
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return _legacy_context(backends)
    return sdpa_kernel([getattr(SDPBackend, _ENUM_NAMES[b]) for b in backends])


@contextlib.contextmanager
def _legacy_context(backends: Sequence[str]) -> Iterator[None]:
    cuda = torch.backends.cuda
    saved = {}
    for name, flag in _LEGACY_FLAGS.items():
        getter = getattr(cuda, f"{flag}_sdp_enabled", None)
        setter = getattr(cuda, f"enable_{flag}_sdp", None)
        if getter is None or setter is None:
            continue
        saved[setter] = getter()
        setter(name in backends)
    try:
        yield
    finally:
        for setter, value in saved.items():
            setter(value)


@dataclass
class BackendTiming:
    """One phase's measurement: ms per call of each backend (or why it could not run)."""

    shape: dict[str, list[int]]
    ms: dict[str, float] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    max_rel_error: dict[str, float] = field(default_factory=dict)
    default_ms: float | None = None  # torch's own choice, nothing pinned

    @property
    def winner(self) -> str | None:
        good = {b: ms for b, ms in self.ms.items() if self.max_rel_error.get(b, 0.0) <= AGREEMENT_TOLERANCE}
        return min(good, key=good.__getitem__) if good else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "shape": self.shape,
            "ms": self.ms,
            "default_ms": self.default_ms,
            "refused": self.refused,
            "max_rel_error": self.max_rel_error,
            "winner": self.winner,
        }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Any, device: torch.device, reps: int) -> float:
    fn()  # plan / compile / allocate outside the timing
    fn()
    _sync(device)
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return 1000 * (time.perf_counter() - started) / reps


@torch.no_grad()
def time_backends(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    backends: Sequence[str] | None = None,
    reps: int = 10,
) -> BackendTiming:
    """Time `F.scaled_dot_product_attention(q, k, v, mask)` under each backend alone.

    A backend torch refuses for these shapes (no kernel, a mask it cannot take) is recorded in
    `refused`; each one that runs is checked against the math backend.
    """
    device = q.device
    timing = BackendTiming(shape={"q": list(q.shape), "kv": list(k.shape)})
    if mask is not None:
        timing.shape["mask"] = list(mask.shape)
    with sdpa_context(["math"]):
        reference = F.scaled_dot_product_attention(q, k, v, mask).float()
    scale = float(reference.abs().max()) or 1.0
    timing.default_ms = round(_time(lambda: F.scaled_dot_product_attention(q, k, v, mask), device, reps), 4)
    for backend in backends or available_backends():
        try:
            with sdpa_context([backend]):
                out = F.scaled_dot_product_attention(q, k, v, mask)
                ms = _time(lambda: F.scaled_dot_product_attention(q, k, v, mask), device, reps)
        except Exception as exc:  # "No available kernel", unsupported mask, ...
            timing.refused[backend] = " ".join(str(exc).split())[:160]
            continue
        timing.ms[backend] = round(ms, 4)
        error = (out.float() - reference).abs().max()
        timing.max_rel_error[backend] = float("inf") if not torch.isfinite(error) else float(error) / scale
    return timing
