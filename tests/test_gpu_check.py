"""bench/gpu_check.sh, the check first run on a GPU box, rehearsed on the CPU so that run does not
die on a typo: every part at tiny sizes (`--cpu-smoke`), one JSON line on stdout and in the file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_check(out: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    return subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), str(out), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_cpu_smoke_runs_every_part_and_writes_one_json_line(tmp_path: Path) -> None:
    out = tmp_path / "result" / "gpu_check.json"
    proc = run_check(out, "--cpu-smoke")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert json.loads(out.read_text()) == result
    assert result["complete"] and result["errors"] == [], result["errors"]
    correctness = result["correctness"]
    assert correctness["fp32_device_vs_cpu"]["exact"] and correctness["graphs_vs_eager"]["exact"]
    for mode in ("bf16", "bf16_stepwise", "int8", "fp8_kv"):
        assert 0 <= correctness[f"{mode}_vs_fp32"]["text_agreement"] <= 1
    speed = result["speed"]
    assert speed["load_bf16"]["seconds"] > 0 and speed["load_int8"]["host_peak_rss_mb"] > 0
    for table in ("tick_bf16", "tick_bf16_fp8_kv", "tick_bf16_eager", "tick_int8"):
        assert speed[table] and all(row["tick_ms_p50"] > 0 for row in speed[table].values()), table
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
