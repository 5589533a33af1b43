"""`--cpu-offload`: plan for the card, load the model that way, and say at warm-up whether the
card keeps real time (the plan: engine/offload_plan.py; the streaming: model/offload.py).

On a CUDA device `OffloadedModel.load` asks the card for its free memory, plans (int8 weights,
an fp8 KV cache, then streamed layers, as few as fit the calls), and loads accordingly: the
plain loader straight onto the GPU when nothing is streamed, else the LM in host memory first,
the streamed layers' weights pinned there and everything else moved to the GPU. A card that
cannot hold the calls even with every layer streamed stops the server with one line naming the
number it can hold. After the engine's warm-up, `report_realtime` times full ticks (every slot
computed, no state changed) and the host-to-GPU copies alone, and logs whether a tick fits in
the 80 ms frame at this many calls, or, when it does not, how many calls the plan suggests.
On the CPU `--cpu-offload` changes nothing (the weights already live in host memory); the
factory says so in one line.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from personaplex_voice.engine.offload_plan import (
    FRAME_MS,
    GIB,
    OffloadPlan,
    OffloadSizes,
    plan_offload,
    realtime_calls,
)
from personaplex_voice.errors import UserError
from personaplex_voice.model.config import ModelConfig
from personaplex_voice.model.lm import LMModel
from personaplex_voice.model.loaders import LoadStats, load_models
from personaplex_voice.model.offload import LayerStreamer, offload_layers
from personaplex_voice.model.quant import quantizable_weights
from personaplex_voice.model.sizes import RESERVE_GIB, memory_plan

if TYPE_CHECKING:
    from personaplex_voice.model.mimi import Mimi
    from personaplex_voice.model.sources import ModelFiles

log = logging.getLogger("personaplex_voice.offload")

CPU_NOTICE = "--cpu-offload does nothing on the CPU: the weights already live in host memory"
MEASURE_TICKS = 8
KV_DTYPES = {
    "float8": torch.float8_e4m3fn,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


def kv_name(kv_dtype: Any) -> str | None:
    """A torch KV dtype (or None) as the planner names it."""
    for name, dtype in KV_DTYPES.items():
        if kv_dtype == dtype:
            return name
    return None


__all__ = ["CPU_NOTICE", "OffloadedModel", "offload_sizes"]


def offload_sizes(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> OffloadSizes:
    """The byte counts `plan_offload` needs, from the tensors the code creates (meta device)."""
    with torch.device("meta"):
        lm = LMModel(cfg.lm).to(dtype)
    quantized = set(quantizable_weights(lm))
    element = torch.empty(0, dtype=dtype).element_size()
    layer = {"bfloat16": 0, "int8": 0}
    for name, tensor in lm.state_dict().items():
        if name.startswith("transformer.layers.0."):
            layer["bfloat16"] += tensor.numel() * element
            int8 = tensor.numel() + tensor.shape[0] * 2 if name in quantized else tensor.numel() * element
            layer["int8"] += int8
    L = cfg.lm.num_layers
    other, per_call = {}, {}
    for mode, quantize in (("bfloat16", None), ("int8", "int8")):
        other[mode] = (
            memory_plan(cfg, dtype, quantize=quantize, persona_cache_gib=0).weights - L * layer[mode]
        )
    per_call["auto"] = memory_plan(cfg, dtype).per_call
    per_call["float8"] = memory_plan(cfg, dtype, kv_dtype=torch.float8_e4m3fn).per_call
    return OffloadSizes(num_layers=L, layer_bytes=layer, other_bytes=other, per_call_bytes=per_call)


def need_one_call(plan: OffloadPlan, sizes: OffloadSizes) -> int:
    """GPU bytes of `plan` with one call instead of its own count."""
    per_call = sizes.per_call_bytes["float8" if plan.kv_dtype == "float8" else "auto"]
    return plan.gpu_bytes - (plan.calls - 1) * per_call


@dataclass
class OffloadedModel:
    """The loaded modules and what was planned for them; the engine keeps it as `engine.offload`."""

    mimi: Mimi
    lm: LMModel
    plan: OffloadPlan
    streamer: LayerStreamer | None
    stats: LoadStats
    sizes: OffloadSizes
    fixed_bytes: int

    @property
    def kv_dtype(self) -> torch.dtype | None:
        return KV_DTYPES.get(self.plan.kv_dtype) if self.plan.kv_dtype else None

    @classmethod
    def load(
        cls,
        files: ModelFiles,
        device: str | torch.device,
        dtype: torch.dtype | None,
        *,
        num_slots: int,
        quantize: str | None = None,
        kv_dtype: Any = None,
        persona_cache_bytes: int = GIB,
        free_bytes: int | None = None,
    ) -> OffloadedModel:
        device = torch.device(device)
        if free_bytes is None:
            free_bytes = torch.cuda.mem_get_info(device)[0]
        sizes = offload_sizes(files.config)
        fixed = int(RESERVE_GIB * GIB) + persona_cache_bytes
        plan = plan_offload(
            free_bytes, sizes, num_slots, fixed_bytes=fixed, quantize=quantize, kv_dtype=kv_name(kv_dtype)
        )
        log.info("--cpu-offload plan: %s (%s)", plan.describe(), "; ".join(plan.steps))
        if not plan.fits:
            card = f"--cpu-offload: this card ({free_bytes / GIB:.1f} GiB free)"
            if plan.max_calls >= 1:
                raise UserError(
                    f"{card} holds at most {plan.max_calls} call(s) of this model even with all "
                    f"{sizes.num_layers} layers in host memory: use --max-sessions {plan.max_calls} "
                    "(or a lower --persona-cache-mb)"
                )
            raise UserError(
                f"{card} cannot hold this model even with every layer in host memory "
                f"({need_one_call(plan, sizes) / GIB:.1f} GiB needed for one call)"
            )
        dtype = dtype or torch.bfloat16
        if not plan.streams:
            mimi, lm, stats = load_models(files, device, dtype, quantize=plan.quantize)
            return cls(mimi, lm, plan, None, stats, sizes, fixed)
        started = time.perf_counter()
        mimi, lm, stats = load_models(files, "cpu", dtype, quantize=plan.quantize)
        mimi = mimi.to(device)
        mimi.refresh()
        streamer = offload_layers(lm, plan.offloaded, device)
        stats.seconds = time.perf_counter() - started  # the load and the placing
        log.info(
            "--cpu-offload: %d of %d layers in pinned host memory (%.2f GiB), %.1f s to load and place",
            len(plan.offloaded),
            sizes.num_layers,
            plan.host_bytes / GIB,
            stats.seconds,
        )
        return cls(mimi, lm, plan, streamer, stats, sizes, fixed)

    def report_realtime(self, engine: Any) -> dict[str, float]:
        """After the warm-up: time full ticks with this plan and log whether real time holds."""
        device = torch.device(engine.device)
        if device.type != "cuda":
            return {}
        pcm, active = engine._idle_inputs()  # every slot computed, no slot's state changed

        def tick() -> None:
            if engine._graphed is not None:
                engine._graphed(pcm, active)
            else:
                engine._step_tensors(engine._full, pcm, active, True)

        tick()
        torch.cuda.synchronize(device)
        times = []
        for _ in range(MEASURE_TICKS):
            started = time.perf_counter()
            tick()
            torch.cuda.synchronize(device)
            times.append((time.perf_counter() - started) * 1000)
        tick_ms = sorted(times)[len(times) // 2]
        copy_ms = self.streamer.copy_all_ms() if self.streamer is not None else 0.0
        calls = engine.num_slots
        streamed = len(self.plan.offloaded)
        measured = {"tick_ms": round(tick_ms, 2), "copy_ms": round(copy_ms, 2), "calls": calls}
        if tick_ms <= FRAME_MS:
            log.info(
                "--cpu-offload: real time holds with %d call(s): a tick takes %.1f ms of the %.0f ms frame "
                "(%d layers streamed, their copies %.1f ms)",
                calls,
                tick_ms,
                FRAME_MS,
                streamed,
                copy_ms,
            )
            return measured
        link_gb_s = (self.plan.transfer_bytes / 1e9) / (copy_ms / 1000) if copy_ms > 0 else None
        suggestion = 0
        if link_gb_s:
            suggestion = realtime_calls(
                self.plan.free_bytes,
                self.sizes,
                calls,
                fixed_bytes=self.fixed_bytes,
                quantize=self.plan.quantize,
                kv_dtype=self.plan.kv_dtype,
                link_gb_s=link_gb_s,
            )
        log.warning(
            "--cpu-offload: this card cannot keep real time with %d call(s): a tick takes %.1f ms, over "
            "the %.0f ms frame (%d layers streamed, their copies alone %.1f ms): callers would hear "
            "choppy audio. %s",
            calls,
            tick_ms,
            FRAME_MS,
            streamed,
            copy_ms,
            f"Streaming less would fit: try --max-sessions {suggestion}."
            if 0 < suggestion < calls
            else "A larger card (or more int8/fp8 headroom) is needed.",
        )
        return measured
