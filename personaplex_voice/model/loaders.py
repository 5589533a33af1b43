"""Build Mimi and the LM from a `ModelConfig` and load published safetensors weights, in the
model's own size, straight onto the target device.

The modules are built on the `meta` device (shapes, no memory, no random init); then each
tensor of the file is read, chunk by chunk (`model/safetensors_io.py`), into its final tensor:
on the target device, in its final dtype (the LM: float32 on CPU, bfloat16 on CUDA unless a dtype
is given; Mimi: float32), or rounded to int8 rows (`quantize="int8"`, `model/quant.py`). Host
memory stays at the model's own size on CPU, and about one chunk when loading onto a GPU.

Tolerance, as in the published loader: tensors the model does not have are ignored and logged by
name; Mimi checkpoints with the old codebook buffer names load (renamed); a checkpoint whose depth
transformer has weights for 8 steps runs with 16, steps 8..15 reusing 0..7. Strictness where
the published loader is silent: a missing tensor or a shape mismatch is one `UserError` line
naming the file and the tensor.
"""

from __future__ import annotations

import contextlib
import logging
import re
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from personaplex_voice.errors import UserError
from personaplex_voice.model.config import ModelConfig
from personaplex_voice.model.lm import LMModel
from personaplex_voice.model.mimi import Mimi
from personaplex_voice.model.quant import (
    QUANTIZE_MODES,
    Int8Weight,
    quantizable_weights,
    quantize_model_,
    set_weight,
)
from personaplex_voice.model.random_init import init_random_mimi
from personaplex_voice.model.safetensors_io import SafetensorsFile, TensorEntry

if TYPE_CHECKING:
    from personaplex_voice.model.sources import ModelFiles

log = logging.getLogger(__name__)

_MAX_LISTED = 5
# Old names of the codebook buffers (older Mimi checkpoints), as the published codebook renames them.
MIMI_RENAMES = {
    "inited": "_initialized",
    "cluster_size": "cluster_usage",
    "embed_avg": "embedding_sum",
    "embed_sum": "embedding_sum",
}
# Depth-transformer groups with one module per step (copied 0..7 -> 8..15 for 8-step checkpoints).
_PER_STEP_GROUPS = ("gating", "linears", "depformer_in", "depformer_emb")


def default_lm_dtype(device: str | torch.device) -> torch.dtype:
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def check_quantize(quantize: str | None) -> str | None:
    """None for no quantization; "int8"; UserError for anything else."""
    if quantize in (None, "none"):
        return None
    if quantize not in QUANTIZE_MODES:
        raise UserError(f"--quantize {quantize}: choose one of {', '.join(QUANTIZE_MODES)}")
    return quantize


# ---------------------------------------------------------------------------------------------
# memory and time, for the start-up log and the benchmarks


def host_peak_rss_mb() -> float:
    """This process's peak resident memory in MB (VmHWM; ru_maxrss where /proc is missing)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_host_peak() -> bool:
    """Restart the peak-RSS count from the current RSS (Linux); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclass
class LoadStats:
    """What one `load_models` call took: printed at start-up and by the benchmarks."""

    seconds: float = 0.0
    lm_bytes: int = 0
    mimi_bytes: int = 0
    host_peak_mb: float = 0.0
    gpu_peak_mb: float | None = None
    ignored: list[str] = field(default_factory=list)


def module_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


# ---------------------------------------------------------------------------------------------
# from a file


@dataclass(frozen=True)
class _Source:
    """Where a model tensor comes from: file tensor `key`, stacked `repeat` times along dim 0."""

    key: str
    repeat: int = 1


def _list(keys: list[str]) -> str:
    shown = ", ".join(keys[:_MAX_LISTED])
    return shown + (f" (+{len(keys) - _MAX_LISTED} more)" if len(keys) > _MAX_LISTED else "")


