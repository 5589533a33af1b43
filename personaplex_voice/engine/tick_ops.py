"""The tensor operations one tick launches, counted deterministically on the `meta` device.

Inside a CUDA graph every operation is still one kernel (or a few), each ~2-3 us of GPU time
whatever its size, so their number bounds a tick's time from below as surely as its bytes do.
`count_tick` builds the engine for any model shape on `meta` (shapes only: the 7B at 64 slots
costs no memory and no weights), runs the static tick a CUDA graph captures (every slot active,
the sampling path on), and counts what reaches torch's dispatcher (`TorchDispatchMode`):
- counted: every operation that computes or moves data (a matmul, an elementwise op, a copy,
  one fused kernel of `model/fused_ops.py`);
- not counted: views and reshapes that only relabel memory (`is_view`, `_unsafe_view`), empty
  allocations, and host-side scalars (`scalar_tensor`): none launches a kernel;
- `scaled_dot_product_attention` counts as one operation: on a GPU it is one fused kernel
  (flash, cuDNN, memory-efficient), while on `meta` torch would expand it into its math
  reference.
`fused=True` counts the tick as a GPU runs it once the fused kernels checked out (what the
engine's warm-up turns on there); `fused=False` counts the reference path (a GPU where they did
not, or the CPU). Each operation is attributed to a source by the code it runs in (`SOURCES`),
and the bytes of its outputs are summed (what the tick writes besides the KV cache).
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

# Where an operation comes from, by the code it runs in.
SOURCES = (
    "embeddings", "norm", "rope", "attention", "mlp", "text head", "depformer", "sampling",
    "tokens", "codec", "other",
)  # fmt: skip
# Dispatcher operations that launch no kernel (besides views, which say so themselves).
_NO_KERNEL = {
    "aten._unsafe_view",
    "aten._reshape_alias",
    "aten.alias",
    "aten.detach",
    "aten.lift_fresh",
    "aten.empty",
    "aten.empty_like",
    "aten.empty_strided",
    "aten.new_empty",
    "aten.new_empty_strided",
    "aten.scalar_tensor",
}
SDPA_NAME = "scaled_dot_product_attention (one fused kernel)"


@dataclass
class TickOps:
    """What one tick ran: operations in all, by source and by name, and the bytes they wrote."""

    total: int = 0
    by_source: Counter = field(default_factory=Counter)
    by_op: Counter = field(default_factory=Counter)
    by_source_op: Counter = field(default_factory=Counter)  # (source, operation)
    bytes_written: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "by_source": {s: self.by_source[s] for s in SOURCES if self.by_source[s]},
            "top_ops": dict(self.by_op.most_common(12)),
            "bytes_written": self.bytes_written,
        }


def _source(frame: Any) -> str:
    """The source of the operation whose Python stack starts at `frame` (innermost first)."""
    names = []
    while frame is not None:
        names.append((Path(frame.f_code.co_filename).name, getattr(frame.f_code, "co_qualname", "")))
        frame = frame.f_back
    files = {name for name, _ in names}
    qualnames = [q for _, q in names]
    if files & {"mimi.py", "seanet.py", "conv.py", "quantizer.py"}:
        return "codec"
    if "sampling.py" in files:
        return "sampling"
    if any(q.endswith("depformer_tokens") or q.startswith("Depformer.") for q in qualnames):
        return "depformer"
    if "tokens.py" in files:
        return "tokens"
    for q in qualnames:  # innermost first: the component the operation belongs to
        if q.startswith(("rotate", "rope_tables", "frequencies")) or "rope" in q.lower():
            return "rope"
        if "norm" in q.lower() and "Transformer" not in q:
            return "norm"
        if q.startswith(("StreamingAttention.", "StreamingTransformer.plan")):
            return "attention"
        if q.startswith("ActivationGating."):
            return "mlp"
        if q in ("embed", "LMModel.embed_codes"):
            return "embeddings"
        if q.startswith("LMModel.forward_embeddings"):
            return "text head"
    return "other"


class _Counting(TorchDispatchMode):
    def __init__(self, ops: TickOps):
        super().__init__()
        self.ops = ops

    def record(self, name: str, written: Any) -> None:
        ops = self.ops
        source = _source(sys._getframe(2))
        ops.total += 1
        ops.by_op[name] += 1
        ops.by_source[source] += 1
        ops.by_source_op[(source, name)] += 1
        for t in written if isinstance(written, (tuple, list)) else (written,):
            if isinstance(t, torch.Tensor):
                ops.bytes_written += t.numel() * t.element_size()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        if not func.is_view and name not in _NO_KERNEL:
            # an in-place scatter writes its source's elements, not the whole tensor it returns
            source = args[3] if name.endswith("scatter_") and len(args) > 3 else None
            self.record(name, source if isinstance(source, torch.Tensor) else out)
        return out


@contextlib.contextmanager
def _sdpa_as_one_op(mode: _Counting) -> Iterator[None]:
    """`F.scaled_dot_product_attention` counted as the one kernel it is on a GPU."""
    original = F.scaled_dot_product_attention

    def counted(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any = None, *a: Any, **kw: Any
    ) -> Any:
        out = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)
        mode.record(SDPA_NAME, out)
        return out

    F.scaled_dot_product_attention = counted
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


@contextlib.contextmanager
def _no_tokenizer() -> Iterator[None]:
    """The tick needs no tokenizer; a meta build has no tokenizer file to read."""
    from personaplex_voice.engine import generator

    class _Stub:
        vocab_size = 0

        def __init__(self, path: Any = None):
            pass

        def encode(self, text: str) -> list[int]:
            return []

        def display_piece(self, token_id: int) -> None:
            return None

    saved = generator.TextTokenizer
    generator.TextTokenizer = _Stub  # type: ignore[misc, assignment]
    try:
        yield
    finally:
        generator.TextTokenizer = saved  # type: ignore[misc]


def meta_engine(
    cfg: Any,
    slots: int,
    dtype: torch.dtype = torch.bfloat16,
    kv_dtype: torch.dtype | None = None,
    fused: bool = True,
) -> Any:
    """The engine for `cfg` with `slots` slots on `meta`, set up as its CUDA-graph tick runs."""
    from personaplex_voice.engine.generator import PersonaPlexEngine
    from personaplex_voice.model.lm import LMModel
    from personaplex_voice.model.mimi import Mimi
    from personaplex_voice.model.sources import ModelFiles

    with torch.device("meta"):
        lm = LMModel(cfg.lm).to(dtype)
        mimi = Mimi(cfg)
    files = ModelFiles(
        name="meta",
        config=cfg,
        lm_weights=None,
        mimi_weights=None,
        tokenizer=Path("unused"),
        voice_dirs=(),
        lm_dtype_in_file="bfloat16",
    )
    with _no_tokenizer():
        engine = PersonaPlexEngine(files, slots, "meta", dtype, models=(mimi, lm), kv_dtype=kv_dtype)
    engine.use_static_tick(cuda_graph=False)
    if fused:
        with contextlib.suppress(ImportError):  # an older engine (bench/tick_profile.py --before)
            from personaplex_voice.model.fused_ops import FUSED_OPS, set_fused_ops

            set_fused_ops(lm, FUSED_OPS)
            set_fused_ops(mimi, [op for op in FUSED_OPS if op != "ring_attention"])
    return engine


@torch.no_grad()
def count_tick(engine: Any) -> TickOps:
    """The operations of one static tick of `engine` (built by `meta_engine`), every slot active."""
    B = engine.num_slots
    device = engine.device
    pcm = torch.zeros(B, engine.frame_size, device=device)
    active = torch.ones(B, dtype=torch.bool, device=device)
    engine.sampler.prepare_tick([True] * B)
    # a first tick makes what every later one reuses (masks, buffers, tables): not counted
    engine._step_tensors(engine._full, pcm, active, True)
    engine.sampler.prepare_tick([True] * B)
    ops = TickOps()
    with _Counting(ops) as mode, _sdpa_as_one_op(mode):
        engine._step_tensors(engine._full, pcm, active, True)
    return ops


def tick_ops(cfg: Any, slots: int, *, fused: bool = True, kv_dtype: torch.dtype | None = None) -> TickOps:
    """`count_tick` of a fresh meta engine (bfloat16, as a GPU runs the LM)."""
    return count_tick(meta_engine(cfg, slots, kv_dtype=kv_dtype, fused=fused))
