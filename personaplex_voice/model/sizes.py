"""How much GPU memory a model takes, and how many calls fit on a GPU, from the code's own sizes.

Nothing is allocated: the modules and the per-slot state are built on the `meta` device, so the
numbers are the byte counts of exactly the tensors the engine creates.

- weights: the LM (in its dtype, or int8 linear weights plus a scale per row) and Mimi (float32);
- per call (one batch slot): the LM's KV cache and positions, Mimi's streaming state, the token
  ring and the sampler's noise buffers; with a KV cache narrower than the compute dtype (fp8),
  also its share of the one-layer workspace the cache is read back into;
- fixed: the persona cache (`--persona-cache-mb`, kept on the device) and a reserve for the CUDA
  context, cuBLAS workspaces and allocator slack (`RESERVE_GIB`, an estimate: bench/gpu_check.sh
  measures the real peak).

`tick_traffic` counts the bytes one tick moves through GPU memory, which bounds its time from
below on a memory-bound decode: every linear weight read once (the depth transformer's steps
each read their own) and, per layer, the filled entries of every active slot's KV ring (the
length-aware decode attention, `model/ring_attention.py`; an fp8 cache read directly) beside
what the static tick read before (every slot's whole ring, filled or not, active or not), and
Mimi's transformer rings (float32, read whole). For int8 weights it gives both the fused read
(`torch._int_mm`) and the dequantising one (read 1, write 2, read 2 bytes per weight).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from personaplex_voice.model.config import ModelConfig
from personaplex_voice.model.lm import LMModel
from personaplex_voice.model.mimi import Mimi
from personaplex_voice.model.quant import quantizable_weights

GIB = 2**30
GB = 1e9
# Device-to-device copy bandwidth measured on an H200 here (bytes read + written per second).
H200_BYTES_PER_S = 4.3e12
TRAFFIC_SLOTS = (64, 128)
RESERVE_GIB = 2.0
PERSONA_CACHE_GIB = 1.0  # the server's default --persona-cache-mb 1024
# Usable memory (GiB, as torch reports it) of the GPU classes in the docs' table.
GPUS = {
    "24 GB (L4, A10G, RTX 4090)": 22.0,
    "48 GB (L40S, A6000)": 44.5,
    "80 GB (A100, H100)": 79.2,
    "141 GB (H200)": 139.8,
}


@dataclass(frozen=True)
class MemoryPlan:
    weights: int  # bytes: LM + Mimi
    per_call: int  # bytes per batch slot
    fixed: int  # bytes: persona cache + reserve

    def calls(self, gpu_gib: float) -> int:
        free = gpu_gib * GIB - self.weights - self.fixed
        return max(0, int(free // self.per_call))


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def memory_plan(
    cfg: ModelConfig,
    dtype: torch.dtype = torch.bfloat16,
    *,
    quantize: str | None = None,
    kv_dtype: torch.dtype | None = None,
    persona_cache_gib: float = PERSONA_CACHE_GIB,
) -> MemoryPlan:
    with torch.device("meta"):
        lm = LMModel(cfg.lm).to(dtype)
        mimi = Mimi(cfg)
    element = torch.empty(0, dtype=dtype).element_size()
    weights = 0
    quantized = set(quantizable_weights(lm)) if quantize == "int8" else set()
    for name, tensor in lm.state_dict().items():
        if name in quantized:
            weights += tensor.numel() + tensor.shape[0] * 2  # int8 rows + a bfloat16 scale per row
        else:
            weights += tensor.numel() * element
    weights += _nbytes(mimi.state_dict())
    lm.set_kv_dtype(kv_dtype)
    lm_state = lm.init_state(1, "meta")
    per_call = _nbytes(lm_state) + _nbytes(mimi.init_state(1, "meta"))
    lc = cfg.lm
    ring = lc.num_streams * (max(lc.delays) + 3) * (8 + 1) + 8
    noise = 4 * (lm.text_linear.out_features + lc.dep_q * lc.card)
    per_call += ring + noise
    if kv_dtype is not None and kv_dtype != dtype:  # one layer's cache read back in `dtype`
        kv = sum(t.numel() for k, t in lm_state.items() if k.endswith((":k", ":v")))
        per_call += kv * element // lc.num_layers
    fixed = int((RESERVE_GIB + persona_cache_gib) * GIB)
    return MemoryPlan(weights=weights, per_call=per_call, fixed=fixed)


def memory_table(cfg: ModelConfig | None = None) -> str:
    """The markdown table of docs/engine.md ("Memory and calls per GPU") for the 7B model."""
    cfg = cfg or ModelConfig.personaplex_7b()
    rows = [
        ("bfloat16", "bfloat16", None, None),
        ("bfloat16", "float8", None, torch.float8_e4m3fn),
        ("int8", "bfloat16", "int8", None),
        ("int8", "float8", "int8", torch.float8_e4m3fn),
    ]
    head = "| LM weights | KV cache | weights (GiB) | per call (GiB) | " + " | ".join(GPUS) + " |"
    lines = [head, "|" + " --- |" * (4 + len(GPUS))]
    for weights_name, kv_name, quantize, kv in rows:
        plan = memory_plan(cfg, torch.bfloat16, quantize=quantize, kv_dtype=kv)
        calls = " | ".join(str(plan.calls(g)) for g in GPUS.values())
        flags = " ".join(
            f for f in ("--quantize int8" if quantize else "", "--kv-dtype float8" if kv else "") if f
        )
        label = f"{weights_name}" + (f" (`{flags}`)" if flags else "")
        sizes = f"{plan.weights / GIB:.1f} | {plan.per_call / GIB:.2f}"
        lines.append(f"| {label} | {kv_name} | {sizes} | {calls} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class TickTraffic:
    """Bytes one tick moves (see the module docstring)."""

    weights: int  # linear weights (+ Mimi), as read now
    weights_old: int  # the same through a bfloat16 copy (int8 dequantised); = weights otherwise
    kv: int  # the LM's KV cache as read now: the filled entries of active slots only
    kv_whole_ring: int  # as the static tick read it before: every slot's whole ring
    kv_convert: int  # the whole ring through a per-layer bfloat16 copy (an fp8 cache converted)
    codec_kv: int  # Mimi's two transformers' rings (float32, read whole by SDPA: 2 positions a tick)

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.codec_kv

    @property
    def total_before(self) -> int:
        return self.weights + self.kv_whole_ring + self.codec_kv

    def floor_ms(self, bytes_per_s: float = H200_BYTES_PER_S) -> float:
        """The tick's time if moving these bytes were all it did."""
        return 1000 * self.total / bytes_per_s

    def floor_before_ms(self, bytes_per_s: float = H200_BYTES_PER_S) -> float:
        return 1000 * self.total_before / bytes_per_s


