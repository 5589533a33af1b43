"""`serve` settings reach the engine and the SessionManager; the process-wide runtime settings
are the server's, applied once the engine is loaded."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import typer
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from personaplex_voice import serve_command
from personaplex_voice.engine.arrivals import ArrivalConfig
from personaplex_voice.engine.headroom import HeadroomConfig
from personaplex_voice.errors import UserError
from personaplex_voice.process.settings import ServerSettings
from personaplex_voice.server import run as server_run
from personaplex_voice.server.app import create_app

pytestmark = pytest.mark.timeout(120)


def wait_ready(client: TestClient) -> None:
    for _ in range(400):
        if client.get("/readyz").status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError(client.get("/healthz").json())


def test_serve_flags_and_env_reach_the_settings(monkeypatch, tmp_path):
    captured: list[ServerSettings] = []
    run_server = server_run.run
    monkeypatch.setattr(server_run, "run", captured.append)
    monkeypatch.setenv("PERSONAPLEX_IDLE_TIMEOUT_S", "0")
    monkeypatch.delenv("PERSONAPLEX_SATURATION", raising=False)  # (conftest turns it off)
    monkeypatch.setenv("PERSONAPLEX_MAX_CALL_S", "99")
    cli = typer.Typer()
    cli.command()(serve_command.serve)
    weights = tmp_path / "lm.safetensors"
    run = CliRunner().invoke(
        cli,
        [
            "--engine", "echo", "--model", "demo", "--device", "cpu", "--dtype", "bfloat16",
            "--threads", "2", "--max-call-s", "30", "--persona-cache-mb", "16",
            "--moshi-weight", str(weights), "--voice-prompt-dir", str(tmp_path),
        ],
    )  # fmt: skip
    assert run.exit_code == 0, run.output
    settings = captured[0]
    assert (settings.model, settings.device, settings.dtype, settings.threads) == (
        "demo",
        "cpu",
        "bfloat16",
        2,
    )
    assert (settings.moshi_weight, settings.voice_dir) == (weights, tmp_path)
    assert settings.max_call_s == 30  # the flag wins over the environment
    assert settings.manager_options() == {
        "max_queue": 0,
        "max_call_s": 30.0,
        "idle_timeout_s": None,  # 0 from the environment: never
        "cache_bytes": 16 << 20,
        "start_burst_s": None,  # the scheduler's default (5 s)
        "headroom": HeadroomConfig(),  # saturation on, the documented levels
        "arrivals": ArrivalConfig(),  # set-up paced behind the calls in progress
    }
    run = CliRunner().invoke(cli, ["--voice-dir", str(weights), "--voice-prompt-dir", str(tmp_path)])
    assert run.exit_code != 0 and "different directories" in str(run.exception)
    with pytest.raises(UserError, match=r"--moshi-weight .*no such file"):
        run_server(ServerSettings(engine="echo", moshi_weight=weights))


def test_the_manager_gets_the_limits_and_the_cache_budget():
    settings = ServerSettings(
        engine="echo", max_sessions=2, max_queue=3, max_call_s=30, idle_timeout_s=0, persona_cache_mb=16
    )
    app = create_app(settings)
    with TestClient(app) as client:
        wait_ready(client)
        manager = app.state.host
        assert manager.config.max_queue == 3 and manager.capacity == 2
        assert manager.config.max_call_frames == round(30 / 0.08)
        assert manager.config.idle_timeout_s is None
        assert manager.cache.max_bytes == 16 << 20


def test_model_files_dtype_and_threads_reach_the_engine(golden_dir):
    import torch

    from personaplex_voice.process.engine_loader import load_engine

    settings = ServerSettings(
        model=str(golden_dir),
        device="cpu",
        dtype="bfloat16",
        threads=2,
        moshi_weight=golden_dir / "model.safetensors",
        voice_dir=golden_dir / "voices",
    )
    before = torch.get_num_threads()
    try:
        engine = load_engine(settings, lambda _: None)
        assert engine.dtype == torch.bfloat16
        assert torch.get_num_threads() == 2
        assert {v.name for v in engine.voices()}
    finally:
        torch.set_num_threads(before)
    missing = settings.model_copy(update={"moshi_weight": golden_dir / "nope.safetensors", "threads": 1})
    with pytest.raises(UserError, match=r"nope\.safetensors"):
        load_engine(missing, lambda _: None)


RUNTIME_CHECK = """
import gc, sys, time
freezes = []
real_freeze = gc.freeze
gc.freeze = lambda: (freezes.append(1), real_freeze())[1]
from fastapi.testclient import TestClient
from personaplex_voice.engine.loopback import LoopbackEngine
from personaplex_voice.server.app import create_app
from personaplex_voice.process.settings import ServerSettings
from personaplex_voice.sessions import SessionManager

default = sys.getswitchinterval()
app = create_app(ServerSettings(engine="echo", max_sessions=1, twilio=True))  # mounts the bridge
assert sys.getswitchinterval() == default and not freezes, "mounting the bridge tuned the runtime"
with TestClient(app) as client:
    for _ in range(400):
        if client.get("/readyz").status_code == 200:
            break
        time.sleep(0.05)
    assert sys.getswitchinterval() == 0.001, sys.getswitchinterval()
    assert freezes == [1] and gc.get_freeze_count() > 0
    engine = app.state.host.engine
    assert not any(o is engine for o in gc.get_objects()), "the engine was loaded after the freeze"
other = create_app(ServerSettings(engine="echo"), host=SessionManager(LoopbackEngine(num_slots=1)))
with TestClient(other):
    pass
assert freezes == [1], "tuned twice"
print("ok")
"""


def test_runtime_settings_are_the_servers_applied_once_after_the_engine_loads():
    env = {**os.environ, "TWILIO_AUTH_TOKEN": "test-token"}
    run = subprocess.run(
        [sys.executable, "-c", RUNTIME_CHECK], capture_output=True, text=True, timeout=100, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("ok")
