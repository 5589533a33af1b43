"""A second tiny architecture (other widths, depths, contexts) built from its config, saved as
published-format safetensors, loaded back through the loaders: the engine runs it, and a slot in
a busy batch gives exactly what the same persona gives alone. Also: loader error messages."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from support_engine import files_for, other_config, write_model_dir

from personaplex_voice.engine.base import FRAME_SIZE, Persona, PersonaError, Sampling
from personaplex_voice.engine.generator import PersonaPlexEngine
from personaplex_voice.errors import UserError
from personaplex_voice.model.config import ModelConfig
from personaplex_voice.model.loaders import load_lm, load_mimi

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(golden_dir, tmp_path_factory):
    return write_model_dir(golden_dir, tmp_path_factory.mktemp("other_model"), other_config(golden_dir))


def test_config_round_trips(golden_dir):
    cfg = other_config(golden_dir)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    big = ModelConfig.personaplex_7b()
    assert ModelConfig.from_dict(big.to_dict()) == big
    assert big.lm.dep_q == 16 and big.lm.dim == 4096 and big.mimi.quantizer["n_q"] == 32


def test_weights_load_back_exactly(model_dir):
    cfg = ModelConfig.from_json(model_dir / "config.json")
    lm = load_lm(cfg, model_dir / "model.safetensors")
    from safetensors.torch import load_file

    stored = load_file(str(model_dir / "model.safetensors"))
    for key, value in lm.state_dict().items():
        assert value.dtype == torch.float32
        assert torch.equal(value, stored[key].float()), key
    assert lm.transformer.layers[0].gating.linear_in.weight.shape == (2 * 132, 48)  # (2 * 4.125 * 48) // 3
    assert lm.depformer.layers[0].gating[0].linear_in.weight.shape == (2 * 42, 16)  # ff == 4 * dim rule


def test_batch_slot_equals_single_slot(model_dir):
    files = files_for(model_dir)
    single = PersonaPlexEngine(files, num_slots=1)
    batch = PersonaPlexEngine(files, num_slots=3)
    me = Persona(text_prompt="Hello there.", voice="V0", sampling=Sampling(greedy=True))
    other = Persona(text_prompt="Something else entirely.", voice="V0", seed=5)
    with pytest.raises(PersonaError, match=r"another model"):
        single.prepare(Persona(voice="OTHER.pt"))
    single.start(0, single.prepare(me))
    batch.start(0, batch.prepare(other))
    batch.start(2, batch.prepare(me))
    rng = np.random.default_rng(3)
    frames = (rng.standard_normal((45, FRAME_SIZE)) * 0.2).astype(np.float32)
    for i, frame in enumerate(frames):
        a = single.step(frame[None], np.array([True]))
        noise = rng.standard_normal(FRAME_SIZE).astype(np.float32)
        b = batch.step(np.stack([noise, noise, frame]), np.array([i % 3 != 1, False, True]))
        np.testing.assert_array_equal(single.last_tokens[0], batch.last_tokens[2])
        np.testing.assert_allclose(a.pcm[0], b.pcm[2], atol=1e-5, rtol=0)
    # Past both contexts (Mimi 20 steps, LM 90): the slot kept rolling.
    assert int(batch.lm_state["transformer:pos"][2]) > 90


def test_loader_errors_name_the_file(model_dir, tmp_path):
    cfg = ModelConfig.from_json(model_dir / "config.json")
    with pytest.raises(UserError, match=r"missing.safetensors.*not found"):
        load_lm(cfg, tmp_path / "missing.safetensors")
    (tmp_path / "corrupt.safetensors").write_bytes(b"\x00" * 50)
    with pytest.raises(UserError, match=r"corrupt.safetensors.*not a valid safetensors"):
        load_mimi(cfg, tmp_path / "corrupt.safetensors")
    from safetensors.torch import load_file

    sd = load_file(str(model_dir / "model.safetensors"))
    key = "transformer.layers.0.gating.linear_in.weight"
    save_file({k: v for k, v in sd.items() if k != key}, str(tmp_path / "missing_key.safetensors"))
    with pytest.raises(UserError, match=r"missing_key.safetensors.*missing tensor transformer.layers.0"):
        load_lm(cfg, tmp_path / "missing_key.safetensors")
    save_file({**sd, key: torch.zeros(3, 3)}, str(tmp_path / "shape.safetensors"))
    with pytest.raises(UserError, match=r"shape.safetensors.*shape mismatch"):
        load_lm(cfg, tmp_path / "shape.safetensors")


def test_eight_step_depformer_checkpoint_is_expanded(golden_dir, tmp_path):
    """Like the published loader: a checkpoint with depformer weights for steps 0..7 only runs
    with dep_q = 16, steps 8..15 reusing steps 0..7."""
    from safetensors.torch import load_file

    cfg = ModelConfig.from_json(golden_dir / "config.json")
    sd = load_file(str(golden_dir / "model.safetensors"))
    half = {}
    for key, value in sd.items():
        parts = key.split(".")
        step = next(
            (
                int(p)
                for g, p in itertools.pairwise(parts)
                if g in ("gating", "linears", "depformer_in", "depformer_emb") and p.isdigit()
            ),
            None,
        )
        if step is not None and step >= 8:
            continue
        if key.startswith("depformer.") and "self_attn" in key:
            value = value[: value.shape[0] // 2]
        half[key] = value.contiguous()
    save_file(half, str(tmp_path / "half.safetensors"))
    lm = load_lm(cfg, tmp_path / "half.safetensors")
    assert torch.equal(lm.linears[9].weight, lm.linears[1].weight)
    assert torch.equal(
        lm.depformer.layers[0].gating[12].linear_in.weight, lm.depformer.layers[0].gating[4].linear_in.weight
    )
    w = lm.depformer.layers[1].self_attn.in_proj_weight
    assert torch.equal(w[: w.shape[0] // 2], w[w.shape[0] // 2 :])