_WEIGHT_COUNTS: dict[str, tuple[int, int, int]] = {}


def _weight_counts(cfg: ModelConfig) -> tuple[int, int, int]:
    """(elements of the LM's linear weights, their rows, Mimi's bytes), from a meta build (made
    once per config: building the 7B, even on meta, takes a few seconds)."""
    key = json.dumps(cfg.to_dict(), sort_keys=True, default=str)
    counts = _WEIGHT_COUNTS.get(key)
    if counts is None:
        with torch.device("meta"):
            lm = LMModel(cfg.lm).to(torch.bfloat16)
            mimi = Mimi(cfg)
        state = lm.state_dict()
        names = quantizable_weights(lm)
        counts = (
            sum(state[name].numel() for name in names),
            sum(state[name].shape[0] for name in names),
            _nbytes(mimi.state_dict()),
        )
        _WEIGHT_COUNTS[key] = counts
    return counts


def kv_bytes_per_position(cfg: ModelConfig, kv_dtype: torch.dtype | None = None) -> int:
    """One position of one slot's LM KV cache, all layers, keys and values."""
    element = torch.empty(0, dtype=kv_dtype or torch.bfloat16).element_size()
    return cfg.lm.num_layers * 2 * cfg.lm.dim * element


def tick_traffic(
    cfg: ModelConfig,
    slots: int,
    *,
    quantize: str | None = None,
    kv_dtype: torch.dtype | None = None,
    active: int | None = None,
    filled: int | None = None,
) -> TickTraffic:
    """The bytes of one tick with `slots` slots, `active` of them in a call (default all) whose
    LM rings hold `filled` positions each (default: full, the context)."""
    linear, rows, mimi_bytes = _weight_counts(cfg)
    if quantize == "int8":
        weights = linear + 2 * rows + mimi_bytes
        weights_old = linear * (1 + 2 + 2) + 2 * rows + mimi_bytes
    else:
        weights = weights_old = 2 * linear + mimi_bytes
    context = cfg.lm.context
    active = slots if active is None else active
    filled = context if filled is None else min(filled, context)
    position = kv_bytes_per_position(cfg, kv_dtype)
    whole = slots * context * position
    convert = whole if position == kv_bytes_per_position(cfg) else whole * (1 + 2 + 2)
    codec = cfg.mimi.transformer
    codec_kv = slots * 2 * codec["num_layers"] * 2 * codec["context"] * codec["d_model"] * 4
    return TickTraffic(
        weights=weights,
        weights_old=weights_old,
        kv=active * filled * position,
        kv_whole_ring=whole,
        kv_convert=convert,
        codec_kv=codec_kv,
    )


