"""bench/gpu_check.py, the check first run on a GPU box, rehearsed on the CPU so that run does not
die on a typo: every part at tiny sizes (`--cpu-smoke`), one JSON line on stdout and in the file,
every row appended to the rows file as it finishes, every field present, and on a machine like
the GPU box (no serving packages, no soundfile) every part but serving still runs; killed in the
middle, it keeps what finished and leaves no subprocess and no large file behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
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
    "fused_ops", "int8_matmul", "fallbacks", "wide_captured",
    "first_tick_ms", "tick_ms_p50", "tick_ms_p99", "tick_ms_max", "prefill_chunk_ms", "memory_after_warmup",
)  # fmt: skip
MEMORY_FIELDS = ("allocated_gib", "max_allocated_gib", "free_gib", "total_gib")


def run_check(
    out: Path, *args: str, timeout: float = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", **(env or {}))
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
    # every row and part in the rows file, each the moment it finished, in the order run
    rows = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    parts = [row["part"] for row in rows]
    assert parts[:3] == ["versions", "disk", "sdpa"] and parts[-1] == "serving", parts
    assert [p for p in parts if p.startswith("ticks.")] == [f"ticks.{n}" for n in TICK_ROWS]
    by_part = {row.pop("part"): row for row in rows}
    row = dict(by_part["ticks.bf16_64"])
    row.pop("elapsed_s")
    assert row == result["ticks"]["bf16_64"]
    assert "correctness.fp32_graphs" in by_part and "load" in by_part
    assert [r["elapsed_s"] for r in rows] == sorted(r["elapsed_s"] for r in rows)
    # the log beside it holds every line whole (a row's JSON too)
    log = out.with_suffix(".log").read_text()
    assert 'row {"part": "ticks.int8_64"' in log and "versions {" in log
    # a CPU runs the references: no fused kernel to check, none to fall back from
    assert result["fallbacks"] == [] and result["ticks"]["bf16_64"]["fused_ops"] == []


def test_the_script_serves_when_its_packages_are_there(tmp_path: Path) -> None:
    """Through bench/gpu_check.sh (what the GPU box runs): the serving part with two callers,
    with what the GPU box lacks and the check does not need (soundfile, pyloudnorm,
    cryptography, scipy) unimportable; the server's log beside the result."""
    out = tmp_path / "result" / "gpu_check.json"
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    for name in ("soundfile", "pyloudnorm", "cryptography", "scipy"):
        (blocked / f"{name}.py").write_text('raise ImportError("not installed on this machine")\n')
    proc = run_check(out, "--cpu-smoke", "--parts", "serving", env={"PYTHONPATH": str(blocked)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = one_json_line(proc, out)
    assert result["complete"] and result["errors"] == [], result["errors"]
    serving = result["serving"]
    assert serving["calls_completed"] == serving["callers"] == 2 and serving["calls_failed"] == 0
    assert serving["received_audio_ratio_min"] > 0.5
    assert "Finished server process" in out.with_suffix(".server.log").read_text()
    assert "[gpu_check.sh] running bench/gpu_check.py" in out.with_suffix(".log").read_text()


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


# ---------------------------------------------------------------------------------------------
# stopped in the middle: what finished stays, nothing is left running or lying around


def wait_for(predicate, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def processes_in_session(sid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def test_sigterm_after_the_first_tick_row_keeps_it_and_leaves_nothing(tmp_path: Path) -> None:
    """bench/gpu_check.sh killed (SIGTERM, as a timeout or the device tool would) right after
    the first tick row: that row is in the rows file, the summary says it stopped, no process of
    the run is left, and its work directory (where the 16.7 GB checkpoint goes) is gone."""
    out, work = tmp_path / "out" / "gpu_check.json", tmp_path / "work"
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    command = ["bash", str(ROOT / "bench" / "gpu_check.sh"), str(out), "--cpu-smoke"]
    proc = subprocess.Popen(
        [*command, "--parts", "speed,load", "--work-dir", str(work)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    rows = out.with_suffix(".jsonl")
    try:
        wait_for(lambda: any('"part": "ticks.' in line for line in lines(rows)), "the first tick row")
        first = next(json.loads(line) for line in lines(rows) if '"part": "ticks.' in line)
        assert any(work.iterdir())  # the run's work directory exists while it runs
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    kept = [json.loads(line) for line in lines(rows)]
    assert first in kept and kept[-1]["part"] == "stopped" and kept[-1]["signal"] == "SIGTERM"
    result = json.loads(out.read_text())
    assert result["stopped"].startswith("SIGTERM") and not result["complete"]
    assert result["ticks"][first["part"].removeprefix("ticks.")]["tick_ms_p50"] > 0
    assert "stopped by SIGTERM" in result["error"]
    assert processes_in_session(proc.pid) == []
    assert not any(p.is_file() for p in work.rglob("*")), list(work.rglob("*"))
    assert "got SIGTERM: passing it on to the check" in out.with_suffix(".log").read_text()


def test_sigterm_while_serving_ends_the_server_too(tmp_path: Path) -> None:
    """The serving part's server runs in a process group of its own: a SIGTERM to the check
    while callers are on ends it (and anything it started)."""
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_check.py"),
            "--cpu-smoke",
            "--parts",
            "serving",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    log = out.with_suffix(".log")
    try:
        wait_for(lambda: any("server ready" in line for line in lines(log)), "the server")
        server = int(re.search(r"server started \(pid (\d+)\)", log.read_text()).group(1))
        assert Path(f"/proc/{server}").exists()
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143
    assert processes_in_session(server) == []  # the server's group: gone, none left behind
    result = json.loads(out.read_text())
    assert result["stopped"].startswith("SIGTERM") and result["serving"] is None
