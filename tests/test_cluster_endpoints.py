"""/api/cluster and /metrics on the embedded server: behind the API key, one process described."""

from __future__ import annotations

from starlette.testclient import TestClient

from personaplex_voice.engine.loopback import LoopbackEngine
from personaplex_voice.process.settings import ServerSettings
from personaplex_voice.server.app import create_app
from personaplex_voice.sessions import SessionManager


def test_cluster_and_metrics_need_the_key_and_describe_one_process():
    manager = SessionManager(LoopbackEngine(num_slots=3))
    app = create_app(ServerSettings(engine="echo", api_key="sesame", tune_runtime=False), host=manager)
    with TestClient(app) as client:
        assert client.get("/api/cluster").status_code == 401
        assert client.get("/metrics").status_code == 401
        key = {"Authorization": "Bearer sesame"}
        state = client.get("/api/cluster", headers=key).json()
        assert state["mode"] == "embedded" and state["capacity"] == 3 and state["available"] == 3
        assert isinstance(state["frontend"]["pid"], int) and "torch_loaded" in state["frontend"]
        assert "personaplex_active_slots" in client.get("/metrics", headers=key).text
        assert client.get("/readyz").status_code == 200  # probes carry no key
