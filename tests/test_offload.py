"""`--cpu-offload`: the planner's choices for the 7B model on 8/12/16/24/48 GB cards (a pure
function of byte counts), the streamed-layer path golden-exact on the CPU (every streamed
layer's weights copied in from its host copy before each use, through one shared staging set so
a missed copy shows), and the flag accepted by `serve`, a one-line no-op on the CPU."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from support_engine import RUNS, persona, run_slot, user_frames
from support_server import running_server
from test_generator_golden import check_run

from personaplex_voice.engine.factory import build_engine
from personaplex_voice.engine.generator import PersonaPlexEngine, golden_like_files
from personaplex_voice.engine.offload import CPU_NOTICE, OffloadedModel, offload_sizes
from personaplex_voice.engine.offload_plan import GIB, plan_offload, realtime_calls, spread
from personaplex_voice.errors import UserError
from personaplex_voice.model.config import ModelConfig
from personaplex_voice.model.offload import LayerStreamer, offload_layers

torch.set_num_threads(1)

# Free memory (GiB) as torch reports it once the CUDA context exists, per card size.
CARDS = {8: 7.6, 12: 11.5, 16: 15.5, 24: 23.2, 48: 47.0}
FIXED = 3 * GIB  # the CUDA reserve (2 GiB) + the default 1 GiB persona cache
CALLS = 4  # serve's default --max-sessions


@pytest.fixture(scope="module")
def sizes_7b():
    return offload_sizes(ModelConfig.personaplex_7b())


def plan(sizes, gb: int, calls: int = CALLS, **kwargs):
    return plan_offload(int(CARDS[gb] * GIB), sizes, calls, fixed_bytes=FIXED, **kwargs)


def test_the_7b_sizes_come_from_the_code(sizes_7b):
    assert sizes_7b.num_layers == 32
    # a temporal layer: 0.38 GiB in bfloat16, half of it (plus row scales) in int8
    assert 0.38 < sizes_7b.layer_bytes["bfloat16"] / GIB < 0.39
    assert 0.49 < sizes_7b.layer_bytes["int8"] / sizes_7b.layer_bytes["bfloat16"] < 0.51
    assert sizes_7b.per_call_bytes["float8"] < 0.6 * sizes_7b.per_call_bytes["auto"]


def test_a_48_gb_card_runs_the_model_as_asked(sizes_7b):
    p = plan(sizes_7b, 48)
    assert p.fits and (p.quantize, p.kv_dtype, p.offloaded) == (None, None, ())
    assert p.gpu_bytes <= p.free_bytes and p.transfer_bytes == 0


def test_a_24_gb_card_takes_int8_weights_first(sizes_7b):
    p = plan(sizes_7b, 24)
    assert p.fits and (p.quantize, p.kv_dtype, p.offloaded) == ("int8", None, ())
    assert not plan(sizes_7b, 24, quantize=None).steps[0].endswith("fits")  # bfloat16 did not fit


def test_a_16_gb_card_adds_an_fp8_cache_and_streams_nothing(sizes_7b):
    p = plan(sizes_7b, 16)
    assert p.fits and (p.quantize, p.kv_dtype, p.offloaded) == ("int8", "float8", ())
    # where the published --cpu-offload ran out of memory, ours carries more calls than asked
    assert p.max_calls >= 2 * CALLS


def test_a_12_gb_card_streams_the_fewest_layers_that_fit(sizes_7b):
    p = plan(sizes_7b, 12)
    assert p.fits and (p.quantize, p.kv_dtype) == ("int8", "float8")
    n = len(p.offloaded)
    assert 3 <= n < 32 and p.gpu_bytes <= p.free_bytes
    assert p.offloaded == spread(n, 32) and p.offloaded[-1] == 31
    assert len(set(p.offloaded)) == n and all(0 <= i < 32 for i in p.offloaded)
    # one layer fewer would not fit: the plan streams no more than it must
    layer = sizes_7b.layer_bytes["int8"]
    assert p.gpu_bytes + layer > p.free_bytes
    assert p.host_bytes == p.transfer_bytes == n * layer
    assert p.transfer_ms == pytest.approx(n * layer / 20e9 * 1000)
    # fewer calls need fewer layers streamed
    assert len(plan(sizes_7b, 12, calls=1).offloaded) < n


def test_an_8_gb_card_cannot_hold_four_calls_and_says_how_many(sizes_7b):
    p = plan(sizes_7b, 8)
    assert not p.fits and p.max_calls == 2 and len(p.offloaded) == 32
    two = plan(sizes_7b, 8, calls=2)
    assert two.fits and (two.quantize, two.kv_dtype) == ("int8", "float8") and len(two.offloaded) > 20
    # so many layers per tick cannot keep real time on PCIe: no call count is suggested
    assert realtime_calls(int(CARDS[8] * GIB), sizes_7b, CALLS, fixed_bytes=FIXED) == 0


def test_the_user_s_choices_are_kept(sizes_7b):
    assert plan(sizes_7b, 48, quantize="int8").quantize == "int8"
    p = plan(sizes_7b, 16, kv_dtype="bfloat16")  # no fp8 then: layers are streamed instead
    assert p.fits and (p.quantize, p.kv_dtype) == ("int8", "bfloat16") and p.offloaded
    assert plan(sizes_7b, 48, kv_dtype="float8").kv_dtype == "float8"


def test_realtime_suggestions_follow_the_link(sizes_7b):
    free = int(CARDS[12] * GIB)
    assert realtime_calls(free, sizes_7b, CALLS, fixed_bytes=FIXED, link_gb_s=1000.0) == CALLS
    slow = realtime_calls(free, sizes_7b, CALLS, fixed_bytes=FIXED, link_gb_s=25.0)
    assert 0 <= slow < CALLS
    assert spread(0, 32) == () and spread(32, 32) == tuple(range(32)) and spread(4, 32) == (7, 15, 23, 31)


def test_a_card_too_small_is_one_line(golden_dir):
    files = golden_like_files(golden_dir)
    with pytest.raises(UserError, match="cannot hold this model even with every layer in host memory"):
        OffloadedModel.load(
            files, "cpu", torch.float32, num_slots=1, free_bytes=1 << 20, persona_cache_bytes=0
        )


# ---------------------------------------------------------------------------------------------
# the streamed-layer path, golden-exact on the CPU


def streamed_engine(golden_dir, **options) -> tuple[PersonaPlexEngine, LayerStreamer]:
    engine = PersonaPlexEngine(golden_like_files(golden_dir), num_slots=1, capture_logits=True, **options)
    # both temporal layers streamed through ONE staging set: every use needs its own copy first
    streamer = offload_layers(engine.lm, [0, 1], "cpu", staging=1)
    return engine, streamer


@pytest.fixture(scope="module")
def expected(golden_dir):
    return np.load(golden_dir / "expected.npz")


@pytest.mark.parametrize("run", list(RUNS))
def test_streamed_layers_give_the_golden_tokens(golden_dir, expected, run):
    engine, streamer = streamed_engine(golden_dir)
    layer0 = engine.lm.transformer.layers[0].self_attn.in_proj_weight
    layer1 = engine.lm.transformer.layers[1].self_attn.in_proj_weight
    assert layer0.data_ptr() == layer1.data_ptr()  # one buffer for both: the copies matter
    engine.start(0, engine.prepare(persona(run)))
    before = streamer.copies
    frames = user_frames(golden_dir)
    check_run(run_slot(engine, 0, frames), expected, run)
    assert streamer.copies - before == 2 * len(frames)  # both layers, from the host, every step


def test_streamed_layers_with_the_stepwise_prefill_are_golden(golden_dir, expected):
    engine, _ = streamed_engine(golden_dir, prefill="stepwise")
    engine.start(0, engine.prepare(persona("pt_voice")))
    check_run(run_slot(engine, 0, user_frames(golden_dir)), expected, "pt_voice")


def test_a_missed_copy_changes_the_tokens(golden_dir, expected):
    """The golden check above would catch a streamer that forgot a copy: with the copies
    stopped after the prompt, layer 0 runs with layer 1's weights and the tokens leave golden."""
    engine, streamer = streamed_engine(golden_dir)
    engine.start(0, engine.prepare(persona("pt_voice")))
    streamer._load = lambda k, first=False: None  # type: ignore[method-assign]
    result = run_slot(engine, 0, user_frames(golden_dir))
    assert not np.array_equal(result.tokens, expected["pt_voice__tokens"])


# ---------------------------------------------------------------------------------------------
# the flag


def test_cpu_offload_on_the_cpu_changes_nothing_and_says_so(golden_dir, expected, caplog):
    with caplog.at_level(logging.WARNING):
        engine = build_engine(
            str(golden_dir), num_slots=1, device="cpu", cpu_offload=True, capture_logits=True
        )
    assert [r.getMessage() for r in caplog.records if "cpu-offload" in r.getMessage()] == [CPU_NOTICE]
    assert engine.offload is None
    engine.start(0, engine.prepare(persona("pt_voice")))
    check_run(run_slot(engine, 0, user_frames(golden_dir)), expected, "pt_voice")


@pytest.mark.timeout(240)
def test_serve_accepts_cpu_offload(golden_dir):
    with running_server(
        "--cpu-offload", "--max-sessions", "1", engine="model", model=str(golden_dir)
    ) as server:
        log = server.log()
        assert log.count(CPU_NOTICE) == 1
        assert "engine warmed up" in log
