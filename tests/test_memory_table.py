"""docs/engine.md's table of memory and calls per GPU is what the code's own sizes give."""

from __future__ import annotations

from pathlib import Path

import torch

from personaplex_voice.model.config import ModelConfig
from personaplex_voice.model.sizes import GIB, memory_plan, memory_table

ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_table_is_computed_from_the_code() -> None:
    assert memory_table() in (ROOT / "docs" / "engine.md").read_text(encoding="utf-8")


def test_plan_sizes_are_the_7b_tensors() -> None:
    cfg = ModelConfig.personaplex_7b()
    plan = memory_plan(cfg)
    lm = cfg.lm
    kv = 2 * lm.num_layers * lm.context * lm.dim * 2  # K and V, bfloat16
    assert kv <= plan.per_call < kv * 1.02
    int8 = memory_plan(cfg, quantize="int8")
    assert 0.45 < int8.weights / plan.weights < 0.6
    fp8 = memory_plan(cfg, kv_dtype=torch.float8_e4m3fn)
    assert fp8.per_call < 0.6 * plan.per_call
    assert plan.calls(139.8) > plan.calls(79.2) > plan.calls(22.0) >= 1
    assert 15.5 * GIB < plan.weights < 16.5 * GIB  # 8.4 B bfloat16 LM parameters + Mimi
