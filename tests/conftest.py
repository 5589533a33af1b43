"""Shared test fixtures. Area-specific helpers live in tests/support_*.py modules."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Servers the tests start (subprocesses inherit this) admit by slots only: a busy CI machine must
# not turn a test of something else into a refusal. The headroom policy's own tests ask for it
# (test_headroom_policy.py, test_overload.py, test_cluster_client.py).
os.environ.setdefault("PERSONAPLEX_SATURATION", "0")

ROOT = Path(__file__).resolve().parents[1]
# The golden vectors are never copied into the project: CI lays shared/ beside the checkout.
GOLDEN_DIR = Path(os.environ.get("PERSONAPLEX_GOLDEN", ROOT.parent / "shared" / "golden"))


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    if not (GOLDEN_DIR / "config.json").exists():
        pytest.fail(f"golden vectors not found at {GOLDEN_DIR} (expected ../shared/golden)")
    return GOLDEN_DIR


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    path = ROOT / "artifacts"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture
async def manager_factory():
    """Make SessionManagers (non-realtime unless asked) that are shut down after the test."""
    from personaplex_voice.engine.loopback import LoopbackEngine
    from personaplex_voice.sessions import SessionManager

    made: list[SessionManager] = []

    def make(engine=None, **opts) -> SessionManager:
        opts.setdefault("realtime", False)
        manager = SessionManager(engine or LoopbackEngine(num_slots=4), **opts)
        made.append(manager)
        return manager

    yield make
    for manager in made:
        await manager.shutdown()
