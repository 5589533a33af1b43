"""bench/gpu_check.py, the check first run on a GPU box, rehearsed on the CPU so that run does not
die on a typo: every part at tiny sizes (`--cpu-smoke`), one JSON line on stdout and in the file,
every field present, and on a machine like the GPU box (no serving packages, no soundfile) every
part but serving still runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What the GPU box lacks (it has no network to install them): the check must not need them.
ABSENT_ON_THE_GPU_BOX = (
    "soundfile", "soxr", "fastapi", "pydantic", "pydantic_settings", "uvicorn", "websockets", "opuslib",
    "pyloudnorm",
)  # fmt: skip
TICK_ROWS = ("bf16_1", "bf16_16", "bf16_64", "fp8_64", "fp8_96", "fp8_128", "eager_16", "int8_64")
ROW_FIELDS = (
    "slots", "captured", "mode", "capture_s", "pool_mib", "sdpa_decode", "sdpa_prefill", "kv_read",
    "first_tick_ms", "tick_ms_p50", "tick_ms_p99", "tick_ms_max", "prefill_chunk_ms", "memory_after_warmup",
)  # fmt: skip
MEMORY_FIELDS = ("allocated_gib", "max_allocated_gib", "free_gib", "total_gib")


def run_check(out: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    return subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), str(out), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def one_json_line(proc: subprocess.CompletedProcess, out: Path) -> dict:
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout[-2000:]
    result = json.loads(lines[0])
    assert json.loads(out.read_text()) == result
    return result


def test_cpu_smoke_without_the_serving_packages_runs_every_other_part(tmp_path: Path) -> None:
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    for name in ABSENT_ON_THE_GPU_BOX:
        (blocked / f"{name}.py").write_text('raise ImportError("not installed on this machine")\n')
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, PYTHONPATH=str(blocked), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--cpu-smoke", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = one_json_line(proc, out)
    assert result["complete"] and result["errors"] == [], result["errors"]
    assert result["versions"]["torch"] and "cudnn" in result["versions"] and "triton" in result["versions"]
    assert "Filesystem" in result["disk"]["df"]
    for phase in ("decode", "prefill"):
        assert result["sdpa"][phase]["ms"] and result["sdpa"][phase]["winner"] in result["sdpa"][phase]["ms"]
    for name in TICK_ROWS:
        row = result["ticks"][name]
        missing = [f for f in ROW_FIELDS if f not in row]
        assert not missing, (name, missing)
        assert row["captured"] is False and row["tick_ms_p50"] > 0 and row["first_tick_ms"] > 0, name
        assert row["tick_ms_p50"] <= row["tick_ms_p99"] <= row["tick_ms_max"]
        assert row["prefill_chunk_ms"] and result["prefill_chunks_ms"][name] == row["prefill_chunk_ms"]
    assert (
        result["ticks"]["int8_64"]["weights"] == "int8" and result["ticks"]["fp8_128"]["kv_dtype"] == "float8"
    )
    assert result["ticks"]["eager_16"]["mode"] == "eager" and result["ticks"]["eager_16"]["graphs"] is False
    for name in ("bf16_64", "fp8_128"):  # a CPU cannot say: nulls, but the fields are there
        assert result["memory"][name] == dict.fromkeys(MEMORY_FIELDS)
    assert result["graph_vs_eager_7b"]["exact"] and result["graph_vs_eager_7b"]["ticks"] == 10
    assert result["int8_kernels"]["int8_int_mm_ms"] is not None
    correctness = result["correctness"]
    assert correctness["model"] == "golden"  # read with the standard library's wave
    assert correctness["fp32_device_vs_published"]["exact"] and correctness["graphs_vs_eager"]["exact"]
    for mode in ("bf16", "bf16_stepwise", "int8", "fp8_kv"):
        assert 0 <= correctness[f"{mode}_vs_fp32"]["text_agreement"] <= 1
    assert result["load"]["load_s"] > 0 and result["load"]["checkpoint_gb"] > 0
    skipped = result["serving"]["skipped"]
    assert "\n" not in skipped and "fastapi" in skipped and "opuslib" in skipped
    assert "serving: skipped" in proc.stderr


def test_the_script_serves_when_its_packages_are_there(tmp_path: Path) -> None:
    """Through bench/gpu_check.sh (what the GPU box runs): the serving part with two callers."""
    out = tmp_path / "result" / "gpu_check.json"
    proc = run_check(out, "--cpu-smoke", "--parts", "serving")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = one_json_line(proc, out)
    assert result["complete"] and result["errors"] == [], result["errors"]
    serving = result["serving"]
    assert serving["calls_completed"] == serving["callers"] == 2 and serving["calls_failed"] == 0
    assert serving["received_audio_ratio_min"] > 0.5


def test_no_gpu_still_gives_a_json_line(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--out", str(out), "--device", "cuda"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["error"] == "torch sees no CUDA device" and json.loads(out.read_text()) == result
    assert set(result["ticks"]) == set(TICK_ROWS)  # the fields are there, empty
