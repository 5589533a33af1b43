"""The one prepared GPU check: what the first GPU run must settle, most important first.

    bench/gpu_check.sh OUT.json            # on the GPU box (finds a python with CUDA torch, runs this)
    python bench/gpu_check.py --out OUT.json [--device cuda] [--budget-s 450]
    python bench/gpu_check.py --cpu-smoke --out OUT.json   # the same code paths, tiny, on a CPU

Prints progress on stderr and ONE JSON line on stdout (also written to --out after every part,
so a crash keeps what was measured). Every part and every row fails soft: an error or an
out-of-memory is recorded under its name (`{"error": ...}`) and the rest runs; a row that would
not fit the time budget is recorded as skipped. Every field below is always present (null
where the machine cannot say, e.g. memory on a CPU).

Order (the first minutes answer the most):
1. `versions` (python, torch, CUDA, cuDNN, Triton, the device) and `disk` (`df -hT`);
2. `sdpa`: per-backend ms at the decode shape (64 slots x 32 heads x 1 query x 3000 keys, ring
   mask) and a prefill chunk (64 queries), and the winner (bench/sdpa_backends.py);
3. `ticks`: the personaplex-7b-v1 architecture with random weights built directly on the GPU
   (seconds, no file): bfloat16 at 1/16/64 slots, fp8 KV at 64/96/128, eager at 16, int8 weights
   at 64; each row: graph captured or not (and the capture's pool), the pinned attention, how the
   KV cache is read, first tick, p50/p99/max over the ticks (every slot active, sampling), every
   prefill chunk's ms, memory after warm-up; `memory` repeats it for bf16 at 64 and fp8 at 128;
4. `graph_vs_eager_7b`: greedy tokens of a graph and an eager engine, 16 slots, 10 ticks;
   `prefill_chunks_ms`: each row's chunks; `int8_kernels`: the int8 matmuls side by side;
5. `correctness`: the golden model (./shared/golden, ../shared/golden or $GOLDEN; read with the
   standard library's `wave`), float32 device vs CPU, graphs vs eager, and the agreement of
   bfloat16, stepwise, int8 and fp8-KV with float32;
6. `load`: the 7B file written to disk and loaded cold (last: a slow disk costs only itself);
7. `serving`: a real server with simulated callers, only when its packages import (else
   skipped in one line, no time reserved).
In `--cpu-smoke` the rows keep their names but run a tiny model at 1-3 slots (`slots` in each).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
import wave
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from check_record import CheckRecord, Children, Stopped, ignore_signals, stop_on_signals  # noqa: E402

from personaplex_voice.engine import generator  # noqa: E402
from personaplex_voice.engine.base import FRAME_SIZE, Persona, Sampling  # noqa: E402
from personaplex_voice.engine.generator import PersonaPlexEngine  # noqa: E402
from personaplex_voice.model.config import ModelConfig  # noqa: E402
from personaplex_voice.model.lm import LMModel  # noqa: E402
from personaplex_voice.model.loaders import host_peak_rss_mb, load_lm, load_mimi, reset_host_peak  # noqa: E402
from personaplex_voice.model.quant import quantize_model_, set_int8_matmul  # noqa: E402
from personaplex_voice.model.safetensors_io import TensorSpec, save_state_dict, write_safetensors  # noqa: E402
from personaplex_voice.model.sources import ModelFiles  # noqa: E402

CHECK = "personaplex-voice gpu_check v3"
PROMPT = "You work for a waste management company and your name is Ayelen. Be helpful and concise."
GOLDEN_PROMPT = "You enjoy having a good conversation."
FP8 = torch.float8_e4m3fn
CORRECTNESS_RUNS = ("fp32_eager", "fp32_graphs", "bf16", "bf16_stepwise", "int8", "fp8_kv", "fp32_references")
GIB = 2**30
# What the serving part imports (absent on the GPU box, which has no network): checked first;
# libopus through the project's own loader (the offline bundle puts it where only that looks).
SERVING_PACKAGES = ("fastapi", "uvicorn", "pydantic", "pydantic_settings", "websockets", "soxr")
TICK_ROWS = ("bf16_1", "bf16_16", "bf16_64", "fp8_64", "fp8_96", "fp8_128", "eager_16", "int8_64")
MEMORY_ROWS = ("bf16_64", "fp8_128")


RECORD: CheckRecord | None = None  # set by main(): the rows file and the log beside --out
CHILDREN = Children()


def say(message: str) -> None:
    if RECORD is not None:
        RECORD.say(message)
    else:
        print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def record_row(part: str, value: Any) -> None:
    if RECORD is not None:
        RECORD.row(part, value)


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def error_entry(exc: BaseException) -> dict[str, Any]:
    kind = "out of memory" if isinstance(exc, torch.cuda.OutOfMemoryError) else type(exc).__name__
    full = "".join(traceback.format_exception(exc))
    return {"error": f"{kind}: {' '.join(str(exc).split())[:300]}", "where": full[-600:], "traceback": full}


def soft(results: dict[str, Any], name: str, fn: Callable[[], Any], part: str | None = None) -> Any:
    """results[name] = fn(), or the error it raised; memory is released either way. The result
    is appended to the rows file at once, as part `part` (default `name`)."""
    started = time.monotonic()
    try:
        value = fn()
        results[name] = value
        return value
    except Exception as exc:
        entry = error_entry(exc)
        trace = entry.pop("traceback")  # whole in the log; the JSON keeps its tail ("where")
        results[name] = entry
        say(f"{name}: {entry['error']}\n{trace}")
        return None
    finally:
        release_memory()
        if name in results:
            record_row(part or name, results[name])
        say(f"{name} done in {time.monotonic() - started:.1f} s")


def release_memory() -> None:
    gc.collect()  # engines, graphs and modules reference each other
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def memory_now(device: str) -> dict[str, Any]:
    """max_memory_allocated and mem_get_info (GiB); nulls on a CPU."""
    if not device.startswith("cuda"):
        return {"allocated_gib": None, "max_allocated_gib": None, "free_gib": None, "total_gib": None}
    free, total = torch.cuda.mem_get_info()
    return {
        "allocated_gib": round(torch.cuda.memory_allocated() / GIB, 2),
        "max_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 2),
        "free_gib": round(free / GIB, 2),
        "total_gib": round(total / GIB, 2),
    }


class ByteTokenizer:
    """Stands in for SentencePiece in the speed runs (random weights: only prompt lengths matter)."""

    vocab_size = 256

    def __init__(self, path: Any = None):
        pass

    def encode(self, text: str) -> list[int]:
        return [4 + b % 250 for b in text.encode()][: len(text.split()) * 2]

    def display_piece(self, token_id: int) -> str | None:
        return None


@contextlib.contextmanager
def byte_tokenizer() -> Iterator[None]:
    saved = generator.TextTokenizer
    generator.TextTokenizer = ByteTokenizer  # type: ignore[misc, assignment]
    try:
        yield
    finally:
        generator.TextTokenizer = saved  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------
# 1. versions, disk


def versions(device: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "triton": None,
        "numpy": np.__version__,
        "device": device,
        "capability": None,
        "gpu_total_gib": None,
        "driver": None,
        "sdpa_kernel_api": importlib.util.find_spec("torch.nn.attention") is not None,
    }
    with contextlib.suppress(Exception):
        import triton

        out["triton"] = triton.__version__
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(
            device=props.name,
            capability=f"{props.major}.{props.minor}",
            gpu_total_gib=round(props.total_memory / GIB, 1),
        )
        with contextlib.suppress(Exception):
            smi = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            out["driver"] = subprocess.run(smi, capture_output=True, text=True, timeout=10).stdout.strip()
    return out


def disk(work: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"work_dir": str(work), "free_gb": round(shutil.disk_usage(work).free / 1e9, 1)}
    try:
        df = subprocess.run(["df", "-hT", str(work), "/tmp"], capture_output=True, text=True, timeout=10)
        out["df"] = df.stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        out["df"] = f"df failed: {exc}"
    return out


# ---------------------------------------------------------------------------------------------
# 2. attention


def sdpa(device: str, plan: dict[str, Any]) -> dict[str, Any]:
    from sdpa_backends import measure

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    shape = plan["sdpa"]
    return measure(device, dtype=dtype, **shape)


# ---------------------------------------------------------------------------------------------
# 3. ticks


def write_voice(path: Path, cfg: ModelConfig, steps: int) -> None:
    lm = cfg.lm
    emb = torch.randn(steps, 1, 1, lm.dim, generator=torch.Generator().manual_seed(1)) * 0.02
    cache = torch.full((1, lm.num_streams, max(lm.delays) + 3), lm.card, dtype=torch.long)
    cache[0, 0] = lm.text_card
    torch.save({"embeddings": emb, "cache": cache}, path)


def files_of(cfg: ModelConfig, root: Path, lm: Path | None = None) -> ModelFiles:
    return ModelFiles(
        name=str(root),
        config=cfg,
        lm_weights=lm,
        mimi_weights=None,
        tokenizer=root / "tokenizer.model",
        voice_dirs=(root / "voices",),
        lm_dtype_in_file="bfloat16",
    )


def tick_row(
    files: ModelFiles,
    models: tuple[Any, LMModel],
    device: str,
    slots: int,
    ticks: int,
    *,
    graphs: bool,
    kv_dtype: torch.dtype | None = None,
    weights: str = "bfloat16",
) -> dict[str, Any]:
    """One engine: warm-up (capture), a prompt into slot 0 (every chunk timed), the others
    restored from its snapshot, then `ticks` ticks with every slot active and sampling."""
    row: dict[str, Any] = {
        "slots": slots,
        "weights": weights,
        "kv_dtype": "float8" if kv_dtype is FP8 else "bfloat16",
        "graphs": graphs,
        "captured": False,
    }
    on_gpu = device.startswith("cuda")
    started = time.monotonic()
    engine = PersonaPlexEngine(
        files, slots, device, torch.bfloat16, models=models, kv_dtype=kv_dtype, cuda_graphs=graphs and on_gpu
    )
    if graphs and not on_gpu:
        engine.use_static_tick(cuda_graph=False)  # the path the graph replays, eagerly
    row["build_s"] = round(time.monotonic() - started, 2)
    try:
        t0 = time.monotonic()
        engine.warmup()
        row["warmup_s"] = round(time.monotonic() - t0, 2)
    finally:
        row.update(engine.graph_info)
        row.update(kernels_of(engine))
    row["memory_after_warmup"] = memory_now(device)
    prepared = engine.prepare(Persona(text_prompt=PROMPT, voice="RANDOM.pt", sampling=Sampling(), seed=1))
    job = engine.begin_start(0, prepared)
    while not job.run_chunk():
        pass
    row["prefill_steps"] = prepared.prompt_steps
    row["prefill_chunk_ms"] = [round(ms, 2) for ms in job.chunk_ms]
    row["prefill_ms"] = round(sum(job.chunk_ms), 1)
    snap = engine.snapshot(0)
    for slot in range(1, slots):
        engine.restore(slot, snap, prepared)
    rng = np.random.default_rng(0)
    pcm = (0.05 * rng.standard_normal((slots, FRAME_SIZE))).astype(np.float32)
    active = np.ones(slots, dtype=bool)
    times = []
    for _ in range(ticks + 1):
        t0 = time.perf_counter()
        engine.step(pcm, active)  # returns host arrays: includes the device sync
        times.append(1000 * (time.perf_counter() - t0))
    first, rest = times[0], sorted(times[1:])
    row.update(
        first_tick_ms=round(first, 2),
        ticks=len(rest),
        tick_ms_p50=round(statistics.median(rest), 2),
        tick_ms_p99=round(rest[min(len(rest) - 1, int(0.99 * len(rest)))], 2),
        tick_ms_max=round(rest[-1], 2),
        realtime=bool(rest[-1] < 80.0),
        memory_after_ticks=memory_now(device),
    )
    del engine, snap, job
    return row


def kernels_of(engine: PersonaPlexEngine) -> dict[str, Any]:
    """What this engine's tick ran, as its warm-up set it (each engine starts from the
    references: nothing carries over from the row before), and every fallback with its reason."""
    report = engine.tuning.report
    return {
        "sdpa_decode": report.get("sdpa_decode"),
        "sdpa_prefill": report.get("sdpa_prefill"),
        "kv_read": report.get("kv_read"),
        "fused_ops": report.get("fused_ops"),
        "int8_matmul": report.get("int8_matmul"),
        "fallbacks": engine.fallbacks,
    }


def graph_vs_eager(
    files: ModelFiles, models: tuple[Any, LMModel], device: str, slots: int, ticks: int
) -> dict:
    """Greedy tokens of a graph engine and an eager one, same inputs: are they the same?"""
    rows: dict[str, np.ndarray] = {}
    rng = np.random.default_rng(1)
    frames = (0.05 * rng.standard_normal((ticks, slots, FRAME_SIZE))).astype(np.float32)
    captured = None
    for mode in ("graph", "eager"):
        graphs = mode == "graph"
        engine = PersonaPlexEngine(
            files,
            slots,
            device,
            torch.bfloat16,
            models=models,
            cuda_graphs=graphs and device.startswith("cuda"),
        )
        if graphs and not device.startswith("cuda"):
            engine.use_static_tick(cuda_graph=False)
        engine.warmup()
        if graphs:
            captured = engine.graph_info.get("captured")
        prepared = engine.prepare(
            Persona(text_prompt=PROMPT, voice="RANDOM.pt", sampling=Sampling(greedy=True))
        )
        engine.start(0, prepared)
        snap = engine.snapshot(0)
        for slot in range(1, slots):
            engine.restore(slot, snap, prepared)
        out = []
        for frame in frames:
            engine.step(frame, np.ones(slots, dtype=bool))
            out.append(engine.last_tokens.copy())
        rows[mode] = np.stack(out)
        del engine, snap
        release_memory()
    same = rows["graph"] == rows["eager"]
    mismatched_ticks = np.flatnonzero(~same.reshape(ticks, -1).all(axis=1))
    return {
        "slots": slots,
        "ticks": ticks,
        "graph_captured": captured,
        "exact": bool(same.all()),
        "token_agreement": round(float(same.mean()), 4),
        "first_mismatch_tick": int(mismatched_ticks[0]) if len(mismatched_ticks) else None,
    }


def int8_kernels(device: str, plan: dict[str, Any]) -> dict[str, Any]:
    """ms per matmul x [M, K] @ w [N, K]^T: bf16 dense, dequantise + dense, torch._int_mm
    (int8 activations, fused), torch._weight_int8pack_mm; and the fused path's error."""
    from personaplex_voice.model.quant import (
        Int8Weight,
        dequant_linear,
        int_mm_failure,
        int_mm_linear,
        int_mm_usable,
    )

    m, k, n = plan["int8_shape"]
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) * 0.02).to(device, dtype)
    q8 = Int8Weight.quantize(w)
    out: dict[str, Any] = {"shape": [m, k, n], "int_mm_usable": int_mm_usable(torch.device(device))}
    if not out["int_mm_usable"]:
        reason = int_mm_failure(torch.device(device)) or "not usable here"
        out["fallbacks"] = [{"what": "int8 matmul (torch._int_mm)", "reason": reason}]
    kernels = {
        "bf16_dense": lambda: torch.nn.functional.linear(x, w),
        "int8_dequant": lambda: dequant_linear(x, q8.q, q8.scale),
        "int8_int_mm": lambda: int_mm_linear(x, q8.q, q8.scale),
        "int8pack_mm": lambda: torch._weight_int8pack_mm(x, q8.q, q8.scale.to(dtype)),
    }
    for name, fn in kernels.items():
        try:
            for _ in range(3):
                fn()
            synchronize(device)
            t0 = time.perf_counter()
            for _ in range(20):
                fn()
            synchronize(device)
            out[f"{name}_ms"] = round(1000 * (time.perf_counter() - t0) / 20, 4)
        except Exception as exc:
            out[f"{name}_ms"] = None
            out[f"{name}_error"] = error_entry(exc)["error"]
    with contextlib.suppress(Exception):
        want = dequant_linear(x, q8.q, q8.scale).float()
        got = int_mm_linear(x, q8.q, q8.scale).float()
        out["int_mm_rel_error"] = float((got - want).abs().max() / want.abs().max())
    return out


