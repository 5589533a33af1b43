"""What the engine measures and checks on a GPU before its first caller (part of `warmup`).

- Attention: the SDPA backends are timed at the temporal transformer's two shapes (one query
  per slot against the whole ring: the tick; a prefill chunk against one slot's ring), on the
  engine's own KV cache, and the fastest that agrees with the math backend is pinned per phase
  (`StreamingTransformer.sdpa_decode` / `sdpa_prefill`). `attention="default"` leaves torch's
  choice; a backend name pins that one.
- fp8 KV cache: the Triton kernel that reads e4m3 directly (`model/fp8_attention.py`) is
  checked once on random data of the engine's shape against the converting path; it is used
  only if it runs and agrees, else the converting path stays and the reason is logged.

Nothing here runs on a CPU (there the defaults are exact and nothing is pinned). `report` keeps
what was measured, for logs and bench/gpu_check.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from personaplex_voice.model import fp8_attention
from personaplex_voice.model.attention import BACKENDS, time_backends
from personaplex_voice.model.lm import LMModel
from personaplex_voice.model.streaming import StreamState

log = logging.getLogger(__name__)

ATTENTION_MODES = ("auto", "default", *BACKENDS)
KV_READ_MODES = ("auto", "convert")
# Slots the fp8 kernel's self-check runs with (the kernel's compiled shape does not depend on it).
SELF_CHECK_SLOTS = 4


@dataclass
class GpuTuning:
    attention: str = "auto"
    kv_read: str = "auto"
    report: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_MODES)}, got {self.attention!r}")
        if self.kv_read not in KV_READ_MODES:
            raise ValueError(f"kv_read must be one of {', '.join(KV_READ_MODES)}, got {self.kv_read!r}")

    @torch.no_grad()
    def apply(self, lm: LMModel, state: StreamState, prefill_chunk: int) -> dict[str, Any]:
        """Check the fp8 kernel, then pin attention (both only on CUDA); returns `report`."""
        device = lm.text_emb.weight.device
        if device.type != "cuda":
            self.report = {"kv_read": _kv_read_name(lm, state), "sdpa_decode": None, "sdpa_prefill": None}
            return self.report
        self.report["kv_read"] = self._fp8_decode(lm, state, device)
        self._pin(lm, state, device, prefill_chunk)
        return self.report

    def unpin(self, lm: LMModel) -> bool:
        """Drop the attention pins (a capture failed with them); False if there were none."""
        transformer = lm.transformer
        if transformer.sdpa_decode is None and transformer.sdpa_prefill is None:
            return False
        transformer.sdpa_decode = transformer.sdpa_prefill = None
        self.report["sdpa_unpinned"] = "capture failed with the pinned backends"
        self.report.update(sdpa_decode=None, sdpa_prefill=None)
        return True

    def _fp8_decode(self, lm: LMModel, state: StreamState, device: torch.device) -> str:
        k0 = _layer_cache(state, "k")
        if k0.dtype.itemsize != 1:
            return "direct"  # the cache is in the compute dtype: nothing converted
        layers = [layer.self_attn for layer in lm.transformer.layers]
        if self.kv_read == "convert":
            return "convert (asked for)"
        if not fp8_attention.available(device):
            return "convert (Triton is not available here)"
        _, heads, entries, head_dim = k0.shape
        try:
            error = fp8_attention.self_check(SELF_CHECK_SLOTS, heads, entries, head_dim, device, lm.dtype)
        except Exception as exc:
            reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
            log.warning("fp8 KV cache: the Triton kernel failed (%s); converting the cache per layer", reason)
            return f"convert (kernel failed: {reason})"
        self.report["fp8_kernel_rel_error"] = error
        if error > fp8_attention.SELF_CHECK_TOLERANCE:
            log.warning("fp8 KV cache: the Triton kernel is off by %.3g; converting per layer", error)
            return f"convert (kernel off by {error:.3g})"
        for attn in layers:
            attn.fp8_decode = fp8_attention.decode_attention
        return "triton fp8"

    def _pin(self, lm: LMModel, state: StreamState, device: torch.device, chunk: int) -> None:
        transformer = lm.transformer
        if self.attention == "default":
            self.report.update(sdpa_decode=None, sdpa_prefill=None)
            return
        if self.attention != "auto":
            transformer.sdpa_decode = transformer.sdpa_prefill = (self.attention,)
            self.report.update(sdpa_decode=self.attention, sdpa_prefill=self.attention)
            return
        k0, v0 = _layer_cache(state, "k"), _layer_cache(state, "v")
        dtype = lm.dtype
        B, H, N, D = k0.shape
        gen = torch.Generator(device="cpu").manual_seed(0)
        phases: dict[str, Any] = {}
        if getattr(transformer.layers[0].self_attn, "fp8_decode", None) is None:
            mask = torch.ones(B, 1, 1, N, dtype=torch.bool, device=device)
            mask[..., 0] = False  # the ring's masked oldest entry
            q = torch.randn(B, H, 1, D, generator=gen).to(device, dtype)
            # an fp8 cache is read as its converted copy, one layer at a time, as the tick does
            phases["decode"] = time_backends(q, k0.to(dtype), v0.to(dtype), mask)
            del mask, q
        k1, v1 = k0[:1].to(dtype), v0[:1].to(dtype)  # one slot's ring (a prefill)
        T = min(chunk, N)
        q = torch.randn(1, H, T, D, generator=gen).to(device, dtype)
        causal = torch.ones(1, 1, T, N, dtype=torch.bool, device=device).tril(diagonal=N - T)
        phases["prefill"] = time_backends(q, k1, v1, causal)
        for phase, timing in phases.items():
            winner = timing.winner
            setattr(transformer, f"sdpa_{phase}", (winner,) if winner else None)
            self.report[f"sdpa_{phase}"] = winner
            self.report[f"sdpa_{phase}_timing"] = timing.as_dict()
            pinned = winner or "torch's choice"
            log.info("attention (%s): %s pinned; ms per call %s", phase, pinned, timing.ms)
        if "decode" not in phases:
            self.report["sdpa_decode"] = "triton fp8 kernel"


def _layer_cache(state: StreamState, name: str) -> torch.Tensor:
    return state[f"transformer.layers.0.self_attn:{name}"]


def _kv_read_name(lm: LMModel, state: StreamState) -> str:
    return "convert" if _layer_cache(state, "k").dtype != lm.dtype else "direct"
