"""NVIDIA's PersonaPlex web client (github NVIDIA/personaplex, client/), spoken as it speaks it,
against the echo server: its query string (text_seed/audio_seed, pad_mult, repetition penalty,
voice NATF0.pt), the server-info schema it validates the 0x04 metadata with, and its timing: it
listens to agent audio, and starts its microphone, only once its decoder has warmed up, about
1 s after connecting. Whatever the server sent before that is lost to it, so the first agent
audio it hears (Ogg headers included) must come after its first words: the echo of them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from urllib.parse import urlencode

import numpy as np
import opuslib
import pytest
import soundfile as sf
from scipy.signal import correlate
from support_abuse import ogg_page, opus_headers
from support_server import echo_similarity, running_server

from personaplex_voice.audio.opus import OggOpusReader

SR = 24000
LISTEN_AFTER_S = 1.0  # the client's decoder warm-up (prewarmDecoderWorker's timeout)
PACKET = 480  # the client's encoder: 20 ms Opus frames at 24 kHz, two frames per Ogg page

# The client's ServersInfoSchema (hooks/useServerInfo.ts): every key required, of these types.
SCHEMA = {
    "text_temperature": "number",
    "text_topk": "number",
    "audio_temperature": "number",
    "audio_topk": "number",
    "pad_mult": "number",
    "repetition_penalty_context": "number",
    "repetition_penalty": "number",
    "lm_model_file": "string",
    "instance_name": "string",
}
BUILD_INFO = [
    "build_timestamp",
    "build_date",
    "git_branch",
    "git_timestamp",
    "git_date",
    "git_hash",
    "git_describe",
    "rustc_host_triple",
    "rustc_version",
    "cargo_target_triple",
]


def schema_problems(info: dict) -> list[str]:
    def kind(value) -> str:
        if isinstance(value, bool):
            return "boolean"
        return "number" if isinstance(value, int | float) else "string" if isinstance(value, str) else "other"

    problems = [f"{k}: {kind(info.get(k))}" for k, t in SCHEMA.items() if kind(info.get(k)) != t]
    build = info.get("build_info")
    if not isinstance(build, dict):
        return [*problems, "build_info: not an object"]
    return problems + [f"build_info.{k}" for k in BUILD_INFO if not isinstance(build.get(k), str)]


def reference_query(text_seed: int, audio_seed: int) -> str:
    """Conversation.tsx's buildURL, with the client's defaults (useModelParams.ts)."""
    return urlencode(
        [
            ("text_temperature", "0.7"),
            ("text_topk", "25"),
            ("audio_temperature", "0.8"),
            ("audio_topk", "250"),
            ("pad_mult", "0"),
            ("text_seed", str(text_seed)),
            ("audio_seed", str(audio_seed)),
            ("repetition_penalty_context", "64"),
            ("repetition_penalty", "1"),
            (
                "text_prompt",
                "You are a wise and friendly teacher. Answer questions or provide advice in a clear "
                "and engaging way.",
            ),
            ("voice_prompt", "NATF0.pt"),
        ]
    )


class MicrophoneEncoder:
    """opus-recorder's stream as the client configures it: 20 ms frames, two per page."""

    def __init__(self) -> None:
        self._encoder = opuslib.Encoder(SR, 1, "voip")
        self._seq, self._granule, self._started = 2, 0, False

    def pages(self, pcm: np.ndarray) -> bytes:
        out = b"" if self._started else opus_headers()
        self._started = True
        packets = [
            self._encoder.encode_float(pcm[i : i + PACKET].tobytes(), PACKET)
            for i in range(0, len(pcm), PACKET)
        ]
        for i in range(0, len(packets), 2):
            self._granule += 2 * PACKET * 2  # 48 kHz samples
            out += ogg_page(packets[i : i + 2], self._seq, granule=self._granule)
            self._seq += 1
        return out


async def reference_call(url: str, speech: np.ndarray) -> dict:
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    heard, metadata, kinds = [], [], set()
    connected_at = time.monotonic()
    handshake = asyncio.Event()
    listening = asyncio.Event()
    async with connect(url, compression=None, proxy=None, max_size=None, open_timeout=30) as ws:

        async def receive() -> None:
            with contextlib.suppress(ConnectionClosed):
                async for message in ws:
                    kinds.add(message[0])
                    if message[0] == 0x00:
                        handshake.set()
                    elif message[0] == 0x04:
                        metadata.append(json.loads(message[1:]))
                    elif message[0] == 0x01 and listening.is_set():
                        heard.append(message[1:])  # before that, the socket has no audio listener

        receiver = asyncio.create_task(receive())
        await asyncio.wait_for(handshake.wait(), 30)
        await asyncio.sleep(max(0.0, connected_at + LISTEN_AFTER_S - time.monotonic()))
        listening.set()  # decoder ready: listen, and start the microphone (useServerAudio.ts)
        mic, start = MicrophoneEncoder(), time.monotonic()
        frame = 2 * PACKET  # one page every 40 ms
        padded = np.concatenate([speech, np.zeros(SR, np.float32)])  # then a second of silence
        for i, at in enumerate(range(0, len(padded) - frame + 1, frame)):
            await ws.send(b"\x01" + mic.pages(padded[at : at + frame]))
            await asyncio.sleep(max(0.0, start + (i + 1) * frame / SR - time.monotonic()))
        await ws.close()
        await receiver
    return {"heard": heard, "metadata": metadata, "kinds": kinds}


@pytest.fixture(scope="module")
def speech(golden_dir) -> np.ndarray:
    audio, rate = sf.read(golden_dir / "user.wav", dtype="float32")
    assert rate == SR
    return audio[: 3 * SR]


def test_the_reference_client_hears_the_echo_of_its_first_words(speech):
    with running_server("--max-sessions", "2") as srv:
        call = asyncio.run(reference_call(f"{srv.ws_url}/api/chat?{reference_query(811, 4242)}", speech))

    assert call["metadata"], "no 0x04 metadata"
    for info in call["metadata"]:
        assert schema_problems(info) == [], info  # its server-info panel shows, no console error
    assert call["metadata"][0]["voice"] == "NATF0.pt"
    assert call["metadata"][0]["seed"] == 811 * 2**32 + 4242  # its two seeds, as our one
    assert call["kinds"] <= {0x00, 0x01, 0x02, 0x04}  # its decoder throws on any other kind

    # What it heard decodes from its first message on: the Ogg headers came after it listened.
    reader = OggOpusReader(SR)
    heard = np.concatenate([pcm for page in call["heard"] for pcm in reader.feed(page)])
    assert len(heard) >= len(speech)
    # ...and it starts with its own first words (the echo engine's one-frame delay aside).
    window = 2 * SR
    lag = int(np.argmax(correlate(heard[:window], speech[:window], mode="full"))) - (window - 1)
    assert 0 <= lag <= int(0.25 * SR), lag / SR
    assert echo_similarity(speech, heard) >= 0.8