def _mimi_sources(expected: dict[str, torch.Tensor], entries: dict[str, TensorEntry]) -> dict[str, _Source]:
    sources = {}
    renamed = {}
    for key in entries:
        prefix, _, leaf = key.rpartition(".")
        if leaf in MIMI_RENAMES:
            renamed[f"{prefix}.{MIMI_RENAMES[leaf]}" if prefix else MIMI_RENAMES[leaf]] = key
    for name in expected:
        if name in entries:
            sources[name] = _Source(name)
        elif name in renamed:
            sources[name] = _Source(renamed[name])
    return sources


def _lm_sources(
    lm: LMModel, expected: dict[str, torch.Tensor], entries: dict[str, TensorEntry]
) -> dict[str, _Source]:
    sources = {name: _Source(name) for name in expected if name in entries}
    half = lm.cfg.dep_q // 2
    eight_step = (
        lm.cfg.dep_q == 16
        and f"linears.{half}.weight" not in entries
        and f"linears.{half - 1}.weight" in entries
    )
    if not eight_step:
        return sources
    for name, source in list(sources.items()):
        entry = entries[source.key]
        if (
            name.startswith("depformer.")
            and "self_attn" in name
            and entry.shape[0] * 2 == expected[name].shape[0]
        ):
            sources[name] = _Source(source.key, repeat=2)
    step = re.compile(rf"(^|\.)({'|'.join(_PER_STEP_GROUPS)})\.(\d+)\.")
    for name in expected:
        match = step.search(name)
        if name in sources or match is None or not half <= int(match.group(3)) < 2 * half:
            continue
        src = name[: match.start(3)] + str(int(match.group(3)) - half) + name[match.end(3) :]
        if src in entries:
            sources[name] = _Source(src)
    log.info("depformer weights for steps %d..%d copied from steps 0..%d", half, 2 * half - 1, half - 1)
    return sources


# Every in-place initialiser of torch.nn.init: `meta_build` makes them no-ops.
_INITIALISERS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
)


