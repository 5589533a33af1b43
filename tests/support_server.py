"""Start the real `personaplex-voice serve` in a subprocess for end-to-end tests.

    from support_server import running_server

    with running_server("--max-sessions", "2") as server:      # echo engine by default
        httpx.get(server.url + "/readyz")
        websockets.connect(server.ws_url + "/api/chat?text_prompt=hi")

    with running_server(engine="model", model=str(golden_dir)) as server: ...

Or as a pytest fixture: `server = request.getfixturevalue("echo_server")` (module-scoped below).
The server binds a free port chosen by the OS; its log is kept and shown if it fails to start.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class ServerProcess:
    url: str  # http://127.0.0.1:PORT
    ws_url: str  # ws://127.0.0.1:PORT
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    args: list[str] = field(default_factory=list)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.process.poll() is None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def openssl_pair(folder: Path, common_name: str) -> None:
    """A certificate and key the way a user would bring them (`openssl req -x509`): cert.pem and
    key.pem in `folder`, valid for a day."""
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *(
                "-subj",
                f"/CN={common_name}",
                "-keyout",
                str(folder / "key.pem"),
                "-out",
                str(folder / "cert.pem"),
            ),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )


def insecure_ssl_context():
    """Trusts any certificate: for servers started with a self-signed `--ssl` directory."""
    import ssl

    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def _get_status(url: str) -> int | None:
    try:
        context = insecure_ssl_context() if url.startswith("https:") else None
        with urllib.request.urlopen(url, timeout=2, context=context) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, urllib.error.URLError):
        return None


@contextlib.contextmanager
def running_server(
    *args: str,
    engine: str = "echo",
    model: str | None = None,
    env: Mapping[str, str] | None = None,
    wait_for: str = "/readyz",
    timeout: float = 90.0,
) -> Iterator[ServerProcess]:
    """Run the server until the block ends. `args` are extra `serve` flags; `env` is added to the
    environment; `wait_for` is the path that must answer 200 first ("/healthz" to skip loading)."""
    cmd_base = [
        sys.executable,
        "-m",
        "personaplex_voice.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--engine",
        engine,
    ]
    if model is not None:
        cmd_base += ["--model", model]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    last_log = ""
    for _attempt in range(3):  # a free port can be taken between probing and binding: retry
        port = free_port()
        cmd = [*cmd_base, "--port", str(port), *args]
        with tempfile.NamedTemporaryFile("wb", prefix="server-", suffix=".log", delete=False) as log_file:
            log_path = Path(log_file.name)
            process = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=log_file, stderr=subprocess.STDOUT)
        secure = "--ssl" in args or "PERSONAPLEX_SSL" in (env or {})
        http, ws = ("https", "wss") if secure else ("http", "ws")
        server = ServerProcess(
            f"{http}://127.0.0.1:{port}", f"{ws}://127.0.0.1:{port}", port, process, log_path, cmd
        )
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and server.alive():
                if _get_status(server.url + wait_for) == 200:
                    break
                time.sleep(0.1)
            else:
                last_log = server.log()
                if server.alive():
                    raise RuntimeError(f"server did not become ready in {timeout:.0f} s:\n{last_log[-4000:]}")
                if "address already in use" in last_log.lower():
                    continue
                raise RuntimeError(f"server exited with {process.returncode}:\n{last_log[-4000:]}")
            yield server
            return
        finally:
            stop_server(server)
            with contextlib.suppress(OSError):
                log_path.unlink()
    raise RuntimeError(f"could not bind a free port:\n{last_log[-4000:]}")


def stop_server(server: ServerProcess, timeout: float = 10.0) -> None:
    if not server.alive():
        return
    server.process.terminate()  # SIGTERM: uvicorn shuts down gracefully
    try:
        server.process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


@pytest.fixture(scope="module")
def echo_server() -> Iterator[ServerProcess]:
    """One echo server (4 slots) shared by a test module."""
    with running_server("--max-sessions", "4") as server:
        yield server


# ---------------------------------------------------------------------------------------------
# A protocol client, as Moshi clients do it: sphn's Ogg-Opus writer/reader over `websockets`.


@dataclass
class ChatResult:
    metadata: list[dict] = field(default_factory=list)
    handshake: bool = False
    text: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    pcm_parts: list = field(default_factory=list)
    audio_messages: int = 0
    close_code: int | None = None
    http_status: int | None = None  # the upgrade's HTTP answer when it was refused (body in errors)
    refusal_kind: str | None = None  # its X-PersonaPlex-Error header
    sent_samples: int = 0  # of `audio` (the silent tail is not counted)
    sent_done_at: float | None = None  # monotonic time the last chunk of `audio` was sent
    # (monotonic time, total samples received so far) per audio message
    arrivals: list[tuple[float, int]] = field(default_factory=list)

    @property
    def pcm(self):

        return np.concatenate(self.pcm_parts) if self.pcm_parts else np.zeros(0, np.float32)

    def received_by(self, when: float) -> int:
        """Samples of agent audio received up to monotonic time `when`."""
        return max((n for t, n in self.arrivals if t <= when), default=0)


async def chat(
    url: str,
    audio=None,
    *,
    realtime: bool = True,
    tail_s: float = 1.0,
    max_tail_s: float = 30.0,
    headers: Mapping[str, str] | None = None,
    origin: str | None = None,
    handshake_timeout: float = 60.0,
    ssl_context=None,
) -> ChatResult:
    """Connect to `url` (ws://.../api/chat?...), wait for the handshake, stream `audio` (float32
    24 kHz) in 80 ms chunks (paced in real time unless `realtime=False`), then keep the microphone
    open (silence) for `tail_s` and until the agent audio received covers what was sent (at most
    `max_tail_s`: a loaded machine may run behind), then close. Returns what the server sent.
    `ssl_context`: for wss://, the context that must verify the server (default: trust any)."""
    import asyncio

    import sphn
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidStatus

    chunk = 1920
    result = ChatResult()
    reader = sphn.OpusStreamReader(24000)
    writer = sphn.OpusStreamWriter(24000)
    handshake = asyncio.Event()
    received = 0

    async def receive(ws) -> None:
        nonlocal received
        try:
            async for message in ws:
                if isinstance(message, str) or not message:
                    continue
                kind, payload = message[0], message[1:]
                if kind == 0x00:
                    result.handshake = True
                    handshake.set()
                elif kind == 0x01:
                    result.audio_messages += 1
                    pcm = reader.append_bytes(payload)
                    if pcm is not None and len(pcm):
                        result.pcm_parts.append(np.asarray(pcm, np.float32))
                        received += len(pcm)
                    result.arrivals.append((time.monotonic(), received))
                elif kind == 0x02:
                    result.text.append(payload.decode("utf-8"))
                elif kind == 0x04:
                    result.metadata.append(json.loads(payload))
                elif kind == 0x05:
                    result.errors.append(payload.decode("utf-8"))
        except ConnectionClosed:
            pass
        finally:
            handshake.set()  # unblock the sender if the server closed first

    async def speak(ws, samples, until) -> None:
        """Send `samples` in paced chunks, then silence while `until()` is false."""
        start = time.monotonic()
        i = 0
        while True:
            piece = samples[i * chunk : (i + 1) * chunk]
            if not len(piece):
                if until():
                    return
                piece = np.zeros(chunk, np.float32)
            else:
                result.sent_samples += len(piece)
            await ws.send(b"\x01" + writer.append_pcm(np.asarray(piece, np.float32)))
            i += 1
            if (i - 1) * chunk < len(samples) <= i * chunk:
                result.sent_done_at = time.monotonic()
            if realtime:
                await asyncio.sleep(max(0.0, start + i * chunk / 24000 - time.monotonic()))
            else:
                await asyncio.sleep(0)

    secure = {"ssl": ssl_context or insecure_ssl_context()} if url.startswith("wss:") else {}
    try:
        options = dict(compression=None, proxy=None, max_size=None, **secure)
        ws = await connect(url, additional_headers=headers, origin=origin, **options)
    except InvalidStatus as exc:  # refused before the upgrade: the reason is the body
        result.http_status = exc.response.status_code
        result.refusal_kind = exc.response.headers.get("x-personaplex-error")
        result.errors.append(exc.response.body.decode("utf-8", "replace").strip())
        return result
    async with ws:
        receiver = asyncio.create_task(receive(ws))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(handshake.wait(), handshake_timeout)
        if result.handshake and audio is not None:
            loop = asyncio.get_running_loop()
            deadline: list[float] = []

            def done() -> bool:
                now = loop.time()
                if not deadline:
                    deadline.append(now)
                waited = now - deadline[0]
                covered = received >= result.sent_samples
                return receiver.done() or (waited >= tail_s and covered) or waited >= max_tail_s

            with contextlib.suppress(ConnectionClosed):
                await speak(ws, np.asarray(audio, np.float32), done)
        elif result.handshake:
            await asyncio.sleep(tail_s)
        await ws.close()
        await receiver
        result.close_code = ws.close_code
    return result


