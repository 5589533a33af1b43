"""`--cpu-offload`: what to do with a GPU's free memory, as a pure function of byte counts.

The published server's `--cpu-offload` keeps layers on the host and moves them for every
forward; ours asks for as little of that as the card allows, in this order:
1. the model as asked (bfloat16 weights, a KV cache in the LM dtype), when it fits;
2. int8 linear weights (`--quantize int8`: half the weights' bytes, the GPU still does the work);
3. an fp8 KV cache as well (`--kv-dtype float8`: half the memory per call);
4. then N temporal-transformer layers kept in pinned host memory and streamed to the GPU ahead
   of their use each tick (model/offload.py), the fewest that make the calls fit. With two
   staging buffers on the GPU (one layer loads while the other runs), the first two layers
   streamed save nothing: a plan streams three or more.
"Fits" = weights on the GPU + staging + `calls` x per-call state + fixed (persona cache and the
CUDA reserve) <= the card's free memory. Streaming costs PCIe traffic every 80 ms frame: the
plan estimates it at `link_gb_s`, and the warm-up measures the real tick (engine/offload.py).
Choices the user made (`--quantize int8`, an explicit `--kv-dtype`) are kept as given.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GIB = 2**30
FRAME_MS = 80.0
STAGING = 2  # GPU buffers of one layer each: one loads while the other runs
# A host-to-GPU copy rate from pinned memory that PCIe 4.0 x16 cards reach (~25 GB/s); only
# for the plan's estimate and its suggestions, the warm-up measures the real one.
DEFAULT_LINK_GB_S = 20.0


@dataclass(frozen=True)
class OffloadSizes:
    """The model's byte counts, per weight mode ("bfloat16", "int8") and KV mode ("auto", "float8")."""

    num_layers: int  # temporal transformer layers (the streamable ones)
    layer_bytes: dict[str, int]  # one temporal layer's weights
    other_bytes: dict[str, int]  # everything else that stays on the GPU: LM rest + Mimi
    per_call_bytes: dict[str, int]  # one batch slot's state


@dataclass(frozen=True)
class OffloadPlan:
    quantize: str | None  # "int8" or None
    kv_dtype: str | None  # "float8", an explicit dtype the user gave, or None (the LM dtype)
    offloaded: tuple[int, ...]  # temporal layer indices kept on the host
    calls: int  # batch slots planned for
    fits: bool
    gpu_bytes: int  # planned: weights on the GPU + staging + calls + fixed
    free_bytes: int
    host_bytes: int  # pinned host memory for the streamed layers
    transfer_bytes: int  # host -> GPU per tick
    transfer_ms: float  # at the assumed link rate
    max_calls: int  # the most calls this card holds with every layer streamed
    steps: tuple[str, ...] = field(default=())  # what was tried, in words

    @property
    def streams(self) -> bool:
        return bool(self.offloaded)

    def describe(self) -> str:
        weights = "int8 weights" if self.quantize == "int8" else "bfloat16 weights"
        kv = f"{self.kv_dtype} KV cache" if self.kv_dtype else "KV cache in the LM dtype"
        stream = "nothing streamed"
        if self.offloaded:
            stream = (
                f"{len(self.offloaded)} layers streamed from host memory "
                f"({self.host_bytes / GIB:.1f} GiB pinned, {self.transfer_bytes / GIB:.2f} GiB per tick, "
                f"~{self.transfer_ms:.0f} ms at {DEFAULT_LINK_GB_S:.0f} GB/s)"
            )
        return (
            f"{weights}, {kv}, {stream}: {self.gpu_bytes / GIB:.1f} of {self.free_bytes / GIB:.1f} GiB free "
            f"for {self.calls} call(s)"
        )


