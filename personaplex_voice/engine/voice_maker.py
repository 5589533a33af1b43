"""Making voices: Mimi codes of an audio prompt, and the published `.pt` voice of a recording.

An audio voice is Mimi-encoded at prepare (`encode_audio`); `make_voice` goes one step further,
as the reference's save-embeddings option does: the LM input embeddings of the voice-prompt
steps and the token cache after them, so a call replays them instead of encoding audio.
"""

from __future__ import annotations

import numpy as np
import torch

from personaplex_voice.engine.base import FRAME_SIZE
from personaplex_voice.engine.prompt_plan import PromptPlanner
from personaplex_voice.engine.voices import normalize_loudness
from personaplex_voice.model.lm import LMModel
from personaplex_voice.model.mimi import Mimi
from personaplex_voice.model.streaming import StepContext


@torch.no_grad()
def encode_audio(mimi: Mimi, pcm: np.ndarray) -> torch.Tensor:
    """Streaming Mimi codes [frames, num_codebooks] (CPU) of 24 kHz audio (last frame zero-padded)."""
    pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
    frames = max(1, -(-pcm.size // FRAME_SIZE))
    padded = np.zeros(frames * FRAME_SIZE, dtype=np.float32)
    padded[: pcm.size] = pcm
    ctx = StepContext(mimi.init_state(1))
    device = next(mimi.parameters()).device
    x = torch.from_numpy(padded).to(device).view(frames, 1, FRAME_SIZE)
    codes = [mimi.encode(x[i : i + 1], ctx)[0, :, 0] for i in range(frames)]
    return torch.stack(codes).cpu()


@torch.no_grad()
def make_voice(
    mimi: Mimi, lm: LMModel, planner: PromptPlanner, audio_24k: np.ndarray, normalized: bool = False
) -> dict[str, torch.Tensor]:
    """The published `.pt` voice of an audio prompt: {"embeddings" [N, 1, 1, dim], "cache" [1, K, C]}.

    `audio_24k` is mono 24 kHz; it is normalised to -24 LUFS here unless `normalized` says the
    caller already did (e.g. with `voices.load_voice_audio`).
    """
    pcm = np.asarray(audio_24k, dtype=np.float32).reshape(-1)
    if not normalized:
        pcm = normalize_loudness(pcm)
    columns, cache = planner.voice_prompt(encode_audio(mimi, pcm))
    device = lm.text_emb.weight.device
    emb = lm.embed_codes(columns.T[None].to(device))[0].float().cpu()  # [N, dim]
    return {"embeddings": emb[:, None, None, :].contiguous(), "cache": cache}
