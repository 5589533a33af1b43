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


def test_traffic_per_tick_is_computed_and_printed_beside_the_old_figure() -> None:
    """docs/engine.md's traffic table is the code's: the LM's KV bytes follow the filled
    positions and the active slots (the length-aware decode), beside the whole ring every slot
    read before; fp8 read directly moves half of bfloat16's; fused int8 reads a fifth of
    dequantising."""
    from personaplex_voice.model.sizes import tick_traffic, traffic_table

    table = traffic_table()
    assert table in (ROOT / "docs" / "engine.md").read_text(encoding="utf-8")
    assert "8 of 64 slots in a call" in table and "128 calls" in table and "before (ms)" in table
    cfg = ModelConfig.personaplex_7b()
    lm = cfg.lm
    per_position = 2 * lm.num_layers * lm.dim * 2  # K and V, bfloat16
    full = tick_traffic(cfg, 64)
    assert full.kv == full.kv_whole_ring == 64 * lm.context * per_position
    at_20s = tick_traffic(cfg, 64, filled=250)
    assert at_20s.kv == 64 * 250 * per_position and at_20s.kv_whole_ring == full.kv
    assert tick_traffic(cfg, 64, active=8, filled=1500).kv == 8 * 1500 * per_position
    assert tick_traffic(cfg, 64, active=0).kv == 0  # idle slots read nothing
    assert tick_traffic(cfg, 64, filled=10 * lm.context).kv == full.kv  # the ring holds `context`
    fp8 = tick_traffic(cfg, 64, kv_dtype=torch.float8_e4m3fn)
    assert fp8.kv * 2 == full.kv and fp8.kv_convert == 5 * fp8.kv
    int8 = tick_traffic(cfg, 64, quantize="int8")
    assert int8.weights < 0.55 * full.weights and int8.weights_old > 2 * int8.weights
    assert 20 < full.floor_ms() < 40 and at_20s.floor_ms() < full.floor_ms() / 4
