"""The one prepared GPU check: correctness, speed and serving of the engine on a CUDA GPU.

    bench/gpu_check.sh OUT.json            # on the GPU box (sets up what it needs, then runs this)
    python bench/gpu_check.py --out OUT.json [--device cuda] [--budget-s 450]
    python bench/gpu_check.py --cpu-smoke --out OUT.json   # the same code paths, tiny, on a CPU

Prints progress on stderr and ONE JSON line on stdout (also written to --out). Every part and
every sub-measurement fails soft: an error or an out-of-memory is recorded in the JSON under
its name (`{"error": ...}`) and the rest still runs. A time budget skips what would not fit.

(a) `correctness`: on the golden model (../shared/golden, ./shared/golden or $GOLDEN; else a
    tiny random model made here), greedy: float32 CUDA vs float32 CPU tokens (exact expected,
    TF32 off), CUDA graphs vs eager (exact expected), and the agreement with float32 of
    bfloat16, bfloat16 stepwise, int8 weights and fp8 KV cache (reported); with the golden
    file, float32 CUDA vs the published tokens.
(b) `speed`: the full personaplex-7b-v1 architecture with random bfloat16 weights, written to a
    real safetensors file first: load time and peak host / GPU memory (file evicted from the
    page cache first), then per slot count the CUDA-graph tick (all slots active, sampling),
    the first tick after `warmup()`, the prefill of a voice + text prompt; bfloat16 KV at
    1/8/16/32/48/64 slots, fp8 KV at 96/128, int8 weights at 1/64 (bfloat16 KV) and 96/128
    (fp8 KV); eager vs graphs at 16; int8 matmul kernels side by side.
(c) `serving`: `personaplex-voice serve` on that random 7B (64 slots) in a subprocess, 64
    simulated /api/chat callers streaming Ogg-Opus in real time for 30 s: late frames per
    call (server metrics), audio received per call, tick times.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from personaplex_voice.engine import generator  # noqa: E402
from personaplex_voice.engine.base import FRAME_SIZE, Persona, Sampling  # noqa: E402
from personaplex_voice.engine.generator import PersonaPlexEngine  # noqa: E402
from personaplex_voice.model.config import ModelConfig  # noqa: E402
from personaplex_voice.model.lm import LMModel  # noqa: E402
from personaplex_voice.model.loaders import host_peak_rss_mb, load_lm, load_mimi, reset_host_peak  # noqa: E402
from personaplex_voice.model.safetensors_io import TensorSpec, save_state_dict, write_safetensors  # noqa: E402
from personaplex_voice.model.sources import ModelFiles  # noqa: E402

PROMPT = "You work for a waste management company and your name is Ayelen. Be helpful and concise."
GOLDEN_PROMPT = "You enjoy having a good conversation."
FP8 = torch.float8_e4m3fn
GIB = 2**30


def say(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def error_entry(exc: BaseException) -> dict[str, Any]:
    kind = "out of memory" if isinstance(exc, torch.cuda.OutOfMemoryError) else type(exc).__name__
    tail = "".join(traceback.format_exception(exc)[-3:])[-600:]
    return {"error": f"{kind}: {str(exc)[:300]}", "where": tail}


def soft(results: dict[str, Any], name: str, fn: Callable[[], Any]) -> Any:
    """results[name] = fn(), or the error it raised; memory is released either way."""
    started = time.monotonic()
    try:
        value = fn()
        results[name] = value
        return value
    except Exception as exc:
        results[name] = error_entry(exc)
        say(f"{name}: {results[name]['error']}")
        return None
    finally:
        release_memory()
        say(f"{name} done in {time.monotonic() - started:.1f} s")


def release_memory() -> None:
    gc.collect()  # engines, graphs and modules reference each other
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def gpu_peak_gib(device: str) -> float | None:
    return round(torch.cuda.max_memory_allocated() / GIB, 2) if device.startswith("cuda") else None


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
# model files


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


def write_voice(path: Path, cfg: ModelConfig, steps: int) -> None:
    lm = cfg.lm
    emb = torch.randn(steps, 1, 1, lm.dim, generator=torch.Generator().manual_seed(1)) * 0.02
    cache = torch.full((1, lm.num_streams, max(lm.delays) + 3), lm.card, dtype=torch.long)
    cache[0, 0] = lm.text_card
    torch.save({"embeddings": emb, "cache": cache}, path)


def model_dir(cfg: ModelConfig, root: Path, device: str, lm_file: Path | None = None) -> Path:
    """A model directory (golden layout): random weights (the LM file given, linked, or a new one),
    a demo tokenizer and one random voice `RANDOM.pt`."""
    from personaplex_voice.model.demo import train_tokenizer

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg.to_dict()))
    if lm_file is None:
        write_random_lm(cfg, root / "model.safetensors")
    else:
        try:
            os.link(lm_file, root / "model.safetensors")
        except OSError:
            shutil.copy(lm_file, root / "model.safetensors")
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


def files_of(
    cfg: ModelConfig, root: Path, lm: Path | None = None, tokenizer: Path | None = None
) -> ModelFiles:
    return ModelFiles(
        name=str(root),
        config=cfg,
        lm_weights=lm,
        mimi_weights=None,
        tokenizer=tokenizer or root / "tokenizer.model",
        voice_dirs=(root / "voices",),
        lm_dtype_in_file="bfloat16",
    )


def find_golden() -> Path | None:
    for candidate in (
        os.environ.get("GOLDEN"),
        ROOT / "shared" / "golden",
        ROOT.parent / "shared" / "golden",
    ):
        if candidate and (Path(candidate) / "config.json").is_file():
            return Path(candidate)
    return None


def tiny_config() -> ModelConfig:
    from personaplex_voice.model.demo import demo_config

    return demo_config()


# ---------------------------------------------------------------------------------------------
# (a) correctness


def greedy_rows(
    files: ModelFiles, device: str, dtype: torch.dtype, frames: np.ndarray, voice, **options
) -> np.ndarray:
    engine = PersonaPlexEngine(files, 1, device, dtype, **options)
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
        import soundfile as sf

        pcm = sf.read(golden / "user.wav", dtype="float32")[0]
        out["model"] = "golden"
    else:
        cfg = tiny_config()
        root = model_dir(cfg, work / "tiny", "cpu")
        files = golden_like_files(root)
        voice = "RANDOM.pt"
        pcm = (0.05 * np.random.default_rng(0).standard_normal(frames_n * FRAME_SIZE)).astype(np.float32)
        out["model"] = "tiny random (no golden files found)"
    n = min(frames_n, len(pcm) // FRAME_SIZE)
    frames = pcm[: n * FRAME_SIZE].reshape(n, FRAME_SIZE)
    n_audio = files.config.mimi.num_codebooks
    out["frames"] = n
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    cpu = greedy_rows(files, "cpu", torch.float32, frames, voice, cuda_graphs=False)
    runs: dict[str, Callable[[], np.ndarray]] = {
        "fp32_eager": lambda: greedy_rows(files, device, torch.float32, frames, voice, cuda_graphs=False),
        "fp32_graphs": lambda: graphed_rows(files, device, torch.float32, frames, voice),
        "bf16": lambda: graphed_rows(files, device, torch.bfloat16, frames, voice),
        "bf16_stepwise": lambda: graphed_rows(
            files, device, torch.bfloat16, frames, voice, prefill="stepwise"
        ),
        "int8": lambda: graphed_rows(files, device, torch.bfloat16, frames, voice, quantize="int8"),
        "fp8_kv": lambda: graphed_rows(files, device, torch.bfloat16, frames, voice, kv_dtype=FP8),
    }
    rows: dict[str, np.ndarray] = {}
    for name, run in runs.items():
        value = soft(rows, name, run)
        if value is None:
            out[name] = rows[name]
    if "fp32_eager" in rows and isinstance(rows["fp32_eager"], np.ndarray):
        out["fp32_device_vs_cpu"] = agreement(rows["fp32_eager"], cpu, n_audio)
        if isinstance(rows.get("fp32_graphs"), np.ndarray):
            out["graphs_vs_eager"] = agreement(rows["fp32_graphs"], rows["fp32_eager"], n_audio)
    reference = rows.get("fp32_eager") if isinstance(rows.get("fp32_eager"), np.ndarray) else cpu
    for name in ("bf16", "bf16_stepwise", "int8", "fp8_kv"):
        if isinstance(rows.get(name), np.ndarray):
            out[f"{name}_vs_fp32"] = agreement(rows[name], reference, n_audio)
    if golden is not None and isinstance(rows.get("fp32_eager"), np.ndarray):
        expected = np.load(golden / "expected.npz")["pt_voice__tokens"][:n]
        out["fp32_device_vs_published"] = agreement(rows["fp32_eager"], expected, n_audio)
        out["fp32_cpu_vs_published"] = agreement(cpu, expected, n_audio)
    return out


def graphed_rows(files, device, dtype, frames, voice, **options) -> np.ndarray:
    if device.startswith("cuda"):
        return greedy_rows(files, device, dtype, frames, voice, cuda_graphs=True, **options)
    engine_rows = _static_tick_rows(files, device, dtype, frames, voice, **options)
    return engine_rows


def _static_tick_rows(files, device, dtype, frames, voice, **options) -> np.ndarray:
    """CPU smoke: the static-buffer path the CUDA graph replays, run eagerly."""
    engine = PersonaPlexEngine(files, 1, device, dtype, cuda_graphs=False, **options)
    engine.use_static_tick(cuda_graph=False)
    engine.start(
        0, engine.prepare(Persona(text_prompt=GOLDEN_PROMPT, voice=voice, sampling=Sampling(greedy=True)))
    )
    rows = []
    for frame in frames:
        engine.step(frame[None], np.ones(1, dtype=bool))
        rows.append(engine.last_tokens[0].copy())
    return np.stack(rows)


# ---------------------------------------------------------------------------------------------
# (b) speed


def tick_run(
    files: ModelFiles, models, device: str, n: int, ticks: int, graphs: bool, kv_dtype=None
) -> dict[str, Any]:
    started = time.monotonic()
    engine = PersonaPlexEngine(
        files,
        n,
        device,
        torch.bfloat16,
        models=models,
        kv_dtype=kv_dtype,
        cuda_graphs=graphs and device != "cpu",
    )
    if graphs and device == "cpu":
        engine.use_static_tick(cuda_graph=False)
    build_s = time.monotonic() - started
    t0 = time.monotonic()
    engine.warmup()
    warmup_s = time.monotonic() - t0
    prepared = engine.prepare(Persona(text_prompt=PROMPT, voice="RANDOM.pt", sampling=Sampling(), seed=1))
    synchronize(device)
    t0 = time.perf_counter()
    job = engine.begin_start(0, prepared)
    chunk_ms = []
    while True:
        c0 = time.perf_counter()
        done = job.run_chunk()
        synchronize(device)
        chunk_ms.append(1000 * (time.perf_counter() - c0))
        if done:
            break
    prefill_ms = 1000 * (time.perf_counter() - t0)
    snap = engine.snapshot(0)
    for slot in range(1, n):
        engine.restore(slot, snap, prepared)
    rng = np.random.default_rng(0)
    pcm = (0.05 * rng.standard_normal((n, FRAME_SIZE))).astype(np.float32)
    active = np.ones(n, dtype=bool)
    times = []
    for _ in range(ticks + 1):
        t0 = time.perf_counter()
        engine.step(pcm, active)  # returns host arrays: includes the device sync
        times.append(1000 * (time.perf_counter() - t0))
    first, rest = times[0], times[1:]
    result = {
        "tick_ms_p50": round(statistics.median(rest), 2),
        "tick_ms_mean": round(statistics.fmean(rest), 2),
        "tick_ms_max": round(max(rest), 2),
        "first_tick_ms": round(first, 2),
        "prefill_ms": round(prefill_ms, 1),
        "prefill_steps": prepared.prompt_steps,
        "prefill_chunk_ms_max": round(max(chunk_ms), 2),
        "warmup_s": round(warmup_s, 2),
        "build_s": round(build_s, 2),
        "gpu_peak_gib": gpu_peak_gib(device),
        "realtime": bool(max(rest) < 80.0),
    }
    del engine, snap
    return result


def int8_kernels(device: str) -> dict[str, Any]:
    """ms per matmul [64, 4096] x [12288, 4096]: bf16 dense, dequantise + dense, _weight_int8pack_mm."""
    from torch.nn import functional as F

    x = torch.randn(64, 4096, device=device, dtype=torch.bfloat16)
    w = torch.randn(12288, 4096, device=device, dtype=torch.bfloat16) * 0.02
    q = torch.randint(-127, 127, w.shape, device=device, dtype=torch.int8)
    s = torch.rand(w.shape[0], device=device, dtype=torch.bfloat16)
    out: dict[str, Any] = {}
    kernels = {
        "bf16_dense": lambda: F.linear(x, w),
        "int8_dequant": lambda: F.linear(x, q.to(x.dtype)) * s,
        "int8pack_mm": lambda: torch._weight_int8pack_mm(x, q, s),
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
            out[f"{name}_ms"] = error_entry(exc)["error"]
    return out


def speed(
    device: str, cfg: ModelConfig, work: Path, deadline: Deadline, plan: dict[str, Any]
) -> dict[str, Any]:
    out: dict[str, Any] = {"architecture": plan["architecture"]}
    lm_path = work / "random-lm.safetensors"
    t0 = time.monotonic()
    size = write_random_lm(cfg, lm_path)
    out["checkpoint_gb"] = round(size / 1e9, 2)
    out["write_s"] = round(time.monotonic() - t0, 1)
    out["evicted_from_page_cache"] = evict_from_page_cache(lm_path)
    voices = work / "voices"
    voices.mkdir(exist_ok=True)
    write_voice(voices / "RANDOM.pt", cfg, steps=plan["voice_steps"])
    files = files_of(cfg, work, lm=lm_path)

    def load(quantize: str | None) -> LMModel:
        release_memory()
        reset_host_peak()
        started = time.perf_counter()
        lm = load_lm(cfg, lm_path, device, torch.bfloat16, quantize=quantize)
        synchronize(device)
        key = "load_int8" if quantize else "load_bf16"
        out[key] = {
            "seconds": round(time.perf_counter() - started, 2),
            "host_peak_rss_mb": round(host_peak_rss_mb(), 0),
            "gpu_gib": gpu_peak_gib(device),
        }
        say(f"{key}: {out[key]}")
        return lm

    torch.manual_seed(0)
    mimi = load_mimi(cfg, None, device)
    ticks = plan["ticks"]
    with byte_tokenizer():
        lm = load(None)
        rows: dict[str, Any] = {}
        for n in plan["bf16_slots"]:
            if deadline.left() < plan["min_left_s"]:
                rows[str(n)] = "skipped: time"
                continue
            soft(rows, str(n), lambda n=n, m=(mimi, lm): tick_run(files, m, device, n, ticks, graphs=True))
            say(f"bf16 {n} slots: {rows[str(n)]}")
        out["tick_bf16"] = rows
        rows = {}
        for n in plan["fp8_slots"]:
            if deadline.left() < plan["min_left_s"]:
                rows[str(n)] = "skipped: time"
                continue
            soft(rows, str(n), lambda n=n, m=(mimi, lm): tick_run(files, m, device, n, ticks, True, FP8))
            say(f"bf16 + fp8 KV {n} slots: {rows[str(n)]}")
        out["tick_bf16_fp8_kv"] = rows
        eager: dict[str, Any] = {}
        if deadline.left() > plan["min_left_s"]:
            n = plan["eager_slots"]
            soft(eager, str(n), lambda m=(mimi, lm): tick_run(files, m, device, n, ticks, graphs=False))
        out["tick_bf16_eager"] = eager
        del lm
        release_memory()
        out["int8_kernels"] = soft({}, "int8_kernels", lambda: int8_kernels(device))
        if deadline.left() > plan["min_left_s"]:
            lm8 = soft(out, "load_int8_model", lambda: load("int8"))
            if lm8 is not None:
                out.pop("load_int8_model", None)
                rows = {}
                for n, kv in plan["int8_slots"]:
                    name = f"{n}{'_fp8_kv' if kv is not None else ''}"
                    if deadline.left() < plan["min_left_s"]:
                        rows[name] = "skipped: time"
                        continue
                    soft(
                        rows,
                        name,
                        lambda n=n, kv=kv, m=(mimi, lm8): tick_run(files, m, device, n, ticks, True, kv),
                    )
                    say(f"int8 {name}: {rows[name]}")
                out["tick_int8"] = rows
                del lm8
    del mimi
    return out


# ---------------------------------------------------------------------------------------------
# (c) serving


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


def serving(
    device: str, cfg: ModelConfig, work: Path, plan: dict[str, Any], deadline: Deadline
) -> dict[str, Any]:
    out: dict[str, Any] = {"callers": plan["callers"], "seconds": plan["call_s"]}
    lm_path = work / "random-lm.safetensors"
    root = work / "served"
    shutil.rmtree(root, ignore_errors=True)
    model_dir(cfg, root, device, lm_path if lm_path.is_file() else None)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = work / "server.log"
    command = [
        sys.executable, "-m", "personaplex_voice.cli", "serve",
        "--model", str(root), "--device", device, "--max-sessions", str(plan["callers"]),
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "info", *plan["serve_args"],
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    started = time.monotonic()
    with open(log_path, "wb") as log:
        server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
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
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def log_tail(path: Path, chars: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


# ---------------------------------------------------------------------------------------------


def plans(cpu_smoke: bool) -> dict[str, Any]:
    if cpu_smoke:
        return {
            "architecture": "tiny (CPU smoke)",
            "config": tiny_config(),
            "correct_frames": 12,
            "ticks": 3,
            "voice_steps": 10,
            "bf16_slots": [1, 2],
            "fp8_slots": [2],
            "eager_slots": 2,
            "int8_slots": [(1, None), (2, FP8)],
            "min_left_s": 5,
            "callers": 2,
            "call_s": 3.0,
            "serve_args": ["--threads", "1"],
        }
    return {
        "architecture": "personaplex-7b-v1, random bfloat16 weights",
        "config": ModelConfig.personaplex_7b(),
        "correct_frames": 70,
        "ticks": 30,
        "voice_steps": 120,
        "bf16_slots": [1, 8, 16, 32, 48, 64],
        "fp8_slots": [96, 128],
        "eager_slots": 16,
        "int8_slots": [(1, None), (64, None), (96, FP8), (128, FP8)],
        "min_left_s": 150,  # what part (c) needs after (b)
        "callers": 64,
        "call_s": 30.0,
        "serve_args": [],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budget-s", type=float, default=450.0, help="stop starting new work after this")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU (tests)")
    parser.add_argument("--parts", default="correctness,speed,serving")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the random checkpoint goes")
    args = parser.parse_args()
    started = time.monotonic()
    deadline = Deadline(args.budget_s)
    device = "cpu" if args.cpu_smoke else args.device
    plan = plans(args.cpu_smoke)
    result: dict[str, Any] = {
        "check": "personaplex-voice gpu_check v1",
        "cpu_smoke": args.cpu_smoke,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name()
        if device.startswith("cuda") and torch.cuda.is_available()
        else device,
        "setup": json.loads(os.environ.get("GPU_CHECK_SETUP", "{}") or "{}"),
    }
    if device.startswith("cuda") and not torch.cuda.is_available():
        result["error"] = "torch sees no CUDA device"
    else:
        if device.startswith("cuda"):
            result["gpu_total_gib"] = round(torch.cuda.get_device_properties(0).total_memory / GIB, 1)
        torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)) if not args.cpu_smoke else 1)
        parts = set(args.parts.split(","))
        work_parent = args.work_dir or Path(tempfile.gettempdir())
        work_parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="gpu_check-", dir=work_parent))
        try:
            with torch.no_grad():
                if "correctness" in parts:
                    soft(result, "correctness", lambda: correctness(device, plan["correct_frames"], work))
                    write_result(args.out, result, started, complete=False)
                if "speed" in parts:
                    soft(result, "speed", lambda: speed(device, plan["config"], work, deadline, plan))
                    write_result(args.out, result, started, complete=False)
                if "serving" in parts:
                    soft(result, "serving", lambda: serving(device, plan["config"], work, plan, deadline))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print(write_result(args.out, result, started, complete=True), flush=True)


def write_result(out: Path, result: dict[str, Any], started: float, complete: bool) -> str:
    """The JSON line, written to `out` after every part (a crash later keeps what was measured)."""
    result["complete"] = complete
    result["seconds"] = round(time.monotonic() - started, 1)
    result["errors"] = sorted(find_errors(result))
    line = json.dumps(result, default=str)
    with contextlib.suppress(OSError):
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(line + "\n")
    return line


def find_errors(value: Any, path: str = "") -> Iterator[str]:
    """Where in the result an error was recorded ("speed.tick_bf16.64", ...)."""
    if isinstance(value, dict):
        if "error" in value and isinstance(value["error"], str):
            yield path or "."
        for key, item in value.items():
            if key != "error":
                yield from find_errors(item, f"{path}.{key}" if path else str(key))


if __name__ == "__main__":
    main()
