"""The engine paths written for the GPU, checked on the CPU: the padded last prefill chunk,
per-slot counter-based noise, prefill chunk timing, voices encoded in chunks, the fp8 cache's
tolerance (the decode kernels themselves: tests/test_gpu_ring_attention.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from support_engine import persona, run_slot, user_frames

from personaplex_voice.engine.base import FRAME_SIZE, Persona, Sampling
from personaplex_voice.engine.generator import PersonaPlexEngine, golden_like_files
from personaplex_voice.engine.sampling import exponential_noise, mix32, mix32_int, seed_key
from personaplex_voice.engine.voice_maker import encode_audio
from personaplex_voice.model.streaming import StepContext

ROOT = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def expected(golden_dir):
    return np.load(golden_dir / "expected.npz")


@pytest.fixture(scope="module")
def files(golden_dir):
    return golden_like_files(golden_dir)


# ------------------------------------------------------------------ padded prefill


@pytest.mark.parametrize("chunk", [8, 16, 64])
def test_padded_last_chunk_is_golden_exact(files, golden_dir, expected, chunk) -> None:
    """Prompts of 59 and 91 model runs in chunks of 8, 16 and 64 positions: every last chunk is
    padded to the chunk length, and the tokens stay the published ones."""
    engine = PersonaPlexEngine(files, num_slots=1, prefill_chunk=chunk)
    frames = user_frames(golden_dir)[:12]
    for run in ("pt_voice", "service"):
        prepared = engine.prepare(persona(run))
        assert prepared.payload.model_runs % chunk != 0  # the last chunk really is padded
        job = engine.begin_start(0, prepared)
        shapes = []
        original = engine.lm.transformer.forward

        def spy(x, ctx, real=None, shapes=shapes, original=original):
            shapes.append((x.shape[1], real))
            return original(x, ctx, real=real)

        engine.lm.transformer.forward = spy
        try:
            while not job.run_chunk():
                pass
        finally:
            del engine.lm.transformer.forward
        assert {t for t, _ in shapes} == {chunk}  # one shape, whatever the prompt's length
        assert sum(real for _, real in shapes) == prepared.payload.model_runs
        assert len(job.chunk_ms) == len(shapes) and all(ms >= 0 for ms in job.chunk_ms)
        assert int(engine.lm_state["transformer:pos"][0]) == prepared.payload.model_runs
        result = run_slot(engine, 0, frames, capture=False)
        np.testing.assert_array_equal(result.tokens, expected[f"{run}__tokens"][:12])


def test_padding_writes_nothing_and_is_invisible(files) -> None:
    """A padded forward leaves exactly the state of the unpadded one (positions, ring entries
    untouched past the real ones) and the real positions' outputs are the same."""
    engine = PersonaPlexEngine(files, num_slots=1)
    transformer = engine.lm.transformer
    dim = engine.cfg.lm.dim
    x = torch.randn(1, 23, dim, generator=torch.Generator().manual_seed(0))

    def run(inputs, real):
        state = engine.lm.init_state(1)
        state["transformer:kpos"][0, :5] = torch.arange(5)  # some history already in the ring
        state["transformer:pos"][0] = 5
        out = transformer(inputs, StepContext(state), real=real)
        return out, state

    plain_out, plain = run(x, None)
    padded_x = torch.cat([x, torch.randn(1, 41, dim)], dim=1)
    padded_out, padded = run(padded_x, 23)
    for key, value in plain.items():
        if key.endswith((":k", ":v")):
            # padding writes only the ring's spare last entry (never read): the rest is the same
            value, written = value[:, :, :-1], padded[key][:, :, :-1]
            torch.testing.assert_close(written, value, rtol=1e-5, atol=1e-5)
            assert torch.equal(written[:, :, 28:], value[:, :, 28:]), key  # nothing past the real
        else:
            assert torch.equal(padded[key], value), key
    torch.testing.assert_close(padded_out[:, :23], plain_out, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ noise


def test_hash_matches_its_host_twin_and_noise_is_exponential() -> None:
    values = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 123456789]
    assert mix32(torch.tensor(values)).tolist() == [mix32_int(v) for v in values]
    assert seed_key(7) != seed_key(8) and 0 <= seed_key(2**63 - 1) < 2**32
    key = torch.tensor([seed_key(1), seed_key(2)])
    step = torch.tensor([0, 0])
    index = mix32(torch.arange(50_000))
    noise = exponential_noise(key, step, torch.arange(2), 17, index)
    assert noise.shape == (2, 2, 50_000) and (noise > 0).all()
    assert abs(float(noise.mean()) - 1) < 0.02 and abs(float(noise.var()) - 1) < 0.05
    # different slots, streams and steps draw unrelated values
    assert abs(float(torch.corrcoef(noise.reshape(4, -1))[0, 1:].abs().max())) < 0.02
    later = exponential_noise(key, step + 1, torch.arange(2), 17, index)
    assert not torch.equal(later, noise)


