"""The GPU tick's kernels, checked on the CPU: the length-aware decode attention and the other
fused kernels (Triton's interpreter) against the references they replace, on random data and in
the golden engine with slots at different fill levels, some idle; and the CPU's own cut of the
ring to its filled prefix, bit for bit against the whole ring."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from personaplex_voice.model.transformer import CPU_SDPA_KEY_BLOCK, _cpu_read_extent

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("queries", "filled"), [(1, 70), (1, 600), (2, 40), (64, 1100), (1, 2999)])
def test_the_cpu_prefix_read_is_bit_exact_against_the_whole_ring(queries: int, filled: int) -> None:
    """The CPU tick's SDPA reads the filled prefix cut at a multiple of torch's key block: the
    same bits as the whole ring (the published ring's masked oldest entry included)."""
    gen = torch.Generator().manual_seed(queries + filled)
    B, H, N, D = 3, 4, 3000, 16
    q = torch.randn(B, H, queries, D, generator=gen)
    k, v = torch.randn(B, H, N, D, generator=gen), torch.randn(B, H, N, D, generator=gen)
    mask = torch.zeros(B, 1, queries, N, dtype=torch.bool)
    mask[..., :filled] = True
    mask[..., 0] = False
    read = _cpu_read_extent(filled, N)
    assert read % CPU_SDPA_KEY_BLOCK == 0 or read == N
    assert read < N or filled > N - CPU_SDPA_KEY_BLOCK
    whole = F.scaled_dot_product_attention(q, k, v, mask)
    cut = F.scaled_dot_product_attention(q, k[:, :, :read], v[:, :, :read], mask[..., :read])
    assert torch.equal(whole, cut)


def test_a_short_ring_is_read_whole() -> None:
    assert _cpu_read_extent(40, 250) == 250  # below one key block: torch's blocks would change


ENGINE_CHECK = r"""
import sys, time
from pathlib import Path
import numpy as np, torch
sys.path.insert(0, "tests")
from support_engine import persona, user_frames
from personaplex_voice.engine.generator import PersonaPlexEngine, golden_like_files
from personaplex_voice.model import fused_ops, ring_attention, transformer

golden = Path(sys.argv[1])
# Triton's interpreter runs one Python loop per program: fewer, longer splits (three over the
# golden model's 3000-entry ring: still several to combine) keep this test to a minute or two.
ring_attention.SPLIT = 1024
FP8 = torch.float8_e4m3fn
frames = user_frames(golden)[:8]
# who is active on each tick: slot 0 from the start, slot 1 from tick 3, slot 2 never (idle),
# slot 3 every other tick: every slot at its own fill level
def pattern(i):
    return np.array([True, i >= 3, False, i % 2 == 0])

def run(ops, kv_dtype=None, whole_ring=False, frames=frames):
    started = time.time()
    saved = transformer._cpu_read_extent
    if whole_ring:  # today's static path: SDPA over the whole ring, whatever its fill
        transformer._cpu_read_extent = lambda filled, context: context
    try:
        files = golden_like_files(golden)
        engine = PersonaPlexEngine(files, num_slots=4, capture_logits=True, kv_dtype=kv_dtype)
        engine.use_static_tick(cuda_graph=False)
        for slot in range(4):  # the prompts by the references (the ticks are what is compared)
            engine.start(slot, engine.prepare(persona("pt_voice" if slot % 2 else "service")))
        fused_ops.set_fused_ops(engine.lm, ops)
        fused_ops.set_fused_ops(engine.mimi, [op for op in ops if op != "ring_attention"])
        tokens, logits = [], []
        for i, frame in enumerate(frames):
            pcm = np.stack([frame * (1 + 0.25 * b) for b in range(4)]).astype(np.float32)
            active = pattern(i)
            engine.step(pcm, active)
            tokens.append(np.where(active[:, None], engine.last_tokens, -1))
            logits.append(np.where(active[:, None], engine.last_text_logits, 0))
        lengths = engine.lm_state["transformer:pos"].tolist()
        print("run", ops, kv_dtype, round(time.time() - started, 1), "s", flush=True)
        return np.stack(tokens), np.stack(logits), lengths
    finally:
        transformer._cpu_read_extent = saved

def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())

ref_tokens, ref_logits, lengths = run([], whole_ring=True)
assert len(set(lengths)) == 4, lengths  # four fill levels (slot 2 only its prompt)
got_tokens, got_logits, _ = run(["ring_attention"])
np.testing.assert_array_equal(got_tokens, ref_tokens)
print("ring-vs-whole-ring", rel(got_logits, ref_logits))
assert rel(got_logits, ref_logits) < 1e-5
cpu_tokens, cpu_logits, _ = run([])
np.testing.assert_array_equal(cpu_tokens, ref_tokens)
assert np.array_equal(cpu_logits, ref_logits)  # the CPU's prefix cut: the same bits
# fp8 KV: the kernel reads e4m3 in registers, the reference converts the cache per layer
fp8_ref_tokens, fp8_ref_logits, _ = run([], kv_dtype=FP8, whole_ring=True)
fp8_tokens, fp8_logits, _ = run(["ring_attention"], kv_dtype=FP8)
print("fp8-ring-vs-convert", rel(fp8_logits, fp8_ref_logits))
assert rel(fp8_logits, fp8_ref_logits) < 1e-4
# every fused kernel at once: the GPU's tick, in float32
all_tokens, all_logits, _ = run(list(fused_ops.FUSED_OPS), frames=frames[:4])
ref_tokens, ref_logits = ref_tokens[:4], ref_logits[:4]
agreement = float((all_tokens == ref_tokens).mean())
print("all-fused-vs-reference", rel(all_logits, ref_logits), "tokens", agreement)
assert rel(all_logits, ref_logits) < 1e-4
np.testing.assert_array_equal(all_tokens[:, :, 0], ref_tokens[:, :, 0])
"""


def run_interpreted(script: str, *args: str) -> subprocess.CompletedProcess:
    pytest.importorskip("triton", reason="the Triton package (a dev dependency on Linux x86-64)")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-c", script, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.timeout(700)
def test_length_aware_decode_is_exact_against_the_whole_ring_on_the_golden_model(golden_dir) -> None:
    """Four slots at four fill levels (one idle the whole time, one every other tick), the
    static tick a CUDA graph replays: the length-aware kernel (Triton's interpreter) gives the
    whole-ring path's tokens, its float32 logits within 1e-5; with an fp8 cache within 1e-4 of
    the converting path; with every fused kernel on, the same text tokens, logits within 1e-4."""
    proc = run_interpreted(ENGINE_CHECK, str(golden_dir))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "ring-vs-whole-ring" in proc.stdout and "fp8-ring-vs-convert" in proc.stdout, proc.stdout


KERNEL_CHECK = r"""
import torch
from personaplex_voice.model import fused_checks, fused_ops, ring_attention
cpu = torch.device("cpu")
shape = {"dim": 96, "hidden": 80, "heads": 4, "head_dim": 16, "entries": 700, "kv_dtype": torch.float32,
         "steps": 16, "step_heads": 2, "step_head_dim": 16}
for op in fused_ops.FUSED_OPS:
    err32 = fused_checks.self_check(op, cpu, torch.float32, shape)
    err16 = fused_checks.self_check(op, cpu, torch.bfloat16, dict(shape, kv_dtype=torch.bfloat16))
    print(op, err32, err16)
    assert err32 < 1e-5, (op, err32)
    assert err16 < fused_checks.SELF_CHECK_TOLERANCE, (op, err16)
err = ring_attention.self_check(3, 2, 300, 24, cpu, torch.bfloat16, torch.float8_e4m3fn)
print("ring fp8", err)
assert err < ring_attention.SELF_CHECK_TOLERANCE
# an idle slot reads nothing and gets zeros; a short slot never reads past its length
q = torch.randn(2, 2, 1, 16)
k = torch.randn(2, 2, 600, 16)
k[1, :, 10:] = float("nan")  # past slot 1's length: a read would poison its row
mask = torch.ones(2, 1, 1, 600, dtype=torch.bool)
out = ring_attention.decode_attention(q, k, k, mask, torch.tensor([0, 10]))
assert torch.equal(out[0], torch.zeros(2, 1, 16)) and torch.isfinite(out[1]).all()
want = torch.nn.functional.scaled_dot_product_attention(q[1:], k[1:, :, :10], k[1:, :, :10])
assert float((out[1:] - want).abs().max()) < 1e-5
print("lengths ok")
"""


def test_fused_kernels_match_their_references() -> None:
    """Every fused kernel (Triton's interpreter) against its reference: float32 within 1e-5,
    bfloat16 within the self-check's tolerance; the decode kernel also reads an fp8 cache, and
    never an entry past a slot's length (NaN there would show)."""
    proc = run_interpreted(KERNEL_CHECK)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "lengths ok" in proc.stdout, proc.stdout


# ------------------------------------------------------------------ what runs, and every fallback


def test_an_engine_never_inherits_kernels_from_one_sharing_its_model(golden_dir) -> None:
    """bench/gpu_check builds one engine after another over one model: what a warm-up turned on
    for the previous engine (an fp8 row's decode kernel) must not run, or be reported, in the
    next (a bf16 or int8 row)."""
    from personaplex_voice.engine.generator import PersonaPlexEngine, golden_like_files
    from personaplex_voice.model import fused_ops

    first = PersonaPlexEngine(golden_like_files(golden_dir), num_slots=1)
    fused_ops.set_fused_ops(first.lm, fused_ops.FUSED_OPS)  # as a GPU warm-up would
    first.lm.transformer.sdpa_decode = ("flash",)
    assert fused_ops.fused_ops_in_use(first.lm) == list(fused_ops.FUSED_OPS)
    second = PersonaPlexEngine(golden_like_files(golden_dir), num_slots=1, models=(first.mimi, first.lm))
    assert fused_ops.fused_ops_in_use(second.lm) == [] and second.lm.transformer.sdpa_decode is None
    assert not any(layer.self_attn.ring_kernel for layer in second.lm.transformer.layers)
    second.warmup()
    assert second.tuning.report["fused_ops"] == [] and second.fallbacks == []
    assert second.tuning.report["kv_read"].startswith("filled prefix")


def test_every_kernel_that_fails_or_disagrees_is_a_fallback_with_its_reason(golden_dir, monkeypatch) -> None:
    """The warm-up's policy, with the GPU's answers injected: a kernel that raises, one off by
    more than the tolerance, `_int_mm` not usable: each keeps its reference and is listed in
    `fallbacks` with why; the ones that pass run (and the report says which)."""
    from personaplex_voice.engine import gpu_tuning
    from personaplex_voice.engine.generator import PersonaPlexEngine, golden_like_files
    from personaplex_voice.model import fused_ops

    engine = PersonaPlexEngine(golden_like_files(golden_dir), num_slots=2, quantize="int8")
    answers = {"norm": 1e-3, "silu_mul": RuntimeError("PTX too new for this driver"), "rope_write": 0.5}

    def check(op, device, dtype, shape):
        answer = answers.get(op, 1e-4)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(gpu_tuning.triton_kernels, "available", lambda device: True)
    monkeypatch.setattr(gpu_tuning.fused_checks, "self_check", check)
    monkeypatch.setattr(gpu_tuning, "int_mm_usable", lambda device: False)
    monkeypatch.setattr(gpu_tuning, "int_mm_failure", lambda device: "torch._int_mm failed: no kernel")
    tuning = engine.tuning
    tuning._int8(engine.lm, torch.device("cpu"))
    tuning._fused(engine.lm, engine.lm_state, torch.device("cpu"))
    used = fused_ops.fused_ops_in_use(engine.lm)
    assert used == ["norm", "ring_attention", "step_attention"]
    why = {entry["what"]: entry["reason"] for entry in tuning.fallbacks}
    assert "PTX too new" in why["fused silu_mul"] and "off by 0.5" in why["fused rope_write"]
    assert "no kernel" in why["int8 matmul (torch._int_mm)"] and len(why) == 3
    assert tuning.report["int8_matmul"] == "dequantise"
    assert not any(g.fused for layer in engine.lm.transformer.layers for g in [layer.gating])
