"""PersonaPlexEngine against the published implementation's golden outputs (greedy, float32).

Tolerances: tokens and pieces exact, text logits within 1e-3, PCM within 1e-4 (Mimi codes:
test_model_mimi.py).

Depformer (audio) logits get `1e-3 + 5e-5 x scale` (scale = largest |golden logit|, ~350-490),
not a flat 1e-3, because 1e-3 is below their float32 rounding noise (docs/engine.md, Exactness):
- the random tiny model amplifies rounding: a relative 1e-7 (one float32 ulp) perturbation of
  the depformer's input moves these logits by up to 1.1e-3;
- the golden logits themselves are up to 1.1e-2 (2.5e-5 x scale) from a float64 evaluation of the
  same model (test_float64_engine_within_audio_noise_floor below);
- the published code run here gives bit-identical numbers under torch 2.4.1 and 2.13 (and our
  stepwise path is bit-identical to it), 6.3e-3 from the golden file; only the kernel choice
  (MKL_CBWR / MKL_ENABLE_INSTRUCTIONS / ATEN_CPU_CAPABILITY) moves it, to between 6.3e-3 and
  1.6e-2, and none of those settings reproduces the golden file: it was made on a CPU/BLAS
  whose summation order we cannot match.
Measured worst case of our engine: 1.49e-2 (service, parallel prefill) = 3.1e-5 x scale.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support_engine import RUNS, persona, reference_pieces, run_slot, user_frames

from personaplex_voice.engine.generator import PersonaPlexEngine, golden_like_files
from personaplex_voice.engine.prompts import wrap_system_prompt

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def expected(golden_dir):
    return np.load(golden_dir / "expected.npz")


@pytest.fixture(scope="module")
def engine(golden_dir):
    return PersonaPlexEngine(golden_like_files(golden_dir), num_slots=1, capture_logits=True)


# Float32 rounding noise of the golden audio logits, as a fraction of their scale (see above).
AUDIO_LOGITS_NOISE = 5e-5


def check_audio_logits(audio_logits: np.ndarray, expected, run: str) -> None:
    gold_audio = expected[f"{run}__audio_logits"]
    scale = float(np.abs(gold_audio).max())
    atol = 1e-3 + AUDIO_LOGITS_NOISE * scale
    np.testing.assert_allclose(audio_logits[:4], gold_audio, atol=atol, rtol=0)


def check_run(result, expected, run: str) -> None:
    np.testing.assert_array_equal(result.tokens, expected[f"{run}__tokens"])
    np.testing.assert_allclose(result.text_logits, expected[f"{run}__text_logits"], atol=1e-3, rtol=0)
    check_audio_logits(result.audio_logits, expected, run)
    np.testing.assert_allclose(result.pcm, expected[f"{run}__pcm"], atol=1e-4, rtol=0)
    assert result.pieces == reference_pieces(expected[f"{run}__pieces"])


@pytest.mark.parametrize("run", list(RUNS))
def test_golden_run(engine, golden_dir, expected, run):
    _, prompt = RUNS[run]
    assert engine.tokenizer.encode(wrap_system_prompt(prompt)) == list(expected[f"{run}__prompt_tokens"])
    prepared = engine.prepare(persona(run))
    assert prepared.prompt_steps == int(expected[f"{run}__prompt_offset"])
    engine.start(0, prepared)
    check_run(run_slot(engine, 0, user_frames(golden_dir)), expected, run)


@pytest.mark.parametrize("prefill", ["parallel", "stepwise"])
def test_chunked_prefill_is_golden(golden_dir, expected, prefill):
    """`begin_start` run chunk by chunk (7 positions / 3 steps at a time, so the service prompt
    takes many pieces) ends in a slot that gives the golden run exactly."""
    chunked = PersonaPlexEngine(
        golden_like_files(golden_dir),
        num_slots=2,
        capture_logits=True,
        prefill=prefill,
        prefill_chunk=7,
        prefill_chunk_steps=3,
    )
    prefill_job = chunked.begin_start(1, chunked.prepare(persona("service")))
    chunks = 1
    while not prefill_job.run_chunk():
        chunks += 1
    assert prefill_job.remaining == 0
    assert chunks > 10
    check_run(run_slot(chunked, 1, user_frames(golden_dir)), expected, "service")


def test_stepwise_prefill_matches_parallel_and_golden(golden_dir, expected):
    stepwise = PersonaPlexEngine(
        golden_like_files(golden_dir), num_slots=1, capture_logits=True, prefill="stepwise"
    )
    stepwise.start(0, stepwise.prepare(persona("pt_voice")))
    frames = user_frames(golden_dir)
    result = run_slot(stepwise, 0, frames)
    check_run(result, expected, "pt_voice")


def test_float64_engine_within_audio_noise_floor(golden_dir, expected):
    """An exact (float64) evaluation of the same model lands within the same tolerances: the
    audio-logit slack absorbs float32 rounding (ours and the golden file's), not a shared bug."""
    exact = PersonaPlexEngine(
        golden_like_files(golden_dir), num_slots=1, capture_logits=True, dtype=torch.float64
    )
    exact.start(0, exact.prepare(persona("pt_voice")))
    steps = expected["pt_voice__audio_logits"].shape[0]
    result = run_slot(exact, 0, user_frames(golden_dir)[:steps])
    np.testing.assert_array_equal(result.tokens, expected["pt_voice__tokens"][:steps])
    text = expected["pt_voice__text_logits"][:steps]
    np.testing.assert_allclose(result.text_logits, text, atol=1e-3, rtol=0)
    check_audio_logits(result.audio_logits, expected, "pt_voice")
