"""Build Mimi and the LM from a `ModelConfig` and load published safetensors weights.

Key names are the published ones (`tokenizer-e351c8d8-checkpoint125.safetensors` for Mimi,
`model.safetensors` for the LM). The LM is stored in bfloat16: it runs in float32 on CPU and in
bfloat16 on CUDA unless a dtype is given. Every problem with a file raises `UserError` naming the
file and the problem (missing, not safetensors, missing/unexpected keys, shape mismatch).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from personaplex_voice.errors import UserError
from personaplex_voice.model.config import ModelConfig
from personaplex_voice.model.lm import LMModel
from personaplex_voice.model.mimi import Mimi
from personaplex_voice.model.random_init import init_random_mimi

log = logging.getLogger(__name__)

_MAX_LISTED = 5


def default_lm_dtype(device: str | torch.device) -> torch.dtype:
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def _read_safetensors(path: Path, what: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: {what} weights not found")
    try:
        return load_file(str(path), device="cpu")
    except Exception as exc:  # safetensors raises several types for corrupt files
        raise UserError(f"{path}: not a valid safetensors file ({exc})") from None


def _list(keys: list[str]) -> str:
    shown = ", ".join(keys[:_MAX_LISTED])
    return shown + (f" (+{len(keys) - _MAX_LISTED} more)" if len(keys) > _MAX_LISTED else "")


def _check_and_load(module: nn.Module, weights: dict[str, torch.Tensor], path: Path, what: str) -> None:
    expected = module.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing:
        raise UserError(
            f"{path}: {what} weights do not match the model config: missing keys {_list(missing)}"
        )
    if unexpected:
        raise UserError(
            f"{path}: {what} weights do not match the model config: unexpected keys {_list(unexpected)}"
        )
    bad = [
        f"{k} {tuple(weights[k].shape)} != {tuple(v.shape)}"
        for k, v in expected.items()
        if tuple(weights[k].shape) != tuple(v.shape)
    ]
    if bad:
        raise UserError(f"{path}: {what} weights do not match the model config: shape mismatch {_list(bad)}")
    with torch.no_grad():
        for key, param in expected.items():
            param.copy_(weights[key].to(param.dtype))


def _expand_half_depformer(lm: LMModel, weights: dict[str, torch.Tensor]) -> None:
    """Published checkpoints trained with an 8-step depformer run with dep_q=16: steps 8..15 reuse
    the weights of steps 0..7, as the published loader does. Only applies when exactly those are
    absent; anything else is reported as a mismatch."""
    half = lm.cfg.dep_q // 2
    if (
        lm.cfg.dep_q != 16
        or f"linears.{half}.weight" in weights
        or f"linears.{half - 1}.weight" not in weights
    ):
        return
    expected = lm.state_dict()
    for name, tensor in list(weights.items()):
        doubled = name in expected and tensor.shape[0] * 2 == expected[name].shape[0]
        if name.startswith("depformer.") and "self_attn" in name and doubled:
            weights[name] = torch.cat([tensor, tensor], dim=0)
    for name in expected:
        if name in weights:
            continue
        for group in ("gating", "linears", "depformer_in", "depformer_emb"):
            for new in range(half, 2 * half):
                needle = f"{group}.{new}."
                if needle in name:
                    src = name.replace(needle, f"{group}.{new - half}.")
                    if src in weights:
                        weights[name] = weights[src]
    log.info("depformer weights for steps %d..%d copied from steps 0..%d", half, 2 * half - 1, half - 1)


def load_mimi(cfg: ModelConfig, path: str | Path | None, device: str | torch.device = "cpu") -> Mimi:
    """Mimi in float32 on `device`.

    `path` None = random weights from the global RNG (seed it for a reproducible codec), tuned by
    `random_init.init_random_mimi` into a toy codec that maps varied input to varied codes and
    codes to speech-level sound (the demo model).
    """
    if path is None:
        with torch.device(device):
            model = Mimi(cfg)
    else:
        model = Mimi(cfg)
        weights = _read_safetensors(Path(path), "Mimi")
        _check_and_load(model, weights, Path(path), "Mimi")
    model = model.to(device=device, dtype=torch.float32).eval()
    model.refresh()
    if path is None:
        init_random_mimi(model)
    return model


def load_lm(
    cfg: ModelConfig,
    path: str | Path | None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> LMModel:
    """The LM on `device` in `dtype` (default: float32 on CPU, bfloat16 on CUDA)."""
    dtype = dtype or default_lm_dtype(device)
    if path is None:  # random init directly on the device (the 7B model would take minutes on CPU)
        with torch.device(device):
            model = LMModel(cfg.lm)
        return model.to(dtype=dtype).eval()
    model = LMModel(cfg.lm)
    if path is not None:
        weights = _read_safetensors(Path(path), "LM")
        _expand_half_depformer(model, weights)
        _check_and_load(model, weights, Path(path), "LM")
    return model.to(device=device, dtype=dtype).eval()
