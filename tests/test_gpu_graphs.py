"""CUDA-graph capture, rehearsed on the CPU with injected backends: warm-up and capture on one
dedicated stream into a private pool, the captured tick golden-exact, and a capture that fails
refusing the server's readiness with one line (never a silent eager fallback)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from support_engine import persona, user_frames

from personaplex_voice.engine.generator import PersonaPlexEngine, golden_like_files
from personaplex_voice.engine.graphs import CUDAGraphed, GraphCaptureError
from personaplex_voice.engine.options import engine_options
from personaplex_voice.errors import UserError

torch.set_num_threads(1)


class FakeStream:
    def __init__(self, name: str):
        self.name = name


class FakeGraph:
    """Replays by running the captured function again into the captured outputs."""

    run: Callable[[], Any]
    outputs: Any

    def replay(self) -> None:
        fresh = self.run()
        pairs = zip(self.outputs, fresh, strict=True) if isinstance(fresh, tuple) else [(self.outputs, fresh)]
        for kept, new in pairs:
            kept.copy_(new)


class RecordingBackend:
    """A GraphBackend for a machine without a GPU: records what runs on which stream; `fail`
    makes the capture raise as a kernel that cannot be captured would."""

    def __init__(self, fail: str | None = None, failures: int = 1_000_000):
        self.fail = fail
        self.failures = failures  # captures that fail before one succeeds
        self.current = "default"
        self.events: list[tuple[Any, ...]] = []
        self.streams = 0

    def new_stream(self, device: torch.device) -> FakeStream:
        self.streams += 1
        self.events.append(("new_stream", f"s{self.streams}"))
        return FakeStream(f"s{self.streams}")

    @contextlib.contextmanager
    def on_stream(self, stream: FakeStream) -> Iterator[None]:
        saved, self.current = self.current, stream.name
        try:
            yield
        finally:
            self.current = saved

    def synchronize(self, device: torch.device) -> None:
        self.events.append(("sync",))

    def new_pool(self) -> str:
        self.events.append(("pool",))
        return "private-pool"

    def new_graph(self) -> FakeGraph:
        return FakeGraph()

    def capture(self, graph: FakeGraph, pool: Any, stream: FakeStream, run: Callable[[], Any]) -> Any:
        if self.fail and self.failures > 0:
            self.failures -= 1
            raise RuntimeError(self.fail)
        with self.on_stream(stream):
            outputs = run()
        self.events.append(("capture", stream.name, pool))
        graph.run, graph.outputs = run, outputs
        return outputs

    def reserved_bytes(self, device: torch.device) -> int:
        return 0


def test_warmup_and_capture_run_on_one_dedicated_stream_with_idle_inputs() -> None:
    backend = RecordingBackend()
    calls: list[tuple[str, float]] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append((backend.current, float(x.sum())))
        return x * 2

    graphed = CUDAGraphed(fn, idle_args=lambda: (torch.zeros(3),), backend=backend, warmup_runs=2)
    out = graphed(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 2.0)) and graphed.captured
    # two warm-up runs and the capture, all on the new stream, all on the idle inputs; then the
    # first real call is a replay on the real inputs
    assert calls[:3] == [("s1", 0.0), ("s1", 0.0), ("s1", 0.0)] and calls[3] == ("default", 3.0)
    assert [e[0] for e in backend.events].index("new_stream") < [e[0] for e in backend.events].index("pool")
    assert ("capture", "s1", "private-pool") in backend.events
    info = graphed.info.as_dict()
    assert info["captured"] and info["warmup_runs"] == 2 and info["pool_mib"] == 0.0 and info["error"] is None


def test_a_failed_capture_raises_and_never_runs_eagerly() -> None:
    graphed = CUDAGraphed(lambda x: x + 1, backend=RecordingBackend(fail="operation not permitted"))
    with pytest.raises(GraphCaptureError, match="operation not permitted"):
        graphed(torch.ones(2))
    assert not graphed.captured and "operation not permitted" in str(graphed.info.error)
    with pytest.raises(GraphCaptureError):  # still refused on the next call: no quiet eager mode
        graphed(torch.ones(2))


def test_the_captured_tick_is_golden_exact(golden_dir) -> None:
    """The engine's tick through the capture path (warm-up on the side stream, capture with no
    slot active, replays) gives the golden tokens next to a sampling neighbour."""
    expected = np.load(golden_dir / "expected.npz")
    backend = RecordingBackend()
    engine = PersonaPlexEngine(
        golden_like_files(golden_dir), num_slots=2, cuda_graphs=True, graph_backend=backend
    )
    engine.warmup()
    assert engine.graph_info["captured"] and engine.graph_info["mode"] == "cuda_graph"
    from personaplex_voice.engine.base import Persona, Sampling

    engine.start(
        0, engine.prepare(Persona(text_prompt="Hi.", voice="TINYF0.pt", sampling=Sampling(), seed=1))
    )
    engine.start(1, engine.prepare(persona("pt_voice")))
    rows = []
    for frame in user_frames(golden_dir)[:20]:
        engine.step(np.stack([frame[::-1].copy(), frame]), np.array([True, True]))
        rows.append(engine.last_tokens[1].copy())
    np.testing.assert_array_equal(np.stack(rows), expected["pt_voice__tokens"][:20])
    # one graph for the capped sampling widths, one for the full vocabularies (a slot asking for
    # a top-k above the caps), sharing one pool
    assert sum(1 for e in backend.events if e[0] == "capture") == 2
    assert sum(1 for e in backend.events if e[0] == "pool") == 1
    assert engine.graph_info["wide_captured"]


def test_a_capture_failing_with_pinned_attention_retries_with_torchs_choice(golden_dir) -> None:
    """The measured SDPA winner may be a kernel that cannot be captured: warm-up drops the pins
    and captures again, and says so; with nothing left to drop the failure is loud."""
    files = golden_like_files(golden_dir)
    backend = RecordingBackend(fail="cuDNN: operation not permitted when stream is capturing", failures=1)
    engine = PersonaPlexEngine(files, num_slots=1, cuda_graphs=True, graph_backend=backend)
    engine.lm.transformer.sdpa_decode = engine.lm.transformer.sdpa_prefill = ("math",)
    engine.warmup()
    assert engine.graph_info["captured"] and engine.lm.transformer.sdpa_decode is None
    assert engine.tuning.report["sdpa_unpinned"]
    engine = PersonaPlexEngine(files, num_slots=1, cuda_graphs=True, graph_backend=RecordingBackend("no", 1))
    with pytest.raises(UserError, match="--no-cuda-graphs"):
        engine.warmup()


def test_no_cuda_graphs_is_an_engine_option_and_a_setting(monkeypatch) -> None:
    assert engine_options("parallel", "none", "auto")["cuda_graphs"] is None  # the engine's default
    assert engine_options("parallel", "none", "auto", cuda_graphs=False)["cuda_graphs"] is False
    from personaplex_voice.process.settings import ServerSettings

    monkeypatch.setenv("PERSONAPLEX_CUDA_GRAPHS", "false")
    assert ServerSettings().cuda_graphs is False


def test_a_failed_capture_refuses_readiness_with_one_line(golden_dir, monkeypatch) -> None:
    """What `serve --device cuda` does when capture fails, on the CPU: the engine (golden, with
    a backend whose capture raises) is loaded by the real startup, warm-up refuses, /readyz never
    says ready and the reason is one line naming --no-cuda-graphs; the CLI gets a UserError."""
    from fastapi.testclient import TestClient

    from personaplex_voice.process.settings import ServerSettings
    from personaplex_voice.server import app as app_module

    engine = PersonaPlexEngine(
        golden_like_files(golden_dir),
        num_slots=2,
        cuda_graphs=True,
        graph_backend=RecordingBackend(fail="CUDA error: operation not permitted when stream is capturing"),
    )
    monkeypatch.setattr(app_module, "load_engine", lambda settings, progress: engine)
    failures: list[BaseException] = []
    settings = ServerSettings(model=str(golden_dir), device="cpu", max_sessions=2, tune_runtime=False)
    with TestClient(app_module.create_app(settings, on_load_error=failures.append)) as client:
        deadline = time.monotonic() + 60
        while client.get("/healthz").json()["state"] == "loading" and time.monotonic() < deadline:
            time.sleep(0.05)
        health = client.get("/healthz").json()
        assert client.get("/readyz").status_code == 503
    assert health["state"] == "failed"
    detail = health["detail"]
    assert "\n" not in detail and "CUDA graph capture failed" in detail and "--no-cuda-graphs" in detail
    assert len(failures) == 1 and isinstance(failures[0], UserError)
    assert "operation not permitted" in str(failures[0])