@contextlib.contextmanager
def meta_build() -> Iterator[None]:
    """Build modules on the meta device with their random initialisers skipped. Initialising a
    meta tensor is pointless, and not free: `normal_` on meta runs torch's Python decompositions,
    whose first use imports torch._dynamo and sympy (~80 MB of host memory a loader never needs)."""
    saved = {name: getattr(nn.init, name) for name in _INITIALISERS}
    for name in saved:
        setattr(nn.init, name, _skip_init)
    try:
        with torch.device("meta"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _skip_init(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


def _load_into(
    model: nn.Module,
    path: Path,
    what: str,
    find_sources: Callable[[dict[str, torch.Tensor], dict[str, TensorEntry]], dict[str, _Source]],
    device: torch.device,
    float_dtype: torch.dtype,
    quantize: set[str] | None = None,
) -> list[str]:
    """Fill the meta-device `model` from the safetensors file `path`; returns the ignored names."""
    expected = model.state_dict(keep_vars=True)
    with SafetensorsFile(path, f"{what} weights") as file:
        entries = file.entries
        sources = find_sources(expected, entries)
        missing = [name for name in expected if name not in sources]
        if missing:
            raise UserError(
                f"{path}: {what} weights do not match the model config: missing tensor {_list(missing)}"
            )
        bad = []
        for name, source in sources.items():
            entry = entries[source.key]
            shape = (entry.shape[0] * source.repeat, *entry.shape[1:]) if entry.shape else entry.shape
            if shape != tuple(expected[name].shape):
                bad.append(f"{name} {shape} != {tuple(expected[name].shape)}")
        if bad:
            raise UserError(
                f"{path}: {what} weights do not match the model config: shape mismatch {_list(bad)}"
            )
        used = {source.key for source in sources.values()}
        ignored = sorted(set(entries) - used)
        if ignored:
            log.warning(
                "%s: ignoring %d tensor(s) the model does not have: %s",
                path,
                len(ignored),
                ", ".join(ignored),
            )
        for name, source in sources.items():
            entry = entries[source.key]
            dtype = float_dtype if entry.dtype.is_floating_point else entry.dtype
            value = torch.empty(tuple(expected[name].shape), dtype=dtype, device=device)
            rows = entry.shape[0] if entry.shape else 0
            file.read_into(source.key, value[:rows] if source.repeat > 1 else value)
            for k in range(1, source.repeat):
                value[k * rows : (k + 1) * rows].copy_(value[:rows])
            if quantize is not None and name in quantize:
                set_weight(model, name, Int8Weight.quantize(value))
            else:
                set_weight(model, name, value)
            del value
    return ignored


def load_mimi(cfg: ModelConfig, path: str | Path | None, device: str | torch.device = "cpu") -> Mimi:
    """Mimi in float32 on `device`.

    `path` None = random weights from the global RNG (seed it for a reproducible codec), tuned by
    `random_init.init_random_mimi` into a toy codec that maps varied input to varied codes and
    codes to speech-level sound (the demo model).
    """
    device = torch.device(device)
    if path is None:
        with torch.device(device):
            model = Mimi(cfg)
    else:
        with meta_build():
            model = Mimi(cfg)
        _load_into(model, Path(path), "Mimi", _mimi_sources, device, torch.float32)
    model = model.eval()
    model.refresh()
    if path is None:
        init_random_mimi(model)
    return model


def load_lm(
    cfg: ModelConfig,
    path: str | Path | None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    *,
    quantize: str | None = None,
) -> LMModel:
    """The LM on `device` in `dtype` (default: float32 on CPU, bfloat16 on CUDA); with
    `quantize="int8"` its linear weights are int8 rows (scales and activations in `dtype`).

    `path` None = random weights drawn directly on the device in `dtype` (the 7B model would take
    minutes on CPU).
    """
    device = torch.device(device)
    dtype = dtype or default_lm_dtype(device)
    quantize = check_quantize(quantize)
    if path is None:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = LMModel(cfg.lm)
        finally:
            torch.set_default_dtype(previous)
        if quantize:
            quantize_model_(model)
        return model.eval()
    with meta_build():
        model = LMModel(cfg.lm)
    targets = set(quantizable_weights(model)) if quantize else None

    def sources(expected: dict[str, torch.Tensor], entries: dict[str, TensorEntry]) -> dict[str, _Source]:
        return _lm_sources(model, expected, entries)

    _load_into(model, Path(path), "LM", sources, device, dtype, targets)
    return model.eval()


def load_models(
    files: ModelFiles,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    *,
    quantize: str | None = None,
) -> tuple[Mimi, LMModel, LoadStats]:
    """(Mimi, LM, what loading them took) for a model's files; the demo model is built here.

    The demo (no weight files) draws its random weights on the CPU in float32 under a fixed seed,
    whatever the device and dtype, so it is the same model everywhere (its voice files stay valid).
    """
    device = torch.device(device)
    dtype = dtype or default_lm_dtype(device)
    started = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if files.lm_weights is None and files.mimi_weights is None:
        from personaplex_voice.model.demo import seeded_weights

        with seeded_weights():
            mimi = load_mimi(files.config, None, "cpu").to(device)
            lm = load_lm(files.config, None, "cpu", torch.float32).to(device=device, dtype=dtype)
        mimi.refresh()
        if check_quantize(quantize):
            quantize_model_(lm)
    else:
        mimi = load_mimi(files.config, files.mimi_weights, device)
        lm = load_lm(files.config, files.lm_weights, device, dtype, quantize=quantize)
    stats = LoadStats(
        seconds=time.perf_counter() - started,
        lm_bytes=module_bytes(lm),
        mimi_bytes=module_bytes(mimi),
        host_peak_mb=host_peak_rss_mb(),
        gpu_peak_mb=torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
    )
    gpu = f", GPU peak {stats.gpu_peak_mb:.0f} MB" if stats.gpu_peak_mb is not None else ""
    log.info(
        "model %s on %s in %.1f s: LM %.2f GB (%s%s), Mimi %.2f GB; host peak RSS %.0f MB%s",
        files.name,
        device,
        stats.seconds,
        stats.lm_bytes / 1e9,
        str(dtype).removeprefix("torch."),
        ", int8 linear weights" if quantize == "int8" else "",
        stats.mimi_bytes / 1e9,
        stats.host_peak_mb,
        gpu,
    )
    return mimi, lm, stats