# (label, slots, active, seconds of context filled): the rows of docs/engine.md's traffic table
TRAFFIC_ROWS = (
    ("64 calls, 20 s in", 64, 64, 20),
    ("64 calls, 120 s in", 64, 64, 120),
    ("64 calls, 240 s in (ring full)", 64, 64, 240),
    ("8 of 64 slots in a call, 120 s in", 64, 8, 120),
    ("128 calls, 120 s in", 128, 128, 120),
)


def traffic_table(cfg: ModelConfig | None = None, rows: tuple = TRAFFIC_ROWS) -> str:
    """The markdown table of docs/engine.md ("Memory traffic per tick") for the 7B model:
    bytes now (the length-aware decode) beside before (every slot's whole ring every tick)."""
    cfg = cfg or ModelConfig.personaplex_7b()
    kinds = [
        ("bfloat16", "bfloat16", None, None),
        ("bfloat16", "float8", None, torch.float8_e4m3fn),
        ("int8", "bfloat16", "int8", None),
        ("int8", "float8", "int8", torch.float8_e4m3fn),
    ]
    head = (
        "| LM weights | KV cache | slots | weights (GB) | LM KV now (GB) | LM KV before (GB) | "
        "Mimi KV (GB) | per tick now (GB) | floor at 4.3 TB/s now (ms) | before (ms) |"
    )
    lines = [head, "|" + " --- |" * 10]
    for weights_name, kv_name, quantize, kv in kinds:
        for label, slots, active, seconds in rows:
            if (kv is None and slots > 64) or (kv is not None and active < slots):
                continue  # bfloat16 KV: up to 64 calls; fp8: the full-batch rows
            filled = int(seconds * cfg.frame_rate)
            t = tick_traffic(cfg, slots, quantize=quantize, kv_dtype=kv, active=active, filled=filled)
            lines.append(
                f"| {weights_name} | {kv_name} | {label} | {t.weights / GB:.1f} | {t.kv / GB:.1f} | "
                f"{t.kv_whole_ring / GB:.1f} | {t.codec_kv / GB:.1f} | {t.total / GB:.1f} | "
                f"{t.floor_ms():.1f} | {t.floor_before_ms():.1f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    print(memory_table())
    print()
    print(traffic_table())
