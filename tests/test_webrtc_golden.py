"""The golden model (the tiny published PersonaPlex) behind WebRTC gives the same tokens as behind
/api/chat, for the same input and seed.

"The same input" is the same Opus packets: the caller's audio (the golden user.wav) is encoded
once here, with libopus through opuslib; /api/chat gets the packets in Ogg pages (pre-skip 0,
so no sample is trimmed), WHIP gets them as RTP through aiortc's client side (a track handing
out the packets as they are). Both servers' decoders then see the same packets from a fresh
state, the session the same PCM, and greedy sampling with one seed must give the same tokens,
frame for frame. The host is lossless (not realtime: it waits for input instead of ticking),
so a busy machine cannot make a frame late on one transport and not the other.
"""

from __future__ import annotations

import asyncio
import fractions
import time
from typing import Any
from urllib.parse import urlencode

import numpy as np
import pytest
import torch
from aiortc.mediastreams import MediaStreamTrack
from support_server import serving_app
from support_webrtc import WebRTCCaller

from personaplex_voice.audio.io import read_audio
from personaplex_voice.audio.opus import OpusHead, OpusTags, _build_page
from personaplex_voice.audio.opus_library import opuslib
from personaplex_voice.engine.base import FRAME_SIZE
from personaplex_voice.engine.generator import PersonaPlexEngine
from personaplex_voice.model.sources import resolve_model
from personaplex_voice.sessions import SessionManager

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SR = 24000
QUERY = {
    "text_prompt": "You enjoy having a good conversation.",
    "voice_prompt": "TINYF0.pt",
    "greedy": "1",
    "seed": "5",
}


class RecordingHost:
    """The manager, with every session's output tokens kept by session id."""

    def __init__(self, manager: SessionManager) -> None:
        self._manager = manager
        self.tokens: dict[str, list[np.ndarray]] = {}  # by session id, in the order opened

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    async def open(self, *args: Any, **kwargs: Any) -> Any:
        return RecordingSession(await self._manager.open(*args, **kwargs), self.tokens)


class RecordingSession:
    def __init__(self, session: Any, tokens: dict[str, list[np.ndarray]]) -> None:
        self._session = session
        self._tokens = tokens.setdefault(session.id, [])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)

    async def frames(self) -> Any:
        async for frame in self._session.frames():
            self._tokens.append(frame.tokens.copy())
            yield frame


def opus_packets(pcm: np.ndarray) -> list[bytes]:
    encoder = opuslib.Encoder(SR, 1, "voip")
    return [encoder.encode_float(pcm[i : i + 480].tobytes(), 480) for i in range(0, len(pcm), 480)]


def ogg_pages(packets: list[bytes]) -> list[bytes]:
    """An Ogg-Opus stream of exactly these packets (RFC 7845), pre-skip 0: the headers' pages
    first, then one page per packet."""
    serial = 0x5EED
    head = OpusHead(channels=1, pre_skip=0, input_sample_rate=SR, output_gain_q8=0)
    pages = [
        _build_page(head.to_bytes(), flags=0x02, granule=0, serial=serial, seq=0),
        _build_page(OpusTags(vendor="test").to_bytes(), flags=0, granule=0, serial=serial, seq=1),
    ]
    for i, packet in enumerate(packets):
        pages.append(_build_page(packet, flags=0, granule=(i + 1) * 960, serial=serial, seq=i + 2))
    return pages


class PacketTrack(MediaStreamTrack):
    """Hands aiortc the encoded packets as they are (aiortc packs an av.Packet without encoding),
    20 ms apart, once `go` is set."""

    kind = "audio"

    def __init__(self, packets: list[bytes], go: asyncio.Event) -> None:
        super().__init__()
        self.packets, self.go, self.i = packets, go, 0
        self.t0: float | None = None

    async def recv(self) -> Any:
        import av

        await self.go.wait()
        if self.i >= len(self.packets):
            await asyncio.sleep(3600)
        if self.t0 is None:
            self.t0 = time.monotonic()
        await asyncio.sleep(max(0.0, self.t0 + self.i * 0.02 - time.monotonic()))
        packet = av.Packet(self.packets[self.i])
        packet.pts = self.i * 960
        packet.time_base = fractions.Fraction(1, 48000)
        self.i += 1
        return packet


async def until_frames(host: RecordingHost, index: int, frames: int) -> None:
    """Until the `index`-th session opened has put out `frames` frames (a hang bound only)."""
    deadline = time.monotonic() + 180
    while True:
        opened = list(host.tokens.values())
        if len(opened) > index and len(opened[index]) >= frames:
            return
        assert time.monotonic() < deadline, "the session did not produce its frames"
        await asyncio.sleep(0.05)


async def chat_call(ws_url: str, pages: list[bytes], frames: int, host: RecordingHost) -> list[str]:
    from websockets.asyncio.client import connect

    text: list[str] = []

    async def read(ws: Any) -> None:
        async for message in ws:
            if message[0] == 0x02:
                text.append(message[1:].decode())

    async with connect(ws_url + "/api/chat?" + urlencode(QUERY)) as ws:
        while (await ws.recv())[0] != 0x00:  # metadata until the handshake
            pass
        reader = asyncio.create_task(read(ws))
        for i in range(0, len(pages), 10):  # 200 ms of audio a message, faster than real time
            await ws.send(b"\x01" + b"".join(pages[i : i + 10]))
            await asyncio.sleep(0.05)
        await until_frames(host, 0, frames)
        await asyncio.sleep(0.5)  # the last text pieces
        reader.cancel()
    return text


async def whip_call(url: str, packets: list[bytes], frames: int, host: RecordingHost) -> list[str]:
    caller = WebRTCCaller(url, query=QUERY)
    go = asyncio.Event()
    original = caller._new_peer

    def with_packets() -> Any:
        pc = original()
        pc.getTransceivers()[0].sender.replaceTrack(PacketTrack(packets, go))
        return pc

    caller._new_peer = with_packets
    result = await caller.connect(handshake_timeout=120)
    assert result.handshake_at is not None, result.body
    go.set()
    await until_frames(host, 1, frames)
    await asyncio.sleep(0.5)  # the last text pieces on the data channel
    await caller.hang_up("delete")
    return result.text


def test_webrtc_and_api_chat_give_the_same_tokens(golden_dir):
    torch.set_num_threads(1)
    engine = PersonaPlexEngine(resolve_model(str(golden_dir)), num_slots=2)
    manager = SessionManager(engine, realtime=False)
    host = RecordingHost(manager)
    user = read_audio(golden_dir / "user.wav")
    user = np.pad(user, (0, 70 * FRAME_SIZE - user.size)).astype(np.float32)
    packets = opus_packets(user)
    frames = len(user) // FRAME_SIZE
    with serving_app(host, engine="model") as server:
        chat_text = asyncio.run(chat_call(server.ws_url, ogg_pages(packets), frames, host))
        webrtc_text = asyncio.run(whip_call(server.url, packets, frames, host))
    chat_run, webrtc_run = list(host.tokens.values())
    chat_tokens = np.stack(chat_run[:frames])
    webrtc_tokens = np.stack(webrtc_run[:frames])
    assert chat_tokens.shape == (frames, 9)  # text, then the agent's 8 audio codebooks
    assert len(np.unique(chat_tokens[:, 1])) > 10  # it babbles: a real run, not a constant
    np.testing.assert_array_equal(webrtc_tokens, chat_tokens)
    # What each client read: the same text pieces, in the same order.
    assert "".join(webrtc_text).strip() and "".join(webrtc_text) == "".join(chat_text)
