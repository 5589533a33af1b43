"""Mimi against the golden vectors: streaming codes exact, streaming decode within 1e-4."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf
import torch

from personaplex_voice.model.config import ModelConfig
from personaplex_voice.model.loaders import load_mimi
from personaplex_voice.model.streaming import StepContext, reset_slot

torch.set_num_threads(1)
FRAME = 1920


@pytest.fixture(scope="module")
def golden(golden_dir):
    cfg = ModelConfig.from_json(golden_dir / "config.json")
    mimi = load_mimi(cfg, golden_dir / "mimi.safetensors")
    expected = np.load(golden_dir / "expected.npz")
    pcm, sr = sf.read(golden_dir / "user.wav", dtype="float32")
    assert sr == 24000
    n = expected["mimi_user_codes"].shape[1]
    pcm = np.pad(pcm, (0, n * FRAME - len(pcm)))
    return mimi, expected, pcm


def test_streaming_encode_matches_golden_codes(golden):
    mimi, expected, pcm = golden
    ctx = StepContext(mimi.init_state(1))
    codes = [mimi.encode(torch.from_numpy(f).view(1, 1, FRAME), ctx) for f in pcm.reshape(-1, FRAME)]
    np.testing.assert_array_equal(torch.cat(codes, -1)[0].numpy(), expected["mimi_user_codes"])


def test_streaming_decode_matches_golden_pcm(golden):
    mimi, expected, _ = golden
    codes = torch.from_numpy(expected["mimi_user_codes"])[None]
    ctx = StepContext(mimi.init_state(1))
    out = [mimi.decode(codes[..., i : i + 1], ctx) for i in range(codes.shape[-1])]
    pcm = torch.cat(out, -1).flatten().numpy()
    np.testing.assert_allclose(pcm, expected["mimi_user_decoded_pcm"], atol=1e-4, rtol=0)


def test_batched_slots_are_independent_and_resettable(golden):
    """Slot 1 of a batch of 3 encodes like a lone stream while slot 0 gets noise, slot 2 is
    skipped (exec mask) for a while and slot 0 is reset halfway."""
    mimi, expected, pcm = golden
    frames = pcm.reshape(-1, FRAME)[:20]
    state = mimi.init_state(3)
    fresh = mimi.init_state(1)
    ctx = StepContext(state)
    rng = np.random.default_rng(0)
    got = []
    for i, frame in enumerate(frames):
        batch = np.stack([rng.standard_normal(FRAME).astype(np.float32) * 0.1, frame, frame[::-1].copy()])
        ctx.active = torch.tensor([True, True, i % 3 != 0])
        if i == 10:
            reset_slot(state, fresh, 0)
        codes = mimi.encode(torch.from_numpy(batch)[:, None], ctx)
        got.append(codes[1])
        mimi.decode(codes, ctx)
    np.testing.assert_array_equal(torch.cat(got, -1).numpy(), expected["mimi_user_codes"][:, :20])
