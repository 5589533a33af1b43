"""What the engine measures and checks on a GPU before its first caller (part of `warmup`).

- Fused kernels (`model/fused_ops.py`: the norms with their residual sums, silu-gating, RoPE
  with the KV write, the length-aware decode attention, the depth transformer's step
  attention): each is run once on random data of the engine's shapes against its reference and
  used only if it runs and agrees; the others keep their reference (a `fallbacks` entry says
  which and why). The decode attention kernel reads only the filled entries of active slots'
  rings, from a bfloat16 or an fp8 cache alike (`kv_read` says what reads the cache).
- int8 weights: whether `torch._int_mm` runs and agrees here (`model/quant.py`); if not, the
  dequantising matmul runs, and a `fallbacks` entry says why.
- Attention: the SDPA backends are timed at the shapes SDPA still runs (the prefill chunk over
  one slot's ring; the tick's one-query attention too when the decode kernel is not used), on
  the engine's own KV cache, and the fastest that agrees with the math backend is pinned per
  phase (`StreamingTransformer.sdpa_decode` / `sdpa_prefill`). `attention="default"` leaves
  torch's choice; a backend name pins that one; no agreeing backend leaves torch's choice (a
  `fallbacks` entry).

`reset` puts a model back to the references and torch's choice: every engine starts there, so a
model shared by several engines (bench/gpu_check.py) never carries one engine's kernels into the
next one's report. Nothing is measured on a CPU (there the references are exact and nothing is
pinned). `report` keeps what was measured and what runs, `fallbacks` every fallback with its
reason, for logs and bench/gpu_check.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from personaplex_voice.model import fused_checks, fused_ops, triton_kernels
from personaplex_voice.model.attention import BACKENDS, time_backends
from personaplex_voice.model.lm import LMModel
from personaplex_voice.model.quant import Int8Weight, int_mm_failure, int_mm_usable
from personaplex_voice.model.streaming import StreamState

log = logging.getLogger(__name__)

ATTENTION_MODES = ("auto", "default", *BACKENDS)
# "auto": the length-aware kernel where it checks out; "convert": always SDPA over the whole
# ring (an fp8 cache converted to the compute dtype per layer first).
KV_READ_MODES = ("auto", "convert")
FUSED_MODES = ("auto", "off")


@dataclass
class GpuTuning:
    attention: str = "auto"
    kv_read: str = "auto"
    fused: str = "auto"
    report: dict[str, Any] = field(default_factory=dict)
    fallbacks: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_MODES)}, got {self.attention!r}")
        if self.kv_read not in KV_READ_MODES:
            raise ValueError(f"kv_read must be one of {', '.join(KV_READ_MODES)}, got {self.kv_read!r}")
        if self.fused not in FUSED_MODES:
            raise ValueError(f"fused must be one of {', '.join(FUSED_MODES)}, got {self.fused!r}")

    @staticmethod
    def reset(lm: LMModel, mimi: nn.Module | None = None) -> None:
        """The references everywhere and torch's own SDPA choice (what an engine starts with)."""
        fused_ops.clear_fused_ops(lm)
        if mimi is not None:
            fused_ops.clear_fused_ops(mimi)
        lm.transformer.sdpa_decode = lm.transformer.sdpa_prefill = None

    @torch.no_grad()
    def apply(
        self, lm: LMModel, state: StreamState, prefill_chunk: int, mimi: nn.Module | None = None
    ) -> dict[str, Any]:
        """Check the kernels, then pin attention (both only on CUDA); returns `report`. Mimi
        (float32) gets the fused ops that passed, but its attention stays SDPA (two positions a
        tick, not one)."""
        fused_ops.clear_fused_ops(lm)
        if mimi is not None:
            fused_ops.clear_fused_ops(mimi)
        self.report, self.fallbacks = {}, []
        device = lm.text_emb.weight.device
        if device.type != "cuda":
            self.report = {
                "kv_read": _kv_read_name(lm, state),
                "fused_ops": [],
                "sdpa_decode": None,
                "sdpa_prefill": None,
            }
            return self.report
        self._int8(lm, device)
        self._fused(lm, state, device)
        if mimi is not None:
            used = fused_ops.fused_ops_in_use(lm)
            fused_ops.set_fused_ops(mimi, [op for op in used if op != "ring_attention"])
        self.report["kv_read"] = _kv_read_name(lm, state)
        self.report["fused_ops"] = fused_ops.fused_ops_in_use(lm)
        self._pin(lm, state, device, prefill_chunk)
        return self.report

    def fallback(self, what: str, reason: str) -> None:
        reason = " ".join(reason.split())[:300]
        self.fallbacks.append({"what": what, "reason": reason})
        log.warning("%s: %s", what, reason)

    def unpin(self, lm: LMModel) -> bool:
        """Drop the attention pins (a capture failed with them); False if there were none."""
        transformer = lm.transformer
        if transformer.sdpa_decode is None and transformer.sdpa_prefill is None:
            return False
        transformer.sdpa_decode = transformer.sdpa_prefill = None
        self.report["sdpa_unpinned"] = "capture failed with the pinned backends"
        self.report.update(sdpa_decode=None, sdpa_prefill=None)
        self.fallback(
            "attention pin", "CUDA graph capture failed with the pinned SDPA backends: torch's choice"
        )
        return True

    def _int8(self, lm: LMModel, device: torch.device) -> None:
        if not any(isinstance(m, Int8Weight) for m in lm.modules()):
            return
        usable = int_mm_usable(device)
        self.report["int8_matmul"] = "torch._int_mm" if usable else "dequantise"
        if not usable:
            self.fallback("int8 matmul (torch._int_mm)", f"{int_mm_failure(device)}; dequantising instead")

    def _fused(self, lm: LMModel, state: StreamState, device: torch.device) -> None:
        wanted = list(fused_ops.FUSED_OPS) if self.fused == "auto" else []
        if self.kv_read == "convert" and "ring_attention" in wanted:
            wanted.remove("ring_attention")
            self.report["ring_attention"] = "off (kv_read='convert' asked for)"
        if not wanted:
            return
        if not triton_kernels.available(device):
            self.fallback(f"fused kernels ({', '.join(wanted)})", "Triton is not available here")
            return
        k0 = _layer_cache(state, "k")
        _, heads, entries, head_dim = k0.shape
        shapes = {
            "dim": lm.cfg.dim,
            "hidden": lm.transformer.layers[0].gating.linear_out.in_features
            if lm.transformer.layers[0].gating is not None
            else 64,
            "heads": heads,
            "head_dim": head_dim,
            "entries": entries - 1,  # the ring without its spare entry
            "kv_dtype": k0.dtype,
            "steps": lm.depformer.steps,
            "step_heads": lm.depformer.num_heads,
            "step_head_dim": lm.depformer.dim // lm.depformer.num_heads,
        }
        passed = []
        errors: dict[str, float] = {}
        for op in wanted:
            try:
                error = fused_checks.self_check(op, device, lm.dtype, shapes)
            except Exception as exc:
                self.fallback(f"fused {op}", f"the kernel failed: {type(exc).__name__}: {exc}")
                continue
            errors[op] = error
            if error > fused_checks.SELF_CHECK_TOLERANCE:
                self.fallback(f"fused {op}", f"the kernel is off by {error:.3g} of its reference")
                continue
            passed.append(op)
        self.report["fused_rel_error"] = errors
        fused_ops.set_fused_ops(lm, passed)

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
        N -= 1  # the spare entry is never read
        k0, v0 = k0[:, :, :N], v0[:, :, :N]
        gen = torch.Generator(device="cpu").manual_seed(0)
        phases: dict[str, Any] = {}
        if not transformer.layers[0].self_attn.ring_kernel:
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
            if winner is None:
                why = "; ".join(f"{b}: {r}" for b, r in timing.refused.items()) or "none agreed with math"
                self.fallback(f"attention pin ({phase})", f"no SDPA backend to pin ({why}): torch's choice")
            pinned = winner or "torch's choice"
            log.info("attention (%s): %s pinned; ms per call %s", phase, pinned, timing.ms)
        if "decode" not in phases:
            self.report["sdpa_decode"] = "length-aware ring kernel"


def _layer_cache(state: StreamState, name: str) -> torch.Tensor:
    return state[f"transformer.layers.0.self_attn:{name}"]


def _kv_read_name(lm: LMModel, state: StreamState) -> str:
    """What reads the temporal transformer's KV cache in the tick, as it is set now."""
    cache = _layer_cache(state, "k").dtype
    kind = "fp8" if cache.itemsize == 1 else str(cache).removeprefix("torch.")
    if lm.transformer.layers[0].self_attn.ring_kernel:
        return f"length-aware kernel ({kind}): filled entries of active slots only"
    if lm.text_emb.weight.device.type == "cpu":
        read = "filled prefix (CPU SDPA)"
    else:
        read = "whole ring (SDPA)"
    return f"{read}, {kind} converted per layer" if cache != lm.dtype else f"{read}, {kind}"
