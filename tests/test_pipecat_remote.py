"""PersonaPlexLLMService with the remote backend against the real server (uvicorn, `--engine echo`).

One server per test module (per xdist worker) with a single slot and an API key, so the refusal
tests can fill it.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
from personaplex_pipecat import BackendUnavailable, Backoff, PersonaPlexLLMService, RemoteBackend
from pipecat.frames.frames import LLMTextFrame, TTSAudioRawFrame, TTSTextFrame
from pipecat.utils.errors import ErrorCategory
from support_pipecat import aligned_logspec_correlation, run_call
from support_server import ServerProcess, free_port, running_server
from websockets.asyncio.client import connect

from personaplex_voice.audio.io import read_audio
from personaplex_voice.engine.base import Persona
from personaplex_voice.server.protocol import ChatParams, Kind

API_KEY = "pipecat-test-key"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server("--max-sessions", "1", "--api-key", API_KEY) as proc:
        yield proc


@pytest.fixture(scope="module")
def user_16k(golden_dir) -> np.ndarray:
    return read_audio(golden_dir / "user.wav", sample_rate=16000)


def active_sessions(server: ServerProcess) -> int:
    with urllib.request.urlopen(server.url + "/healthz", timeout=5) as response:
        return int(json.load(response)["active"])


async def wait_for_active(server: ServerProcess, want: int, timeout_s: float = 5.0) -> int:
    """The server notices a closed socket asynchronously: poll its occupancy for a moment."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        active = await asyncio.to_thread(active_sessions, server)
        if active == want or loop.time() > deadline:
            return active
        await asyncio.sleep(0.05)


def service_for(server: ServerProcess, **kwargs) -> PersonaPlexLLMService:
    return PersonaPlexLLMService(url=server.ws_url + "/api/chat", api_key=API_KEY, **kwargs)


async def test_echoed_audio_matches_the_input(server, user_16k) -> None:
    service = service_for(
        server, text_prompt="Repeat after me.", max_audio_ahead_s=None
    )  # see in-process test
    result = await run_call(
        service, user_16k, 16000, out_rate=16000, wait_ready=lambda: service.session is not None
    )
    assert result.errors == []
    assert {f.sample_rate for f in result.audio_frames} == {16000}
    out = result.agent_timeline()
    corr, lag_s = aligned_logspec_correlation(out, user_16k, 16000)
    assert len(out) - lag_s * 16000 >= 0.9 * len(user_16k), (len(out), lag_s)
    assert corr >= 0.8, (corr, lag_s)
    # the echo engine's text pieces arrive as 0x02 messages and come out as text frames
    assert result.text().startswith(" Hello from the echo engine.")
    assert len(result.of(LLMTextFrame)) == len(result.of(TTSTextFrame)) > 5
    assert await wait_for_active(server, 0) == 0


@pytest.mark.parametrize("end", ["end", "cancel"])
async def test_end_or_cancel_mid_call_closes_the_socket(server, user_16k, end) -> None:
    service = service_for(server)
    seen: dict[str, object] = {}

    async def during(_result) -> None:
        seen["session"] = service.session
        seen["active"] = await asyncio.to_thread(active_sessions, server)

    result = await run_call(
        service,
        user_16k,
        16000,
        end=end,
        feed_s=1.0,
        tail_s=0.0,
        during=during,
        wait_ready=lambda: service.session is not None,
    )
    assert result.errors == []
    assert seen["active"] == 1
    assert seen["session"].closed  # our side closed the WebSocket...
    assert await wait_for_active(server, 0) == 0  # ...and the server freed the slot


async def test_refused_when_the_server_is_full(server, user_16k) -> None:
    url = ChatParams().url(server.ws_url + "/api/chat", token=API_KEY)
    # another caller holds the only slot (it buffers what it does not read, so it closes promptly)
    async with connect(url, max_queue=None) as other:
        while (await other.recv())[0] != Kind.HANDSHAKE:
            pass
        service = service_for(server)
        result = await run_call(
            service, user_16k, 16000, feed_s=0.2, wait_ready=lambda: False, ready_timeout_s=10
        )
    assert len(result.errors) == 1, result.errors
    assert "full" in result.errors[0].error
    assert result.errors[0].category is ErrorCategory.RATE_LIMIT
    assert result.of(TTSAudioRawFrame) == []


async def test_refused_with_a_wrong_api_key(server, user_16k) -> None:
    service = PersonaPlexLLMService(url=server.ws_url + "/api/chat", api_key="wrong")
    result = await run_call(
        service, user_16k, 16000, feed_s=0.2, wait_ready=lambda: False, ready_timeout_s=10
    )
    assert len(result.errors) == 1
    assert "API key" in result.errors[0].error
    assert result.errors[0].category is ErrorCategory.AUTHENTICATION
    assert await wait_for_active(server, 0) == 0


async def test_unreachable_server_gives_up_after_backoff() -> None:
    backend = RemoteBackend(
        f"ws://127.0.0.1:{free_port()}/api/chat", backoff=Backoff(attempts=3, initial_s=0.01, max_s=0.02)
    )
    assert backend.backoff.delays() == [0.01, 0.02]
    with pytest.raises(BackendUnavailable, match="gave up after 3 attempts"):
        await backend.open(Persona())


async def test_a_prompt_too_long_for_a_url_goes_by_post(server) -> None:
    """3,000 CJK characters are ~27 KB percent-encoded: past the server's request-line limit, so
    the backend stores the prompt with POST /api/prompts and connects by its `prompt_id`."""
    prompt = "你是一家银行的客服代表。" * 250
    assert len(ChatParams(text_prompt=prompt).url(server.ws_url + "/api/chat").encode()) > 16 * 1024
    backend = RemoteBackend(server.ws_url + "/api/chat", api_key=API_KEY)
    session = await backend.open(Persona(text_prompt=prompt))
    try:
        assert "prompt_id=" in session._url and "text_prompt=&" in session._url + "&"
        assert session.metadata["session_id"]
    finally:
        await session.close()
    assert await wait_for_active(server, 0) == 0
