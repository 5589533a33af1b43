"""What one tick costs, by source and by kind, before and after, in one run.

    python bench/tick_profile.py                       # the 7B at 64 slots; before = git 3614086
    python bench/tick_profile.py --slots 128 --before none
    python bench/tick_profile.py --device cuda --gpu-slots 64   # + GPU tick time (random weights)

Prints ONE JSON object:
- `ops`: tensor operations per tick (engine/tick_ops.py: TorchDispatchMode on the `meta` device,
  views excluded, SDPA as the one kernel it is on a GPU) for `--shape` at `--slots`, by source
  (attention, MLP, norm, depformer, sampling, codec, ...): `after` as a GPU runs it (the fused
  kernels on), `after_reference` (a GPU whose fused kernels all failed their checks, or the
  CPU), `after_fp8_kv` (an fp8 KV cache: its writes take the reference path), and `before` the
  same count on the code at `--before` (a git revision, run from a
  `git archive` of it in a subprocess: the very same counting module, the old engine);
- `bytes`: bytes per tick by kind (weights, the LM's KV cache, Mimi's KV, activations written)
  as a function of the filled positions and the active slots, now (the length-aware decode) and
  before (every slot's whole ring, every tick), at 20 s / 120 s / 240 s of context with every
  slot in a call and with 8 of them;
- `cpu_tick_ms`: the tick's time on this CPU (the process's CPU time, and wall time) for a model
  a CPU runs (`--cpu-model`, the golden one by default) at `--cpu-slots` slots, every slot in a
  call and sampling, now and before, the two alternated over two rounds, the best of each (same
  machine, same run: a ratio, not an absolute);
- `gpu_tick_ms` (with `--device cuda`): the `--shape` model with random weights on the GPU,
  after warm-up (CUDA graphs, the fused kernels), p50 / p99 at `--gpu-slots`;
- `calls_per_gpu`: COMPUTED, not measured: the most calls whose tick's floor (bytes over the
  copy bandwidth measured on an H200, plus `--us-per-op` per operation) fits the 80 ms frame,
  and the most the memory holds (model/sizes.py) — docs/engine.md's table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The code before issue 28 (whole-ring decode, ~5,900 operations a tick).
BEFORE = "3614086"
FRAME_MS = 80.0
# An assumption, not a measurement: what one operation costs inside a CUDA graph on an H200
# (a kernel launch and its tail, for the small kernels of a decode tick). `--us-per-op`.
US_PER_OP = 2.5
CONTEXT_SECONDS = (20, 120, 240)
CPU_ROUNDS = 2


def tick_ops_module() -> Any:
    """engine/tick_ops.py of THIS checkout, whatever `personaplex_voice` resolves to (the old
    tree, in a `--worker` run for `--before`)."""
    path = ROOT / "personaplex_voice" / "engine" / "tick_ops.py"
    spec = importlib.util.spec_from_file_location("tick_profile_ops", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def config_of(shape: str) -> Any:
    from personaplex_voice.model.config import ModelConfig

    if shape == "7b":
        return ModelConfig.personaplex_7b()
    if shape == "demo":
        from personaplex_voice.model.demo import demo_config

        return demo_config()
    return ModelConfig.from_json(Path(shape) / "config.json")


def count(shape: str, slots: int, fused: bool, kv_dtype: Any = None) -> dict[str, Any]:
    ops = tick_ops_module().tick_ops(config_of(shape), slots, fused=fused, kv_dtype=kv_dtype)
    return ops.as_dict()


def cpu_ticks(model: str, slots: int, ticks: int) -> dict[str, Any]:
    """ms per tick on this CPU, every slot in a call (sampling), one thread."""
    import numpy as np
    import torch

    from personaplex_voice.engine.base import FRAME_SIZE, Persona, Sampling
    from personaplex_voice.engine.generator import PersonaPlexEngine, golden_like_files

    torch.set_num_threads(1)
    engine = PersonaPlexEngine(golden_like_files(Path(model)), num_slots=slots)
    persona = Persona(text_prompt="You are helpful.", voice="TINYF0.pt", sampling=Sampling(), seed=1)
    prepared = engine.prepare(persona)
    for slot in range(slots):
        engine.start(slot, prepared)
    pcm = (0.05 * np.random.default_rng(0).standard_normal((slots, FRAME_SIZE))).astype(np.float32)
    active = np.ones(slots, dtype=bool)
    for _ in range(3):
        engine.step(pcm, active)
    wall, cpu = [], []
    for _ in range(ticks):
        started, started_cpu = time.perf_counter(), time.process_time()
        engine.step(pcm, active)
        wall.append(1000 * (time.perf_counter() - started))
        cpu.append(1000 * (time.process_time() - started_cpu))
    return {
        "slots": slots,
        "ticks": ticks,
        # the process's CPU time: what a busy shared machine's other processes change least
        "cpu_ms_p50": round(statistics.median(cpu), 2),
        "wall_ms_p50": round(statistics.median(wall), 2),
        "wall_ms_min": round(min(wall), 2),
    }


def gpu_ticks(shape: str, slots: int, ticks: int) -> dict[str, Any]:
    """The `shape` model with random weights on the GPU: warm-up (graphs, kernels), then ticks."""
    import numpy as np
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_check import ByteTokenizer, files_of, write_voice

    from personaplex_voice.engine import generator
    from personaplex_voice.engine.base import FRAME_SIZE, Persona, Sampling
    from personaplex_voice.model.loaders import load_lm, load_mimi

    cfg = config_of(shape)
    work = Path(tempfile.mkdtemp(prefix="tick_profile-"))
    (work / "voices").mkdir()
    write_voice(work / "voices" / "RANDOM.pt", cfg, steps=20)
    torch.manual_seed(0)
    models = (load_mimi(cfg, None, "cuda"), load_lm(cfg, None, "cuda", torch.bfloat16))
    generator.TextTokenizer = ByteTokenizer  # type: ignore[misc, assignment]
    engine = generator.PersonaPlexEngine(files_of(cfg, work), slots, "cuda", torch.bfloat16, models=models)
    engine.warmup()
    prepared = engine.prepare(
        Persona(text_prompt="Hello there.", voice="RANDOM.pt", sampling=Sampling(), seed=1)
    )
    engine.start(0, prepared)
    snap = engine.snapshot(0)
    for slot in range(1, slots):
        engine.restore(slot, snap, prepared)
    pcm = (0.05 * np.random.default_rng(0).standard_normal((slots, FRAME_SIZE))).astype(np.float32)
    active = np.ones(slots, dtype=bool)
    times = []
    for _ in range(ticks):
        started = time.perf_counter()
        engine.step(pcm, active)
        times.append(1000 * (time.perf_counter() - started))
    rest = sorted(times[2:])
    return {
        "slots": slots,
        "ms_p50": round(statistics.median(rest), 2),
        "ms_p99": round(rest[min(len(rest) - 1, int(0.99 * len(rest)))], 2),
        "graph": engine.graph_info.get("captured"),
        "fused_ops": engine.tuning.report.get("fused_ops"),
        "kv_read": engine.tuning.report.get("kv_read"),
        "fallbacks": engine.fallbacks,
    }


def byte_rows(slots: int, activations: int) -> list[dict[str, Any]]:
    import torch

    from personaplex_voice.model.config import ModelConfig
    from personaplex_voice.model.sizes import GB, tick_traffic

    cfg = ModelConfig.personaplex_7b()
    rows = []
    for kv_name, kv in (("bfloat16", None), ("float8", torch.float8_e4m3fn)):
        for active in (slots, 8):
            for seconds in CONTEXT_SECONDS:
                filled = int(seconds * cfg.frame_rate)
                t = tick_traffic(cfg, slots, kv_dtype=kv, active=active, filled=filled)
                rows.append(
                    {
                        "kv_cache": kv_name,
                        "slots": slots,
                        "active": active,
                        "context_s": seconds,
                        "weights_gb": round(t.weights / GB, 2),
                        "lm_kv_gb_now": round(t.kv / GB, 2),
                        "lm_kv_gb_before": round(t.kv_whole_ring / GB, 2),
                        "mimi_kv_gb": round(t.codec_kv / GB, 2),
                        "activations_gb": round(activations / GB, 2),
                        "kv_ratio_before_over_now": round(t.kv_whole_ring / t.kv, 1) if t.kv else None,
                    }
                )
    return rows


def calls_per_gpu(ops_per_tick: int, us_per_op: float) -> list[dict[str, Any]]:
    """COMPUTED: the most calls an H200 holds (memory) and keeps in real time (the tick's floor:
    bytes over the measured copy bandwidth + operations x `us_per_op`), at 120 s and 240 s."""
    import torch

    from personaplex_voice.model.config import ModelConfig
    from personaplex_voice.model.sizes import GPUS, H200_BYTES_PER_S, memory_plan, tick_traffic

    cfg = ModelConfig.personaplex_7b()
    h200 = GPUS["141 GB (H200)"]
    out = []
    for label, quantize, kv in (
        ("bfloat16 / bfloat16 KV", None, None),
        ("bfloat16 / fp8 KV", None, torch.float8_e4m3fn),
        ("int8 / fp8 KV", "int8", torch.float8_e4m3fn),
    ):
        by_memory = memory_plan(cfg, torch.bfloat16, quantize=quantize, kv_dtype=kv).calls(h200)
        row: dict[str, Any] = {"config": label, "by_memory": by_memory}
        for seconds in (120, 240):
            filled = int(seconds * cfg.frame_rate)
            floor = [
                1000
                * tick_traffic(cfg, n, quantize=quantize, kv_dtype=kv, filled=filled).total
                / H200_BYTES_PER_S
                + ops_per_tick * us_per_op / 1000
                for n in range(by_memory + 1)
            ]
            row[f"by_tick_floor_{seconds}s"] = max(n for n in range(by_memory + 1) if floor[n] <= FRAME_MS)
            row[f"floor_ms_at_64_{seconds}s"] = round(floor[min(64, by_memory)], 1)
        out.append(row)
    return out


def worker(args: argparse.Namespace) -> None:
    """One measurement, in the interpreter whose `personaplex_voice` is the tree measured."""
    if args.worker == "count":
        result: Any = count(args.shape, args.slots, fused=True)
    else:
        result = cpu_ticks(args.cpu_model, args.cpu_slots, args.cpu_ticks)
    print(json.dumps(result))


def run_worker(tree: Path, what: str, args: argparse.Namespace) -> Any:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", what, "--shape", args.shape]
    command += ["--slots", str(args.slots), "--cpu-model", args.cpu_model]
    command += ["--cpu-slots", str(args.cpu_slots), "--cpu-ticks", str(args.cpu_ticks)]
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    proc = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        return {"error": " ".join(proc.stderr.strip().splitlines()[-1:])[:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def old_tree(revision: str, dest: Path) -> Path | None:
    """`personaplex_voice/` at `revision` (git archive), or None without git history."""
    archive = dest / "old.tar"
    with open(archive, "wb") as f:
        proc = subprocess.run(
            ["git", "archive", revision, "personaplex_voice"], cwd=ROOT, stdout=f, stderr=subprocess.PIPE
        )
    if proc.returncode != 0:
        return None
    with tarfile.open(archive) as tar:
        tar.extractall(dest / "tree", filter="data")
    return dest / "tree"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="7b", help="7b, demo or a model directory")
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--before", default=BEFORE, help="git revision to compare with ('none': skip)")
    parser.add_argument("--cpu-model", default=str(ROOT.parent / "shared" / "golden"))
    parser.add_argument("--cpu-slots", type=int, default=8)
    parser.add_argument("--cpu-ticks", type=int, default=20)
    parser.add_argument("--device", default="cpu", help="cuda: also time the tick on the GPU")
    parser.add_argument("--gpu-slots", type=int, default=64)
    parser.add_argument("--gpu-ticks", type=int, default=40)
    parser.add_argument("--us-per-op", type=float, default=US_PER_OP)
    parser.add_argument("--worker", choices=("count", "cpu"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    import torch

    after = count(args.shape, args.slots, fused=True)
    reference = count(args.shape, args.slots, fused=False)
    fp8 = count(args.shape, args.slots, fused=True, kv_dtype=torch.float8_e4m3fn)
    result: dict[str, Any] = {
        "shape": args.shape,
        "slots": args.slots,
        "ops": {"after": after, "after_reference": reference, "after_fp8_kv": fp8, "before": None},
    }
    result["cpu_tick_ms"] = {"model": args.cpu_model, "after": None, "before": None}
    with tempfile.TemporaryDirectory(prefix="tick_profile-") as tmp:
        tree = None if args.before == "none" else old_tree(args.before, Path(tmp))
        if args.before != "none" and tree is None:
            result["ops"]["before"] = {"error": f"no git history for {args.before}"}
        if tree is not None:
            result["ops"]["before"] = run_worker(tree, "count", args)
        # CPU time, the two trees alternated (a shared machine's load drifts): the best round of each
        runs: dict[str, list[Any]] = {"after": [], "before": []}
        for _ in range(CPU_ROUNDS):
            runs["after"].append(run_worker(ROOT, "cpu", args))
            if tree is not None:
                runs["before"].append(run_worker(tree, "cpu", args))
        for name, rounds in runs.items():
            good = [r for r in rounds if "cpu_ms_p50" in r]
            if good:
                result["cpu_tick_ms"][name] = min(good, key=lambda r: r["cpu_ms_p50"])
            elif rounds:
                result["cpu_tick_ms"][name] = rounds[0]
    before = result["ops"]["before"] or {}
    if "total" in before:
        result["ops"]["before_over_after"] = round(before["total"] / after["total"], 2)
    cpu_before, cpu_after = result["cpu_tick_ms"]["before"] or {}, result["cpu_tick_ms"]["after"] or {}
    if "cpu_ms_p50" in cpu_before and "cpu_ms_p50" in cpu_after:
        ratio = cpu_before["cpu_ms_p50"] / cpu_after["cpu_ms_p50"]
        result["cpu_tick_ms"]["before_over_after"] = round(ratio, 2)
    result["bytes"] = byte_rows(args.slots, after["bytes_written"])
    result["gpu_tick_ms"] = (
        gpu_ticks(args.shape, args.gpu_slots, args.gpu_ticks) if args.device == "cuda" else None
    )
    result["calls_per_gpu"] = {
        "computed_not_measured": True,
        "assumptions": {"copy_bytes_per_s": 4.3e12, "us_per_op": args.us_per_op, "frame_ms": FRAME_MS},
        "rows": calls_per_gpu(after["total"], args.us_per_op),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
