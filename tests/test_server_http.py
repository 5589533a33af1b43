"""HTTP and upgrade hygiene on the real server (uvicorn, echo engine): long prompts get an answer
in time, every refused request or upgrade gets an HTTP status and a close, idle and half-sent
connections are closed after the configured timeout, long prompts travel by POST /api/prompts,
and client mistakes or departures never log an ERROR or a traceback."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from support_abuse import abrupt_disconnect
from support_server import running_server
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from personaplex_voice.process.settings import ServerSettings
from personaplex_voice.server.app import create_app

KEY = "k3y"
TIMEOUT_S = 1.0
UPGRADE = (
    b"Host: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server():
    env = {"PERSONAPLEX_HTTP_REQUEST_TIMEOUT_S": str(TIMEOUT_S), "PERSONAPLEX_MAX_HEADERS": "200"}
    with running_server("--max-sessions", "4", "--api-key", KEY, env=env) as srv:
        yield srv


def exchange(port: int, data: bytes, wait_s: float = 10.0) -> tuple[bytes, float]:
    """Sends `data` on a fresh connection; returns what came back until the server closed it,
    and when it closed (seconds after connecting). Fails if the server keeps it open."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(wait_s)
        started = time.monotonic()
        if data:
            sock.sendall(data)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except TimeoutError:
            raise AssertionError(f"the server left the connection open; it sent {received[:200]!r}") from None
        except ConnectionResetError:
            pass
        return received, time.monotonic() - started


def chat_url(server, **query: str) -> str:
    return str(httpx.URL(server.ws_url + "/api/chat", params={"token": KEY, **query}))


async def first_answer(url: str) -> tuple[str, object, float]:
    """("metadata", dict) or ("error", text) for the server's first 0x04/0x05 (or its HTTP
    refusal of the upgrade, the reason in the body), and how long it took."""
    started = time.monotonic()
    try:
        ws = await connect(url, compression=None, proxy=None, max_size=None, open_timeout=10)
    except InvalidStatus as exc:
        return "error", exc.response.body.decode().strip(), time.monotonic() - started
    async with ws:
        while True:
            message = await asyncio.wait_for(ws.recv(), 10)
            if message[:1] == b"\x04":
                return "metadata", json.loads(message[1:]), time.monotonic() - started
            if message[:1] == b"\x05":
                return "error", message[1:].decode(), time.monotonic() - started


def test_a_thousand_character_cjk_prompt_gets_an_answer_within_two_seconds(server):
    prompt = "你是一位睿智而友善的老师。" * 77  # 1,001 characters, ~9 KB percent-encoded
    kind, payload, seconds = asyncio.run(first_answer(chat_url(server, text_prompt=prompt[:1000])))
    assert kind in ("metadata", "error") and seconds < 2.0, (kind, payload, seconds)
    assert kind == "metadata"  # it fits this server's 16 KiB request line


def test_an_over_long_request_line_gets_414_and_a_close(server):
    for path in (b"/healthz?x=" + b"a" * 20_000, b"/api/chat?text_prompt=" + b"%E4%BD%A0" * 6_000):
        answer, _ = exchange(server.port, b"GET " + path + b" HTTP/1.1\r\n" + UPGRADE + b"\r\n")
        assert answer.startswith(b"HTTP/1.1 414 "), answer[:100]
        assert b"POST /api/prompts" in answer  # says how to pass a long prompt


def test_too_many_or_too_large_headers_get_431_and_a_close(server):
    many = b"".join(b"X-%d: y\r\n" % i for i in range(5000))
    answer, _ = exchange(server.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
    assert answer.startswith(b"HTTP/1.1 431 ") and b"headers" in answer
    answer, _ = exchange(server.port, b"GET /healthz HTTP/1.1\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 431 ")


def test_an_upgrade_that_websockets_rejects_is_answered_and_closed(server):
    # 150 headers: within this server's PERSONAPLEX_MAX_HEADERS (200), over websockets' own 128.
    extra = b"".join(b"X-%d: y\r\n" % i for i in range(150))
    answer, _ = exchange(server.port, b"GET /api/chat HTTP/1.1\r\n" + UPGRADE + extra + b"\r\n")
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:100]