def spread(count: int, num_layers: int) -> tuple[int, ...]:
    """`count` layer indices spread evenly, the last layer last: each streamed layer follows
    resident ones whose compute hides its copy."""
    return tuple((k + 1) * num_layers // count - 1 for k in range(count)) if count else ()


def _ladder(quantize: str | None, kv_dtype: str | None) -> list[tuple[str | None, str | None]]:
    """The (quantize, kv) steps to try, from the model as asked to the most compact: int8
    weights first, then an fp8 cache; what the user chose explicitly stays."""
    weights: list[str | None] = ["int8"] if quantize == "int8" else [None, "int8"]
    explicit_kv = kv_dtype not in (None, "auto")
    steps = [(q, kv_dtype if explicit_kv else None) for q in weights]
    if not explicit_kv:
        steps.append(("int8", "float8"))
    return steps


def plan_offload(
    free_bytes: int,
    sizes: OffloadSizes,
    calls: int,
    *,
    fixed_bytes: int,
    quantize: str | None = None,
    kv_dtype: str | None = None,
    staging: int = STAGING,
    link_gb_s: float = DEFAULT_LINK_GB_S,
) -> OffloadPlan:
    """The plan for `calls` batch slots on a card with `free_bytes` free (see the module docstring)."""
    if calls < 1:
        raise ValueError("plan for at least one call")
    L = sizes.num_layers
    steps: list[str] = []

    def need(q: str | None, kv: str | None, n: int, c: int) -> int:
        mode, kv_mode = (q or "bfloat16"), ("float8" if kv == "float8" else "auto")
        layer = sizes.layer_bytes[mode]
        resident = sizes.other_bytes[mode] + (L - n) * layer + min(n, staging) * layer
        return resident + fixed_bytes + c * sizes.per_call_bytes[kv_mode]

    def make(q: str | None, kv: str | None, n: int, fits: bool) -> OffloadPlan:
        layer = sizes.layer_bytes[q or "bfloat16"]
        kv_mode = "float8" if kv == "float8" else "auto"
        room = free_bytes - need(q, kv, L, 0)
        return OffloadPlan(
            quantize=q,
            kv_dtype=kv,
            offloaded=spread(n, L),
            calls=calls,
            fits=fits,
            gpu_bytes=need(q, kv, n, calls),
            free_bytes=free_bytes,
            host_bytes=n * layer,
            transfer_bytes=n * layer,
            transfer_ms=n * layer / (link_gb_s * 1e9) * 1000,
            max_calls=max(0, room // sizes.per_call_bytes[kv_mode]),
            steps=tuple(steps),
        )

    ladder = _ladder(quantize, kv_dtype)
    for q, kv in ladder:
        label = f"{q or 'bfloat16'} weights, {kv or 'LM-dtype'} KV"
        if need(q, kv, 0, calls) <= free_bytes:
            steps.append(f"{label}: fits")
            return make(q, kv, 0, True)
        steps.append(f"{label}: {need(q, kv, 0, calls) / GIB:.1f} GiB needed")
    q, kv = ladder[-1]
    for n in range(1, L + 1):
        if need(q, kv, n, calls) <= free_bytes:
            steps.append(f"{n} of {L} layers streamed: fits")
            return make(q, kv, n, True)
    steps.append(f"all {L} layers streamed: {need(q, kv, L, calls) / GIB:.1f} GiB needed")
    return make(q, kv, L, False)


def realtime_calls(
    free_bytes: int,
    sizes: OffloadSizes,
    calls: int,
    *,
    fixed_bytes: int,
    quantize: str | None = None,
    kv_dtype: str | None = None,
    link_gb_s: float = DEFAULT_LINK_GB_S,
    budget_ms: float = FRAME_MS / 2,
) -> int:
    """The most calls (<= `calls`) whose plan's copies take at most `budget_ms` per tick at
    `link_gb_s`: a suggestion when the asked plan streams too much (0 when none does)."""
    for c in range(calls, 0, -1):
        plan = plan_offload(
            free_bytes,
            sizes,
            c,
            fixed_bytes=fixed_bytes,
            quantize=quantize,
            kv_dtype=kv_dtype,
            link_gb_s=link_gb_s,
        )
        if plan.fits and plan.transfer_ms <= budget_ms:
            return c
    return 0
