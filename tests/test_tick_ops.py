"""The operations one tick launches, counted by `engine/tick_ops.py` (TorchDispatchMode on the
`meta` device: deterministic, no weights, no GPU): the 7B at 64 slots as a GPU runs its tick."""

from __future__ import annotations

import pytest

from personaplex_voice.engine.tick_ops import SOURCES, tick_ops
from personaplex_voice.model.config import ModelConfig

# The code before ran 6,468 operations a tick by the same count (bench/tick_profile.py's
# `before`); the reference path below is what a GPU whose fused kernels all failed their checks
# still runs.
OPS_PER_TICK_GOAL = 2000


@pytest.fixture(scope="module")
def seven_b() -> ModelConfig:
    return ModelConfig.personaplex_7b()


def test_the_7b_tick_at_64_slots_is_at_most_2000_operations(seven_b) -> None:
    ops = tick_ops(seven_b, 64)
    assert ops.total <= OPS_PER_TICK_GOAL, ops.as_dict()
    assert sum(ops.by_source.values()) == ops.total and set(ops.by_source) <= set(SOURCES)
    # what is left is mostly matmuls: 4 per temporal layer and per depth-transformer layer-step
    lm = seven_b.lm
    matmuls = 4 * lm.num_layers + lm.dep_q * (4 * lm.depformer_num_layers + 1)
    assert ops.by_op["aten.mm"] >= matmuls
    # the fused kernels are one operation each, and the whole vocabularies are never sorted
    assert ops.by_op["personaplex.ring_attention"] == lm.num_layers
    assert ops.by_op["personaplex.step_attention"] == lm.dep_q * lm.depformer_num_layers
    assert "aten.sort" not in ops.by_op


def test_the_count_is_deterministic_and_independent_of_the_slot_count(seven_b) -> None:
    """No data-dependent Python in the tick: the same operations at any batch (the static
    shapes a CUDA graph needs), counted the same every time."""
    assert tick_ops(seven_b, 8).as_dict()["by_source"] == tick_ops(seven_b, 64).as_dict()["by_source"]


def test_the_reference_path_counts_what_the_fused_kernels_save(seven_b) -> None:
    fused, reference = tick_ops(seven_b, 64), tick_ops(seven_b, 64, fused=False)
    assert reference.total > 2 * fused.total
    assert reference.by_source["norm"] > 4 * fused.by_source["norm"]
    assert not any(name.startswith("personaplex.") for name in reference.by_op)