def test_idle_and_half_sent_connections_are_closed_after_the_timeout(server):
    answer, closed_at = exchange(server.port, b"")
    assert answer == b"" and TIMEOUT_S * 0.8 <= closed_at < TIMEOUT_S + 4
    answer, closed_at = exchange(server.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # no blank line
    assert answer.startswith(b"HTTP/1.1 408 ") and TIMEOUT_S * 0.8 <= closed_at < TIMEOUT_S + 4
    # A complete request is answered at once, whatever the timeout.
    answer, closed_at = exchange(
        server.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    assert answer.startswith(b"HTTP/1.1 200 ") and closed_at < TIMEOUT_S


def test_long_prompts_travel_by_post_and_prompt_id(server):
    prompt = "你是一位睿智而友善的老师。" * 300  # 3,900 characters: ~35 KB as a URL
    with httpx.Client(base_url=server.url) as client:
        assert client.post("/api/prompts", json={"text_prompt": prompt}).status_code == 401
        stored = client.post("/api/prompts", json={"text_prompt": prompt}, headers={"X-API-Key": KEY})
        assert stored.status_code == 201, stored.text
        body = stored.json()
        assert body["characters"] == len(prompt) and body["expires_in_s"] > 0
        plain = client.post(
            f"/api/prompts?token={KEY}", content="Be brief.", headers={"content-type": "text/plain"}
        )
        assert plain.status_code == 201
        too_long = client.post(f"/api/prompts?token={KEY}", json={"text_prompt": "x" * 4001})
        assert too_long.status_code == 400 and "too long" in too_long.json()["detail"]
        assert client.post(f"/api/prompts?token={KEY}", content=b"\xff\xfe").status_code == 400
    kind, meta, _ = asyncio.run(first_answer(chat_url(server, prompt_id=body["prompt_id"])))
    assert kind == "metadata" and meta["voice"] == "default"
    kind, text, _ = asyncio.run(first_answer(chat_url(server, prompt_id="nope")))
    assert kind == "error" and "unknown or expired" in text
    kind, text, _ = asyncio.run(first_answer(chat_url(server, prompt_id=body["prompt_id"], text_prompt="x")))
    assert kind == "error" and "not both" in text


def test_numbers_come_back_exactly_and_no_schema_is_served(server):
    kind, text, _ = asyncio.run(first_answer(chat_url(server, seed="9" * 30)))
    assert kind == "error" and text.endswith("got " + "9" * 30)
    assert httpx.get(server.url + "/openapi.json").status_code == 404
    assert httpx.get(server.url + f"/openapi.json?token={KEY}").status_code == 404
    assert httpx.get(server.url + "/docs").status_code == 404


def test_client_mistakes_and_departures_log_no_error(server):
    async def misbehave():
        # A text frame that is not UTF-8: uvicorn closes with 1007.
        async with connect(chat_url(server, text_prompt="hi"), compression=None, proxy=None) as ws:
            await ws.recv()
            await ws.send(b"\xff\xfe\xfd", text=True)
            with pytest.raises(ConnectionClosed):
                for _ in range(100):
                    await asyncio.wait_for(ws.recv(), 10)
        # Abrupt departures at every stage of a call.
        await asyncio.gather(*(abrupt_disconnect(chat_url(server, text_prompt=f"p{i}")) for i in range(30)))
        with pytest.raises(InvalidStatus):  # and a refused upgrade, for good measure
            async with connect(server.ws_url + "/nowhere", proxy=None):
                pass

    asyncio.run(misbehave())
    time.sleep(1.0)  # let the server finish those connections (and drop their tasks)
    log = server.log()
    assert "Invalid UTF-8 sequence received from client" in log  # said once, as a warning
    for bad in ("ERROR", "Traceback", "never retrieved", "CRITICAL"):
        assert bad not in log, log[-3000:]
    deadline = time.monotonic() + 10
    while httpx.get(server.url + "/healthz").json()["active"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert httpx.get(server.url + "/healthz").json()["active"] == 0  # every slot came back


def test_healthz_names_local_models_without_their_paths(tmp_path):
    model_dir = tmp_path / "models" / "secret-model"
    model_dir.mkdir(parents=True)  # not a model: the load fails, naming the path in its message
    settings = ServerSettings(model=str(model_dir), device="cpu", tune_runtime=False, api_key=KEY)
    with TestClient(create_app(settings)) as client:
        deadline = time.monotonic() + 60
        while client.get("/healthz").json()["state"] == "loading" and time.monotonic() < deadline:
            time.sleep(0.05)
        anyone = client.get("/healthz").json()
        keyholder = client.get("/healthz", headers={"X-API-Key": KEY}).json()
    assert anyone["state"] == "failed" and anyone["model"] == "secret-model"
    assert str(tmp_path) not in json.dumps(anyone)
    assert keyholder["model"] == str(model_dir) and str(model_dir) in keyholder["detail"]


def test_static_serves_another_client_build_at_the_root(tmp_path):
    build = tmp_path / "dist"
    (build / "assets").mkdir(parents=True)
    (build / "index.html").write_text("<!doctype html><title>another client</title>")
    (build / "assets" / "decoderWorker.min.js").write_text("// worker")
    settings = ServerSettings(engine="echo", tune_runtime=False, static=build)
    with TestClient(create_app(settings)) as client:
        assert "another client" in client.get("/").text
        assert client.get("/assets/decoderWorker.min.js").text == "// worker"
        assert client.get("/healthz").status_code == 200  # routes still win over the files
    from personaplex_voice.errors import UserError
    from personaplex_voice.server.run import run as run_server

    with pytest.raises(UserError, match=r"no index\.html"):
        run_server(ServerSettings(engine="echo", static=tmp_path / "empty"))


def test_the_http_guard_is_in_force_with_the_pinned_releases():
    """The guard extends uvicorn's protocol classes: pyproject pins the releases it was tested
    with, and outside them the server runs unguarded (with a warning) rather than broken."""
    from personaplex_voice.process.http_guard import HttpLimits, protocol_classes, tested_versions

    ok, installed = tested_versions()
    assert ok, f"{installed}: not the pinned releases"
    http_class, ws_class = protocol_classes(HttpLimits())
    assert http_class.__name__ == "GuardedHttpToolsProtocol"
    assert ws_class.__name__ == "AnsweringWebSocketProtocol"