# ---------------------------------------------------------------------------------------------
# Comparing an echo with what was sent


def log_spectrogram(x, rate: int = 24000):
    """Log-magnitude STFT: 512-sample windows, 10 ms hop."""
    from scipy.signal import stft

    _, _, z = stft(x, fs=rate, nperseg=512, noverlap=512 - rate // 100)
    return np.log10(np.abs(z) + 1e-4)


def echo_similarity(sent, received, segment_s: float = 0.5, rate: int = 24000) -> float:
    """How recognisably `received` is the echo of `sent`: per half-second segment of `sent`, the
    best correlation of log-spectrograms (two Opus passes keep spectra, not waveforms) within
    4 frames of the overall delay, then the energy-weighted median over the segments.

    Per segment, because a real-time server that misses a tick shifts the rest of the echo by a
    frame; short segments and the median, because a busy machine's stalls (late frames fed as
    silence, a frame dropped later) cost the segments they hit and no more (a late frame in
    every six still scores 0.86), while a silent echo, noise or other speech score low in every
    segment (0.02, 0.02, 0.55). How well a server keeps time is measured by the benches."""

    scores, weights = echo_segment_scores(sent, received, segment_s, rate)
    if not scores:
        return 0.0
    order = np.argsort(scores)
    cumulative = np.cumsum(np.asarray(weights)[order])
    return float(np.asarray(scores)[order][np.searchsorted(cumulative, cumulative[-1] / 2)])


def echo_segment_scores(sent, received, segment_s: float = 0.5, rate: int = 24000):
    """([best correlation per voiced segment], [its energy]) for `echo_similarity`."""
    from scipy.signal import correlate

    frame = rate * 80 // 1000
    lag = int(np.argmax(correlate(received, sent, mode="full", method="fft"))) - (len(sent) - 1)
    seg = int(segment_s * rate)
    scores, weights = [], []
    for a in range(0, len(sent) - seg // 2, seg):
        ref = sent[a : a + seg]
        energy = float(np.mean(ref**2))
        if energy < 1e-5:
            continue  # silence says nothing about the echo
        best = -1.0
        spec = log_spectrogram(ref, rate).ravel()
        for shift in range(-4 * frame, 4 * frame + 1, frame // 4):
            b = a + lag + shift
            if b < 0 or b + len(ref) > len(received):
                continue
            got = log_spectrogram(received[b : b + len(ref)], rate).ravel()
            best = max(best, float(np.corrcoef(spec, got)[0, 1]))
        scores.append(best)
        weights.append(energy)
    return scores, weights


def window_similarity(sent, received, start: int, length: int) -> float:
    """Log-spectrogram correlation of `sent[start:start+length]` with the same window of the
    echo, found at the overall delay (two Opus passes keep spectra, not waveforms) give or take
    four frames."""
    import numpy as np
    from scipy.signal import correlate

    lag = int(np.argmax(correlate(received, sent, mode="full", method="fft"))) - (len(sent) - 1)
    ref = log_spectrogram(sent[start : start + length]).ravel()
    best = -1.0
    for shift in range(-4 * 1920, 4 * 1920 + 1, 240):
        b = start + lag + shift
        if b >= 0 and b + length <= len(received):
            got = log_spectrogram(received[b : b + length]).ravel()
            best = max(best, float(np.corrcoef(ref, got)[0, 1]))
    return best


def window_found(window, received, search: int, step: int = 240) -> float:
    """The best log-spectrogram correlation of `window` with any stretch of `received[:search]`
    (for output whose timing is not the input's: utterances cut at silences, bursts)."""
    import numpy as np

    ref = log_spectrogram(window).ravel()
    best = -1.0
    for b in range(0, max(0, min(search, len(received) - len(window))) + 1, step):
        got = log_spectrogram(received[b : b + len(window)]).ravel()
        best = max(best, float(np.corrcoef(ref, got)[0, 1]))
    return best


# ---------------------------------------------------------------------------------------------
# The server app in this process (an engine or manager the test builds), under the same uvicorn
# configuration `serve` uses, in a thread with its own event loop.


@dataclass
class AppServer:
    url: str
    ws_url: str
    app: object
    manager: object


@contextlib.contextmanager
def uvicorn_thread(server: Any, name: str = "uvicorn-test") -> Iterator[None]:
    """Run a `uvicorn.Server` in a thread with its own event loop until the block ends (an error
    if it has not started within 30 s)."""
    import threading

    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("in-process uvicorn did not start")
        time.sleep(0.02)
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(timeout=15)


@contextlib.contextmanager
def serving_app(manager, **settings) -> Iterator[AppServer]:
    """`create_app(ServerSettings(**settings), manager)` served by uvicorn on a free port, with
    the HTTP guard and WebSocket classes `personaplex-voice serve` runs with."""
    import uvicorn

    from personaplex_voice.process.settings import ServerSettings
    from personaplex_voice.process.uvicorn_setup import uvicorn_config
    from personaplex_voice.server.app import create_app

    options = {"engine": "echo", "tune_runtime": False, "log_level": "warning", **settings}
    config_settings = ServerSettings(host="127.0.0.1", port=free_port(), **options)
    app = create_app(config_settings, host=manager)
    port = config_settings.port
    with uvicorn_thread(uvicorn.Server(uvicorn_config(config_settings, app))):
        yield AppServer(f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}", app, manager)