def speed(
    device: str, cfg: ModelConfig, work: Path, deadline: Deadline, plan: dict[str, Any], result: dict
) -> None:
    """Parts 3 and 4, on weights built on the device (no file): fills result's tick sections."""
    voices = work / "voices"
    voices.mkdir(exist_ok=True)
    write_voice(voices / "RANDOM.pt", cfg, steps=plan["voice_steps"])
    files = files_of(cfg, work)
    ticks = plan["ticks"]
    rows: dict[str, Any] = result["ticks"]

    t0 = time.monotonic()
    torch.manual_seed(0)
    mimi = load_mimi(cfg, None, device)
    lm = load_lm(cfg, None, device, torch.bfloat16)  # random weights drawn on the device
    synchronize(device)
    result["build_random_model_s"] = round(time.monotonic() - t0, 1)
    say(f"random model built on {device} in {result['build_random_model_s']} s")

    def run(name: str, **options: Any) -> None:
        slots = plan["slots"][name]
        if deadline.left() < plan["min_left_s"]:
            rows[name] = {"skipped": "time", "slots": slots, "captured": None}
            record_row(f"ticks.{name}", rows[name])
            return
        value = soft(
            rows,
            name,
            lambda: tick_row(files, (mimi, lm), device, slots, ticks, **options),
            part=f"ticks.{name}",
        )
        if value is None:
            rows[name].update(slots=slots, captured=False)

    with byte_tokenizer():
        for name in ("bf16_1", "bf16_16", "bf16_64"):
            run(name, graphs=True)
        for name in ("fp8_64", "fp8_96", "fp8_128"):
            run(name, graphs=True, kv_dtype=FP8)
        run("eager_16", graphs=False)
        if deadline.left() > plan["min_left_s"]:
            n = plan["slots"]["graph_vs_eager"]
            soft(result, "graph_vs_eager_7b", lambda: graph_vs_eager(files, (mimi, lm), device, n, 10))
        else:
            result["graph_vs_eager_7b"] = {"skipped": "time"}
        kernels: dict[str, Any] = {}
        soft(kernels, "int8_kernels", lambda: int8_kernels(device, plan))
        result["int8_kernels"] = kernels["int8_kernels"]
        if deadline.left() > plan["min_left_s"]:
            quantize_model_(lm)  # in place: the bfloat16 rows are done
            set_int8_matmul(lm, "auto")
            release_memory()
            run("int8_64", graphs=True, weights="int8")
        else:
            rows["int8_64"] = {"skipped": "time", "slots": plan["slots"]["int8_64"], "captured": None}
    for name in MEMORY_ROWS:
        row = rows.get(name) or {}
        result["memory"][name] = row.get("memory_after_warmup") or memory_now("cpu") | {"error": "row failed"}
    result["prefill_chunks_ms"] = {name: (rows.get(name) or {}).get("prefill_chunk_ms") for name in TICK_ROWS}


