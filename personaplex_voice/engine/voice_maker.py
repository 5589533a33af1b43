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

# Frames Mimi-encodes per call: streaming state carries across calls, so the codes are the
# frame-by-frame ones (checked against the golden codes), with a few dozen calls per minute of
# audio instead of one per 80 ms frame.
ENCODE_CHUNK_FRAMES = 32


@torch.no_grad()
def encode_audio(mimi: Mimi, pcm: np.ndarray, chunk_frames: int = ENCODE_CHUNK_FRAMES) -> torch.Tensor:
    """Streaming Mimi codes [frames, num_codebooks] (CPU) of 24 kHz audio (last frame zero-padded)."""
    pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
    frames = max(1, -(-pcm.size // FRAME_SIZE))
    padded = np.zeros(frames * FRAME_SIZE, dtype=np.float32)
    padded[: pcm.size] = pcm
    ctx = StepContext(mimi.init_state(1))
    device = next(mimi.parameters()).device
    x = torch.from_numpy(padded).to(device).view(1, 1, frames * FRAME_SIZE)
    step = max(1, min(chunk_frames, mimi.max_frames_per_call)) * FRAME_SIZE
    codes = [mimi.encode(x[..., i : i + step], ctx)[0] for i in range(0, frames * FRAME_SIZE, step)]
    return torch.cat(codes, dim=-1).T.cpu()


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
