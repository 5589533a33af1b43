"""Helpers for the engine-model tests: golden files, user audio frames, running a persona."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

from personaplex_voice.engine.base import FRAME_SIZE, Persona, Sampling

PROMPT = "You enjoy having a good conversation."
SERVICE_PROMPT = (
    "You work for CitySan Services which is a waste management and your name is Ayelen Lucero. "
    "Information: Verify customer name Omar Torres. Current schedule: every other week."
)
RUNS = {
    "wav_voice": ("TINYF0.wav", PROMPT),
    "pt_voice": ("TINYF0.pt", PROMPT),
    "service": ("TINYF0.pt", SERVICE_PROMPT),
}


def user_frames(golden_dir: Path) -> np.ndarray:
    pcm, sr = sf.read(golden_dir / "user.wav", dtype="float32")
    assert sr == 24000
    n = -(-len(pcm) // FRAME_SIZE)
    return np.pad(pcm, (0, n * FRAME_SIZE - len(pcm))).reshape(n, FRAME_SIZE)


def persona(run: str, **sampling) -> Persona:
    voice, prompt = RUNS[run]
    return Persona(text_prompt=prompt, voice=voice, sampling=Sampling(greedy=True, **sampling))


@dataclass
class RunResult:
    tokens: np.ndarray  # [T, dep_q + 1]
    text_logits: np.ndarray | None
    audio_logits: np.ndarray | None
    pcm: np.ndarray
    pieces: list


def run_slot(engine, slot: int, frames: np.ndarray, capture: bool = True) -> RunResult:
    """Feed `frames` to one slot (others inactive) and collect its outputs."""
    tokens, tl, al, pcm, pieces = [], [], [], [], []
    active = np.zeros(engine.num_slots, bool)
    active[slot] = True
    for frame in frames:
        batch = np.zeros((engine.num_slots, FRAME_SIZE), np.float32)
        batch[slot] = frame
        out = engine.step(batch, active)
        tokens.append(engine.last_tokens[slot].copy())
        if capture:
            tl.append(engine.last_text_logits[slot].copy())
            al.append(engine.last_audio_logits[slot].copy())
        pcm.append(out.pcm[slot].copy())
        pieces.append(out.text[slot])
    return RunResult(
        np.stack(tokens),
        np.stack(tl) if capture else None,
        np.stack(al) if capture else None,
        np.concatenate(pcm),
        pieces,
    )


def reference_pieces(expected: np.ndarray) -> list:
    """Golden pieces with the published "PAD"/"EPAD" shown as None, as StepOutput.text does."""
    return [None if p in ("PAD", "EPAD") else str(p) for p in expected]


def other_config(golden_dir: Path, lm_context: int = 90):
    """A tiny architecture with other widths, depths and contexts than the golden one."""
    import copy
    import json

    from personaplex_voice.model.config import ModelConfig

    cfg = copy.deepcopy(json.loads((golden_dir / "config.json").read_text()))
    seanet = cfg["mimi"]["seanet"]
    seanet.update(dimension=24, n_filters=2, n_residual_layers=2, ratios=[4, 8, 6, 5], true_skip=False)
    cfg["mimi"]["quantizer"].update(dimension=8, n_q=10, input_dimension=24, output_dimension=24)
    cfg["mimi"]["transformer"].update(
        d_model=24, num_heads=3, num_layers=1, dim_feedforward=40, context=20, input_dimension=24
    )
    cfg["mimi"]["transformer"]["output_dimensions"] = [24]
    cfg["lm"].update(
        dim=48,
        num_heads=3,
        num_layers=3,
        context=lm_context,
        depformer_dim=16,
        depformer_num_heads=2,
        depformer_num_layers=1,
        depformer_dim_feedforward=64,
    )
    return ModelConfig.from_dict(cfg)


def write_model_dir(golden_dir: Path, root: Path, cfg, seed: int = 0) -> Path:
    """Random weights for `cfg` saved like a published model directory (LM in bfloat16)."""
    import json
    import shutil

    import torch
    from safetensors.torch import save_file

    from personaplex_voice.model.lm import LMModel
    from personaplex_voice.model.mimi import Mimi

    (root / "config.json").write_text(json.dumps(cfg.to_dict()))
    torch.manual_seed(seed)
    mimi = Mimi(cfg)
    with torch.no_grad():
        for name, buf in mimi.named_buffers():
            if name.endswith("embedding_sum"):
                buf.normal_()
    lm = LMModel(cfg.lm)
    save_file({k: v.contiguous() for k, v in mimi.state_dict().items()}, str(root / "mimi.safetensors"))
    lm_sd = {k: v.to(torch.bfloat16).contiguous() for k, v in lm.state_dict().items()}
    save_file(lm_sd, str(root / "model.safetensors"))
    shutil.copy(golden_dir / "tokenizer.model", root / "tokenizer.model")
    (root / "voices").mkdir(exist_ok=True)
    shutil.copy(golden_dir / "voices" / "TINYF0.wav", root / "voices" / "V0.wav")
    shutil.copy(golden_dir / "voices" / "TINYF0.pt", root / "voices" / "OTHER.pt")
    return root


def files_for(root: Path, name: str = "other"):
    from personaplex_voice.model.config import ModelConfig
    from personaplex_voice.model.sources import ModelFiles

    cfg = ModelConfig.from_json(root / "config.json")
    return ModelFiles(
        name=name,
        config=cfg,
        lm_weights=root / "model.safetensors",
        mimi_weights=root / "mimi.safetensors",
        tokenizer=root / "tokenizer.model",
        voice_dirs=(root / "voices",),
        lm_dtype_in_file="bfloat16",
    )