# ---------------------------------------------------------------------------------------------
# 5. correctness


def find_golden() -> Path | None:
    for candidate in (
        os.environ.get("GOLDEN"),
        ROOT / "shared" / "golden",
        ROOT.parent / "shared" / "golden",
    ):
        if candidate and (Path(candidate) / "config.json").is_file():
            return Path(candidate)
    return None


def read_wav(path: Path) -> np.ndarray:
    """Mono 16-bit PCM as float32 in [-1, 1) (what soundfile gives), with the standard library."""
    with wave.open(str(path), "rb") as wav:
        if wav.getsampwidth() != 2:
            raise ValueError(f"{path}: expected 16-bit PCM, got {8 * wav.getsampwidth()}-bit")
        data = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2")
        channels = wav.getnchannels()
    pcm = data.astype(np.float32) / 32768.0
    return pcm.reshape(-1, channels)[:, 0] if channels > 1 else pcm


def greedy_rows(
    files: ModelFiles, device: str, dtype: torch.dtype, frames: np.ndarray, voice, **options
) -> np.ndarray:
    static_on_cpu = options.pop("static_on_cpu", False)
    ran = options.pop("ran", None)  # what the engine's tick ran (kernels_of), filled in
    engine = PersonaPlexEngine(files, 1, device, dtype, **options)
    if static_on_cpu:
        engine.use_static_tick(cuda_graph=False)
    engine.warmup()  # on a GPU: the kernels checked and turned on, as serving runs them
    if ran is not None:
        ran.update(kernels_of(engine))
    prepared = engine.prepare(Persona(text_prompt=GOLDEN_PROMPT, voice=voice, sampling=Sampling(greedy=True)))
    engine.start(0, prepared)
    rows = []
    for frame in frames:
        engine.step(frame[None], np.ones(1, dtype=bool))
        rows.append(engine.last_tokens[0].copy())
    return np.stack(rows)