def seeded(seed: int) -> Persona:
    return Persona(
        text_prompt="Hello.", voice="TINYF0.pt", sampling=Sampling(text_topk=5, audio_topk=30), seed=seed
    )


def sampled_rows(engine: PersonaPlexEngine, slot: int, others: dict[int, int], frames, pattern) -> np.ndarray:
    engine.start(slot, engine.prepare(seeded(7)))
    for other, seed in others.items():
        engine.start(other, engine.prepare(seeded(seed)))
    rows = []
    for i, frame in enumerate(frames):
        active = np.zeros(engine.num_slots, bool)
        active[slot] = True
        for other in others:
            active[other] = pattern(i, other)
        pcm = np.stack([frame * (1 + 0.5 * b) for b in range(engine.num_slots)]).astype(np.float32)
        pcm[slot] = frame  # the seeded caller hears the same thing in every run
        engine.step(pcm, active)
        rows.append(engine.last_tokens[slot].copy())
    return np.stack(rows)


def test_a_seed_reproduces_its_tokens_alone_and_among_others(files, golden_dir) -> None:
    """Noise for every slot comes from one batched computation, yet seed 7 samples the same
    tokens alone, batched with other seeded callers (some idle on some ticks: the compacted
    path), and in the static-buffer tick a CUDA graph replays."""
    frames = user_frames(golden_dir)[:16]
    alone = sampled_rows(PersonaPlexEngine(files, num_slots=1), 0, {}, frames, None)
    assert len({tuple(r) for r in alone}) > 1  # it really samples
    batched = sampled_rows(
        PersonaPlexEngine(files, num_slots=4), 2, {0: 11, 3: 12}, frames, lambda i, s: (i + s) % 3 != 0
    )
    static = PersonaPlexEngine(files, num_slots=3)
    static.use_static_tick(cuda_graph=False)
    in_graph_path = sampled_rows(static, 1, {0: 5, 2: 6}, frames, lambda i, s: i % 2 == 0)
    np.testing.assert_array_equal(batched, alone)
    np.testing.assert_array_equal(in_graph_path, alone)
    other = sampled_rows(PersonaPlexEngine(files, num_slots=1), 0, {}, frames, None)
    np.testing.assert_array_equal(other, alone)  # and again, from a fresh engine


# ------------------------------------------------------------------ voices, stepwise


def test_voice_encoding_in_chunks_gives_the_frame_by_frame_codes(files, golden_dir, expected) -> None:
    engine = PersonaPlexEngine(files, num_slots=1)
    pcm = user_frames(golden_dir).reshape(-1)
    chunked = encode_audio(engine.mimi, pcm)  # 32 frames per call
    one_by_one = encode_audio(engine.mimi, pcm, chunk_frames=1)
    np.testing.assert_array_equal(chunked.numpy(), one_by_one.numpy())
    np.testing.assert_array_equal(chunked.T.numpy(), expected["mimi_user_codes"])


