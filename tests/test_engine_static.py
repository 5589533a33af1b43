"""The static-shape tick that CUDA graphs capture, exercised eagerly on CPU."""

from __future__ import annotations

import numpy as np
import torch
from support_engine import persona, user_frames

from personaplex_voice.engine.base import FRAME_SIZE
from personaplex_voice.engine.generator import PersonaPlexEngine, golden_like_files

torch.set_num_threads(1)


def all_state(engine) -> dict[str, torch.Tensor]:
    """Every state tensor; a KV ring without its spare last entry (the scratch an idle slot's
    write goes to, never read: model/transformer.py)."""

    def kept(key: str, value: torch.Tensor) -> torch.Tensor:
        return value[:, :, :-1].clone() if key.endswith((":k", ":v")) else value.clone()

    state = {f"lm/{k}": kept(k, v) for k, v in engine.lm_state.items()}
    state.update({f"mimi/{k}": kept(k, v) for k, v in engine.mimi_state.items()})
    state.update(
        cache=engine.ring.cache.clone(),
        provided=engine.ring.provided.clone(),
        offset=engine.ring.offset.clone(),
    )
    return state


def test_inactive_tick_leaves_every_state_tensor_untouched(golden_dir):
    """What graph capture relies on: a tick with no active slot modifies nothing."""
    engine = PersonaPlexEngine(golden_like_files(golden_dir), num_slots=2)
    engine.start(1, engine.prepare(persona("pt_voice")))
    frames = user_frames(golden_dir)
    for frame in frames[:3]:
        engine.step(np.stack([frame, frame]), np.array([False, True]))
    before = all_state(engine)
    pcm = torch.from_numpy(np.random.default_rng(0).standard_normal((2, FRAME_SIZE)).astype(np.float32))
    engine._step_tensors(engine._full, pcm, torch.zeros(2, dtype=torch.bool), True)
    after = all_state(engine)
    for key, value in before.items():
        assert torch.equal(value, after[key]), key


def test_static_buffer_path_matches_golden(golden_dir):
    """The graph runner's path (static buffers, tensor exec mask, sampling math always on, greedy
    slots selecting the argmax) gives the golden tokens, next to a sampling neighbour."""
    expected = np.load(golden_dir / "expected.npz")
    engine = PersonaPlexEngine(golden_like_files(golden_dir), num_slots=2)
    engine.use_static_tick(cuda_graph=False)
    from personaplex_voice.engine.base import Persona, Sampling

    engine.start(
        0, engine.prepare(Persona(text_prompt="Hi.", voice="TINYF0.pt", sampling=Sampling(), seed=1))
    )
    engine.start(1, engine.prepare(persona("pt_voice")))
    rows = []
    for i, frame in enumerate(user_frames(golden_dir)[:25]):
        engine.step(np.stack([frame[::-1].copy(), frame]), np.array([i % 2 == 0, True]))
        rows.append(engine.last_tokens[1].copy())
    np.testing.assert_array_equal(np.stack(rows), expected["pt_voice__tokens"][:25])


def test_non_finite_input_does_not_poison_the_slot(golden_dir):
    engine = PersonaPlexEngine(golden_like_files(golden_dir), num_slots=1)
    engine.start(0, engine.prepare(persona("pt_voice")))
    bad = np.full((1, FRAME_SIZE), np.nan, np.float32)
    bad[0, ::2] = np.inf
    out = engine.step(bad, np.array([True]))
    assert np.isfinite(out.pcm).all()
    assert all(torch.isfinite(v).all() for v in engine.lm_state.values() if v.is_floating_point())


def test_compacted_tick_touches_only_active_slots(golden_dir):
    """CPU ticks with idle slots run only the active ones: idle slots' state stays bit-identical
    and active ones get the same tokens as in a full-batch tick."""
    expected = np.load(golden_dir / "expected.npz")
    engine = PersonaPlexEngine(golden_like_files(golden_dir), num_slots=3, capture_logits=True)
    assert engine._compact
    engine.start(0, engine.prepare(persona("service")))
    engine.start(2, engine.prepare(persona("pt_voice")))
    frames = user_frames(golden_dir)[:8]
    for i, frame in enumerate(frames):
        before = {k: v[0].clone() for k, v in engine.lm_state.items()}
        engine.step(np.stack([frame, frame, frame]), np.array([i % 2 == 0, False, True]))
        np.testing.assert_array_equal(engine.last_tokens[2], expected["pt_voice__tokens"][i])
        assert engine.last_text_logits.shape == (3, 300)
        if i % 2:
            assert all(torch.equal(v, engine.lm_state[k][0]) for k, v in before.items())