def agreement(rows: np.ndarray, reference: np.ndarray, n_audio: int) -> dict[str, Any]:
    text = rows[:, 0] == reference[:, 0]
    audio = rows[:, 1 : 1 + n_audio] == reference[:, 1 : 1 + n_audio]
    mismatch = np.flatnonzero(~np.all(rows == reference, axis=1))
    return {
        "exact": bool(len(mismatch) == 0),
        "text_agreement": round(float(text.mean()), 4),
        "audio_agreement": round(float(audio.mean()), 4),
        "first_mismatch_step": int(mismatch[0]) if len(mismatch) else None,
    }


def correctness(device: str, frames_n: int, work: Path) -> dict[str, Any]:
    from personaplex_voice.engine.generator import golden_like_files

    out: dict[str, Any] = {}
    golden = find_golden()
    if golden is not None:
        files = golden_like_files(golden)
        voice = "TINYF0.pt"
        pcm = read_wav(golden / "user.wav")
        out["model"] = "golden"
    else:
        from personaplex_voice.model.demo import demo_config, train_tokenizer

        cfg = demo_config()
        root = work / "tiny"
        (root / "voices").mkdir(parents=True, exist_ok=True)
        (root / cfg.text_tokenizer).write_bytes(train_tokenizer())
        torch.manual_seed(0)
        save_state_dict(
            root / "mimi.safetensors",
            {k: v.contiguous() for k, v in load_mimi(cfg, None).state_dict().items()},
        )
        lm = load_lm(cfg, None, "cpu", torch.float32)
        save_state_dict(
            root / "model.safetensors",
            {k: v.to(torch.bfloat16).contiguous() for k, v in lm.state_dict().items()},
        )
        (root / "config.json").write_text(json.dumps(cfg.to_dict() | {"lm_dtype_in_file": "bfloat16"}))
        write_voice(root / "voices" / "RANDOM.pt", cfg, steps=10)
        files = golden_like_files(root)
        voice = "RANDOM.pt"
        pcm = (0.05 * np.random.default_rng(0).standard_normal(frames_n * FRAME_SIZE)).astype(np.float32)
        out["model"] = "tiny random (no golden files found: copy ../shared/golden to ./shared/golden)"
    n = min(frames_n, -(-len(pcm) // FRAME_SIZE))
    pcm = np.pad(pcm, (0, max(0, n * FRAME_SIZE - len(pcm))))
    frames = pcm[: n * FRAME_SIZE].reshape(n, FRAME_SIZE)
    n_audio = files.config.mimi.num_codebooks
    out["frames"] = n
    on_gpu = device.startswith("cuda")
    if on_gpu:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    graph_options = {"cuda_graphs": True} if on_gpu else {"static_on_cpu": True}
    cpu = greedy_rows(files, "cpu", torch.float32, frames, voice, cuda_graphs=False)
    ran: dict[str, dict[str, Any]] = {name: {} for name in CORRECTNESS_RUNS}

    def rows_of(name: str, dtype: torch.dtype, **options: Any) -> Callable[[], np.ndarray]:
        return lambda: greedy_rows(files, device, dtype, frames, voice, ran=ran[name], **options)

    runs: dict[str, Callable[[], np.ndarray]] = {
        "fp32_eager": rows_of("fp32_eager", torch.float32, cuda_graphs=False),
        "fp32_graphs": rows_of("fp32_graphs", torch.float32, **graph_options),
        "bf16": rows_of("bf16", torch.bfloat16, **graph_options),
        "bf16_stepwise": rows_of("bf16_stepwise", torch.bfloat16, prefill="stepwise", **graph_options),
        "int8": rows_of("int8", torch.bfloat16, quantize="int8", **graph_options),
        "fp8_kv": rows_of("fp8_kv", torch.bfloat16, kv_dtype=FP8, **graph_options),
        # the references everywhere (no fused kernel): does the GPU's kernel path change tokens?
        "fp32_references": rows_of("fp32_references", torch.float32, fused="off", **graph_options),
    }
    rows: dict[str, Any] = {}
    for name, run in runs.items():
        if soft(rows, name, run, part=f"correctness.{name}") is None:
            out[name] = rows[name]
    out["kernels"] = ran
    fp32 = rows.get("fp32_eager")
    if isinstance(fp32, np.ndarray):
        out["fp32_device_vs_cpu"] = agreement(fp32, cpu, n_audio)
        if isinstance(rows.get("fp32_graphs"), np.ndarray):
            out["graphs_vs_eager"] = agreement(rows["fp32_graphs"], fp32, n_audio)
    fused, plain = rows.get("fp32_graphs"), rows.get("fp32_references")
    if isinstance(fused, np.ndarray) and isinstance(plain, np.ndarray):
        out["fused_vs_references"] = agreement(fused, plain, n_audio)
    reference = fp32 if isinstance(fp32, np.ndarray) else cpu
    for name in ("bf16", "bf16_stepwise", "int8", "fp8_kv"):
        if isinstance(rows.get(name), np.ndarray):
            out[f"{name}_vs_fp32"] = agreement(rows[name], reference, n_audio)
    if golden is not None and isinstance(fp32, np.ndarray):
        expected = np.load(golden / "expected.npz")["pt_voice__tokens"][:n]
        out["fp32_device_vs_published"] = agreement(fp32, expected, n_audio)
        out["fp32_cpu_vs_published"] = agreement(cpu, expected, n_audio)
    return out


# ---------------------------------------------------------------------------------------------
# 6. file write + cold load


def pattern_producer(scale: float = 0.02) -> Callable[[TensorSpec], torch.Tensor]:
    """Random-looking tensors made fast: one random block, tiled (norms and codebook counts = 1)."""
    block = (torch.randn(1 << 20, generator=torch.Generator().manual_seed(0)) * scale).float()

    def produce(spec: TensorSpec) -> torch.Tensor:
        n = 1
        for size in spec.shape:
            n *= size
        if spec.name.endswith(("alpha", "cluster_usage", "_initialized")) or not spec.dtype.is_floating_point:
            return torch.ones(spec.shape, dtype=spec.dtype)
        reps = -(-n // block.numel())
        return block.repeat(reps)[:n].view(spec.shape).to(spec.dtype)

    return produce


def write_random_lm(cfg: ModelConfig, path: Path, dtype: torch.dtype = torch.bfloat16) -> int:
    with torch.device("meta"):
        lm = LMModel(cfg.lm)
    specs = [TensorSpec(name, dtype, tuple(t.shape)) for name, t in lm.state_dict().items()]
    return write_safetensors(path, specs, pattern_producer())


def evict_from_page_cache(path: Path) -> bool:
    """Drop the file's pages from the page cache (no root needed), so a load reads the disk."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return True
    except (OSError, AttributeError):
        return False


def file_load(device: str, cfg: ModelConfig, work: Path, deadline: Deadline, plan: dict[str, Any]) -> dict:
    needed = plan["load_min_left_s"]
    if deadline.left() < needed:
        return {"skipped": f"time (needs {needed} s)"}
    with torch.device("meta"):
        size = sum(t.numel() * 2 for t in LMModel(cfg.lm).state_dict().values())
    free = shutil.disk_usage(work).free
    if free < size * 1.2:
        return {"skipped": f"disk: {free / 1e9:.1f} GB free for a {size / 1e9:.1f} GB file"}
    out: dict[str, Any] = {}
    path = work / "random-lm.safetensors"
    try:
        t0 = time.monotonic()
        out["checkpoint_gb"] = round(write_random_lm(cfg, path) / 1e9, 2)
        out["write_s"] = round(time.monotonic() - t0, 1)
        out["evicted_from_page_cache"] = evict_from_page_cache(path)
        release_memory()
        reset_host_peak()
        t0 = time.perf_counter()
        lm = load_lm(cfg, path, device, torch.bfloat16)
        synchronize(device)
        out["load_s"] = round(time.perf_counter() - t0, 2)
    finally:  # 16.7 GB: not a byte longer than the load needs it
        path.unlink(missing_ok=True)
    out["host_peak_rss_mb"] = round(host_peak_rss_mb(), 0)
    out["gpu_max_allocated_gib"] = memory_now(device)["max_allocated_gib"]
    del lm
    return out


# ---------------------------------------------------------------------------------------------
# 7. serving


def missing_serving_packages() -> list[str]:
    missing = []
    for name in SERVING_PACKAGES:
        try:
            importlib.import_module(name)
        except Exception:
            missing.append(name)
    try:
        from personaplex_voice.audio.opus_library import OpusUnavailableError, require_opus
    except ImportError as exc:  # the audio package itself needs one of the above (soxr)
        missing.append(f"opuslib/libopus (not checked: {exc})")
        return missing
    try:
        require_opus()  # $PERSONAPLEX_LIBOPUS, <prefix>/lib/personaplex-voice/, the system's
    except OpusUnavailableError as exc:
        missing.append(f"opuslib/libopus ({' '.join(str(exc).split())[:160]})")
    return missing


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    values: dict[str, float] = {}
    for name in (
        "late_frames_total",
        "dropped_output_frames_total",
        "tick_overruns_total",
        "ticks_total",
        "tick_seconds_sum",
        "tick_seconds_count",
    ):
        match = re.search(rf"^personaplex_{name} (\S+)$", text, re.M)
        values[name] = float(match.group(1)) if match else 0.0
    return values


async def caller(url: str, seconds: float, delay: float) -> dict[str, Any]:
    from websockets.asyncio.client import connect

    from personaplex_voice.audio.opus import OggOpusReader, OggOpusWriter

    await asyncio.sleep(delay)
    writer, reader = OggOpusWriter(24000), OggOpusReader(24000)
    received = 0
    handshake = asyncio.Event()
    rng = np.random.default_rng(int(delay * 1000))
    frames = int(seconds * 12.5)
    t_connect = time.monotonic()
    async with connect(url, max_size=None, open_timeout=120, compression=None, proxy=None) as ws:

        async def receive() -> None:
            nonlocal received
            async for message in ws:
                if message[:1] == b"\x00":
                    handshake.set()
                elif message[:1] == b"\x01":
                    received += sum(len(p) for p in reader.feed(message[1:]))

        task = asyncio.create_task(receive())
        await asyncio.wait_for(handshake.wait(), 120)
        handshake_s = time.monotonic() - t_connect
        start = time.monotonic()
        for k in range(frames):
            chunk = (0.05 * rng.standard_normal(FRAME_SIZE)).astype(np.float32)
            await ws.send(b"\x01" + writer.write(chunk))
            await asyncio.sleep(max(0.0, start + (k + 1) * 0.08 - time.monotonic()))
        await asyncio.sleep(0.5)  # the last frames' answers
        await ws.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 5)
    return {"handshake_s": handshake_s, "received_s": received / 24000, "sent_s": frames * 0.08}


async def callers(url: str, n: int, seconds: float) -> list[Any]:
    return await asyncio.gather(*(caller(url, seconds, 0.02 * i) for i in range(n)), return_exceptions=True)


def model_dir(cfg: ModelConfig, root: Path, device: str) -> Path:
    """A model directory (golden layout): random weights, a demo tokenizer, one voice."""
    from personaplex_voice.model.demo import train_tokenizer

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg.to_dict()))
    write_random_lm(cfg, root / "model.safetensors")
    torch.manual_seed(0)
    mimi = load_mimi(cfg, None, device)
    save_state_dict(
        root / "mimi.safetensors", {k: v.cpu().contiguous() for k, v in mimi.state_dict().items()}
    )
    del mimi
    release_memory()
    (root / cfg.text_tokenizer).write_bytes(train_tokenizer())
    (root / "voices").mkdir(exist_ok=True)
    write_voice(root / "voices" / "RANDOM.pt", cfg, steps=40)
    return root


def serving(device: str, cfg: ModelConfig, work: Path, plan: dict[str, Any], deadline: Deadline) -> dict:
    missing = missing_serving_packages()
    if missing:
        return {"skipped": f"packages not importable: {', '.join(missing)}"}
    if deadline.left() < plan["serving_min_left_s"]:
        return {"skipped": "time"}
    out: dict[str, Any] = {"callers": plan["callers"], "seconds": plan["call_s"]}
    root = work / "served"
    shutil.rmtree(root, ignore_errors=True)
    model_dir(cfg, root, device)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = RECORD.out.with_suffix(".server.log") if RECORD is not None else work / "server.log"
    command = [
        sys.executable, "-m", "personaplex_voice.cli", "serve",
        "--model", str(root), "--device", device, "--max-sessions", str(plan["callers"]),
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "info", *plan["serve_args"],
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    started = time.monotonic()
    with open(log_path, "wb") as log:  # its own process group: ended whole, whatever happens
        server = CHILDREN.start(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    say(f"server started (pid {server.pid}), its log: {log_path}")
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited ({server.returncode}): {log_tail(log_path)}")
            if deadline.left() < plan["call_s"] + 20:
                raise RuntimeError(f"the server was not ready in time: {log_tail(log_path)}")
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(url + "/readyz", timeout=2).status == 200:
                    break
            time.sleep(1.0)
        out["ready_s"] = round(time.monotonic() - started, 1)
        say(f"server ready in {out['ready_s']} s")
        before = scrape(url)
        ws_url = f"ws://127.0.0.1:{port}/api/chat?text_prompt=You+are+helpful.&voice_prompt=RANDOM.pt"
        results = asyncio.run(callers(ws_url, plan["callers"], plan["call_s"]))
        after = scrape(url)
        good = [r for r in results if isinstance(r, dict)]
        failed = [repr(r)[:200] for r in results if not isinstance(r, dict)]
        delta = {k: after[k] - before[k] for k in after}
        served = max(1, len(good))
        ticks = delta["tick_seconds_count"] or 1
        out.update(
            calls_completed=len(good),
            calls_failed=len(failed),
            failures=failed[:3],
            late_frames_per_call=round(delta["late_frames_total"] / served, 2),
            dropped_output_frames=int(delta["dropped_output_frames_total"]),
            tick_overruns=int(delta["tick_overruns_total"]),
            tick_ms_mean=round(1000 * delta["tick_seconds_sum"] / ticks, 2),
            received_audio_ratio_min=round(min((r["received_s"] / r["sent_s"] for r in good), default=0), 3),
            received_audio_ratio_mean=round(statistics.fmean(r["received_s"] / r["sent_s"] for r in good), 3)
            if good
            else 0,
            handshake_s_max=round(max((r["handshake_s"] for r in good), default=0), 2),
        )
        return out
    finally:
        CHILDREN.stop(server)


def log_tail(path: Path, chars: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


# ---------------------------------------------------------------------------------------------


def plans(cpu_smoke: bool) -> dict[str, Any]:
    if cpu_smoke:
        from personaplex_voice.model.demo import demo_config

        return {
            "architecture": "tiny (CPU smoke)",
            "config": demo_config(),
            "sdpa": {"slots": 2, "heads": 2, "keys": 64, "head_dim": 16, "chunk": 8, "reps": 2},
            "slots": {
                "bf16_1": 1,
                "bf16_16": 2,
                "bf16_64": 3,
                "fp8_64": 2,
                "fp8_96": 2,
                "fp8_128": 3,
                "eager_16": 2,
                "int8_64": 2,
                "graph_vs_eager": 2,
            },
            "int8_shape": (32, 64, 96),
            "correct_frames": 8,
            "ticks": 3,
            "voice_steps": 10,
            "min_left_s": 5,
            "load_min_left_s": 10,
            "serving_min_left_s": 30,
            "callers": 2,
            "call_s": 3.0,
            "serve_args": ["--threads", "1"],
        }
    return {
        "architecture": "personaplex-7b-v1, random bfloat16 weights built on the device",
        "config": ModelConfig.personaplex_7b(),
        "sdpa": {"slots": 64, "heads": 32, "keys": 3000, "head_dim": 128, "chunk": 64, "reps": 10},
        "slots": {
            "bf16_1": 1,
            "bf16_16": 16,
            "bf16_64": 64,
            "fp8_64": 64,
            "fp8_96": 96,
            "fp8_128": 128,
            "eager_16": 16,
            "int8_64": 64,
            "graph_vs_eager": 16,
        },
        "int8_shape": (64, 4096, 12288),
        "correct_frames": 40,
        "ticks": 40,
        "voice_steps": 120,
        "min_left_s": 45,
        "load_min_left_s": 90,
        "serving_min_left_s": 120,
        "callers": 64,
        "call_s": 30.0,
        "serve_args": [],
    }


def skeleton(args: argparse.Namespace, device: str) -> dict[str, Any]:
    """Every field of the JSON, present from the start (null until measured)."""
    return {
        "check": CHECK,
        "cpu_smoke": args.cpu_smoke,
        "setup": json.loads(os.environ.get("GPU_CHECK_SETUP", "{}") or "{}"),
        "rows_file": str(args.out.with_suffix(".jsonl")),
        "log_file": str(args.out.with_suffix(".log")),
        "stopped": None,
        "versions": None,
        "disk": None,
        "sdpa": None,
        "build_random_model_s": None,
        "ticks": {name: None for name in TICK_ROWS},
        "memory": {name: None for name in MEMORY_ROWS},
        "graph_vs_eager_7b": None,
        "prefill_chunks_ms": {name: None for name in TICK_ROWS},
        "int8_kernels": None,
        "correctness": None,
        "load": None,
        "serving": None,
    }


def main() -> None:
    global RECORD
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budget-s", type=float, default=450.0, help="stop starting new work after this")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU (tests)")
    parser.add_argument("--parts", default="sdpa,speed,correctness,load,serving")
    parser.add_argument("--work-dir", type=Path, default=None, help="where files go (the load part: 17 GB)")
    args = parser.parse_args()
    started = time.monotonic()
    RECORD = CheckRecord(args.out, started)
    stop_on_signals()  # a timeout's SIGTERM: what finished is kept, children end, files go
    deadline = Deadline(args.budget_s)
    device = "cpu" if args.cpu_smoke else args.device
    plan = plans(args.cpu_smoke)
    result = skeleton(args, device)
    work: Path | None = None
    try:
        result["architecture"] = plan["architecture"]
        result["versions"] = versions(device)
        work_parent = args.work_dir or Path(tempfile.gettempdir())
        work_parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="gpu_check-", dir=work_parent))
        result["disk"] = disk(work)
        record_row("versions", result["versions"])
        record_row("disk", result["disk"])
        say(f"versions {json.dumps(result['versions'])}")
        if device.startswith("cuda") and not torch.cuda.is_available():
            result["error"] = "torch sees no CUDA device"
            record_row("error", {"error": result["error"]})
        else:
            run_parts(args, device, plan, deadline, work, result, started)
    except Stopped as stop:
        ignore_signals()
        result["stopped"] = f"{stop.signal_name} after {time.monotonic() - started:.0f} s"
        say(f"stopped by {stop.signal_name}: ending the subprocesses, deleting {work}; what finished is kept")
        record_row("stopped", {"signal": stop.signal_name})
    finally:
        ignore_signals()
        CHILDREN.stop_all()
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    line = write_result(args.out, result, started, complete=result["stopped"] is None)
    print(line, flush=True)
    if result["stopped"] is not None:
        sys.exit(143)


def run_parts(
    args: argparse.Namespace,
    device: str,
    plan: dict[str, Any],
    deadline: Deadline,
    work: Path,
    result: dict[str, Any],
    started: float,
) -> None:
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)) if not args.cpu_smoke else 1)
    parts = set(args.parts.split(","))
    cfg = plan["config"]
    with torch.no_grad():
        if "sdpa" in parts:
            soft(result, "sdpa", lambda: sdpa(device, plan))
            write_result(args.out, result, started, complete=False)
        if "speed" in parts:
            try:
                speed(device, cfg, work, deadline, plan, result)
            except Exception as exc:  # the model could not even be built
                result["speed_error"] = error_entry(exc)
                record_row("speed_error", result["speed_error"])
            release_memory()
            write_result(args.out, result, started, complete=False)
        if "correctness" in parts:
            soft(result, "correctness", lambda: correctness(device, plan["correct_frames"], work))
            write_result(args.out, result, started, complete=False)
        if "load" in parts:
            soft(result, "load", lambda: file_load(device, cfg, work, deadline, plan))
            write_result(args.out, result, started, complete=False)
        if "serving" in parts:
            soft(result, "serving", lambda: serving(device, cfg, work, plan, deadline))
            if "skipped" in (result.get("serving") or {}):
                say(f"serving: skipped ({result['serving']['skipped']})")


def write_result(out: Path, result: dict[str, Any], started: float, complete: bool) -> str:
    """The JSON line, written to `out` after every part (a crash later keeps what was measured).
    `errors`: where an error was recorded; `fallbacks`: every fallback any part took, with its
    reason (a kernel that failed its check, `_int_mm`, an attention pin, a capture)."""
    result["complete"] = complete
    result["seconds"] = round(time.monotonic() - started, 1)
    result["errors"] = sorted(find_errors(result))
    result["fallbacks"] = list(find_fallbacks(result))
    line = json.dumps(result, default=str)
    if RECORD is not None:
        return RECORD.summary(result)
    with contextlib.suppress(OSError):
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(line + "\n")
    return line


def find_errors(value: Any, path: str = "") -> Iterator[str]:
    """Where in the result an error was recorded ("ticks.bf16_64", ...)."""
    if isinstance(value, dict):
        if "error" in value and isinstance(value["error"], str):
            yield path or "."
        for key, item in value.items():
            if key not in ("error", "errors", "fallbacks"):
                yield from find_errors(item, f"{path}.{key}" if path else str(key))


def find_fallbacks(value: Any, path: str = "") -> Iterator[dict[str, str]]:
    """Every fallback recorded anywhere in the result, with where ("ticks.fp8_128", ...)."""
    if isinstance(value, dict):
        own = value.get("fallbacks") if path else None  # the top level's is this very list
        for entry in own or []:
            if isinstance(entry, dict):
                yield {"where": path, **entry}
        for key, item in value.items():
            if key not in ("fallbacks", "errors"):
                yield from find_fallbacks(item, f"{path}.{key}" if path else str(key))


if __name__ == "__main__":
    main()