def test_stepwise_prefill_touches_only_its_slot(files, golden_dir, expected) -> None:
    """The stepwise prompt runs on the slot's own batch-1 view: a neighbour mid-call keeps
    every state tensor bit for bit, and the prompted slot is still golden."""
    engine = PersonaPlexEngine(files, num_slots=2, prefill="stepwise")
    engine.start(0, engine.prepare(persona("service")))
    frames = user_frames(golden_dir)
    engine.step(np.stack([frames[0], frames[0]]), np.array([True, False]))
    before = {k: v[0].clone() for k, v in engine.lm_state.items()}
    ring = engine.ring.cache[0].clone(), engine.ring.offset[0].clone()
    job = engine.begin_start(1, engine.prepare(persona("pt_voice")))
    while not job.run_chunk():
        pass
    assert all(torch.equal(v, engine.lm_state[k][0]) for k, v in before.items())
    assert torch.equal(ring[0], engine.ring.cache[0]) and torch.equal(ring[1], engine.ring.offset[0])
    result = run_slot(engine, 1, frames[:10], capture=False)
    np.testing.assert_array_equal(result.tokens, expected["pt_voice__tokens"][:10])


# ------------------------------------------------------------------ fp8 decode attention

# docs/engine.md, "fp8 KV cache": first-step text logits against a bfloat16 cache, max |diff|
# over max |logit| (measured 0.074; e4m3 keeps 3 mantissa bits) and correlation (0.998).
FP8_TOLERANCE = 0.15
FP8_MIN_CORRELATION = 0.99


def first_step_logits(files, golden_dir, **options) -> np.ndarray:
    engine = PersonaPlexEngine(files, num_slots=1, capture_logits=True, **options)
    engine.start(0, engine.prepare(persona("pt_voice")))
    engine.step(user_frames(golden_dir)[:1], np.array([True]))
    return engine.last_text_logits[0].copy()


def test_fp8_cache_is_within_the_documented_tolerance_of_bfloat16(files, golden_dir) -> None:
    """Same inputs, same compute dtype: an fp8 KV cache (read back by the converting path, the
    kernel's reference) against a bfloat16 one, first step's text logits."""
    bf16 = first_step_logits(files, golden_dir, kv_dtype=torch.bfloat16)
    fp8 = first_step_logits(files, golden_dir, kv_dtype=torch.float8_e4m3fn)
    error = float(np.abs(fp8 - bf16).max() / np.abs(bf16).max())
    assert error < FP8_TOLERANCE, error
    assert float(np.corrcoef(fp8, bf16)[0, 1]) > FP8_MIN_CORRELATION
    docs = (ROOT / "docs" / "engine.md").read_text(encoding="utf-8")
    assert (
        f"within {FP8_TOLERANCE:g} of the largest logit" in docs
        and f"correlation >= {FP8_MIN_CORRELATION:g}" in docs
    )


def test_fp8_pcm_frames_stay_finite(files, golden_dir) -> None:
    engine = PersonaPlexEngine(files, num_slots=1, kv_dtype=torch.float8_e4m3fn)
    engine.start(0, engine.prepare(persona("pt_voice")))
    out = engine.step(np.full((1, FRAME_SIZE), 0.9, np.float32), np.array([True]))
    assert np.isfinite(out.pcm).all()


def test_fused_int8_matmul_agrees_with_dequantising() -> None:
    """The CUDA path (`torch._int_mm`, int8 activations per row) computed on the CPU: within the
    check's tolerance of dequantise-then-matmul at 1, 16 (padded to 17) and 64 rows."""
    from personaplex_voice.model.quant import (
        INT_MM_TOLERANCE,
        Int8Weight,
        dequant_linear,
        int_mm_linear,
        int_mm_usable,
        set_int8_matmul,
    )

    gen = torch.Generator().manual_seed(0)
    weight = Int8Weight.quantize(torch.randn(96, 128, generator=gen))
    for rows in (1, 16, 64):
        x = torch.randn(rows, 128, generator=gen)
        fused, plain = int_mm_linear(x, weight.q, weight.scale), dequant_linear(x, weight.q, weight.scale)
        assert fused.shape == plain.shape == (rows, 96)
        assert float((fused - plain).abs().max() / plain.abs().max()) < INT_MM_TOLERANCE / 4
    assert int_mm_usable(torch.device("cpu"))
    model = torch.nn.Module()
    model.w = weight
    set_int8_matmul(model, "dequant")
    assert not weight.fused and not weight.rows(0, 48).fused
    set_int8_matmul(model, "auto")
    assert weight.fused
    with pytest.raises(ValueError):
        set_int8_matmul(model, "fast")
