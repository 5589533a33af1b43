"""Bad input on /api/chat: 1,000 malformed messages, each either refused (0x05 then close, or an
HTTP 4xx on the upgrade for a bad query) or ignored, while a well-behaved caller keeps its
real-time call; afterwards every slot is free."""

from __future__ import annotations

import asyncio
import random
import struct
import time
from dataclasses import dataclass

import httpx
import numpy as np
import soundfile as sf
import sphn
from support_server import chat, echo_similarity, running_server
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from personaplex_voice.audio.opus import ogg_crc

SR = 24000
SEED = 1234
CONCURRENCY = 3


@dataclass
class Case:
    name: str
    messages: list[bytes | str]
    query: dict[str, str]
    expect: str  # "error", "ignored" or "either"


def split_pages(data: bytes) -> list[bytes]:
    pages, pos = [], 0
    while pos < len(data):
        segments = data[pos + 26]
        size = 27 + segments + sum(data[pos + 27 : pos + 27 + segments])
        pages.append(data[pos : pos + size])
        pos += size
    return pages


def valid_ogg_pages() -> list[bytes]:
    writer = sphn.OpusStreamWriter(SR)
    tone = (0.2 * np.sin(2 * np.pi * 440 * np.arange(SR // 2) / SR)).astype(np.float32)
    data = b"".join(writer.append_pcm(tone[i : i + 1920]) for i in range(0, len(tone), 1920))
    return split_pages(data)


def build_cases(rng: random.Random) -> list[Case]:
    pages = valid_ogg_pages()
    headers, audio_pages = b"".join(pages[:2]), pages[2:]
    cases: list[Case] = []

    # 450 messages the protocol says to ignore, 50 per connection.
    ignorable: list[bytes | str] = []
    for _ in range(300):
        kind = rng.choice([k for k in range(256) if k != 0x01])
        ignorable.append(bytes([kind]) + rng.randbytes(rng.randrange(0, 200)))
    ignorable += [b""] * 50
    ignorable += ["".join(rng.choice('abc{}"é ') for _ in range(rng.randrange(1, 80))) for _ in range(100)]
    rng.shuffle(ignorable)
    for i in range(0, len(ignorable), 50):
        cases.append(Case("ignorable kinds", ignorable[i : i + 50], {}, "ignored"))

    # 550 messages that end their connection (or may be skipped as local damage), one each.
    for _ in range(150):
        junk = rng.randbytes(rng.randrange(4, 400))
        if junk.startswith(b"OggS"):
            junk = b"X" + junk
        cases.append(Case("corrupt ogg", [b"\x01" + junk], {}, "error"))
    for _ in range(100):
        page = rng.choice(audio_pages)
        cut = rng.randrange(1, len(page) - 1)
        cases.append(Case("truncated ogg", [b"\x01" + headers + page[:cut], b"\x01" + page], {}, "either"))
    for _ in range(100):
        page = bytearray(rng.choice(audio_pages))
        for _ in range(rng.randrange(1, 4)):
            page[rng.randrange(len(page))] ^= 1 << rng.randrange(8)
        cases.append(Case("bit flips", [b"\x01" + headers + bytes(page)], {}, "either"))
    for _ in range(50):
        packet = b"\x01vorbis" + rng.randbytes(20)
        page = bytearray(
            struct.pack("<4sBBqIIIB", b"OggS", 0, 0x02, 0, 7, 0, 0, 1) + bytes([len(packet)]) + packet
        )
        struct.pack_into("<I", page, 22, ogg_crc(bytes(page)))  # a valid page, of the wrong codec
        body = bytes(page)
        cases.append(Case("not opus", [b"\x01" + body], {}, "error"))
    for _ in range(50):
        cases.append(Case("oversize", [b"\x01" + rng.randbytes(300 * 1024)], {}, "error"))
    bad_queries = [
        {"voice_prompt": "../../etc/passwd"},
        {"voice_prompt": "/etc/passwd"},
        {"voice_prompt": "..\\..\\boot.ini"},
        {"voice_prompt": "NOPE"},
        {"text_temperature": "abc"},
        {"text_temperature": "nan"},
        {"audio_temperature": "inf"},
        {"audio_temperature": "-1"},
        {"text_topk": "0"},
        {"audio_topk": "1e12"},
        {"seed": "x"},
        {"seed": "99999999999999999999999"},
        {"greedy": "maybe"},
        {"text_prompt": "x" * 5000},
    ]
    for i in range(100):
        cases.append(Case("bad query", [], bad_queries[i % len(bad_queries)], "error"))
    assert sum(max(1, len(c.messages)) if c.name != "truncated ogg" else 1 for c in cases) == 1000
    rng.shuffle(cases)
    return cases


async def run_case(base_url: str, case: Case) -> tuple[str, list[str]]:
    """Send the case's messages; classify what the server did: "error" (0x05 then close, or a
    4xx answer to the upgrade with the reason in its body), "ignored" (the call goes on:
    handshake, no error, still open) or "bad" (anything else)."""
    url = str(httpx.URL(base_url, params={"text_prompt": "hi", **case.query}))
    errors: list[str] = []
    closed, handshake = False, False
    try:
        ws = await connect(url, compression=None, proxy=None, max_size=None, open_timeout=30)
    except InvalidStatus as exc:
        body = exc.response.body.decode("utf-8", "replace")
        return ("error" if 400 <= exc.response.status_code < 500 else "bad"), [body]
    async with ws:
        try:
            for message in case.messages:
                await ws.send(message)
            sent_at = time.monotonic()
            while True:
                # The server answers audio frame by frame (none is valid here), so a call that
                # ignored the junk stays open and quiet: handshake, no error, not closed.
                quiet_for = 0.3 - (time.monotonic() - sent_at)
                try:
                    message = await asyncio.wait_for(
                        ws.recv(), timeout=max(quiet_for, 0.01) if handshake else 20
                    )
                except TimeoutError:
                    if handshake and not errors:
                        break
                    raise
                if isinstance(message, bytes) and message[:1] == b"\x05":
                    errors.append(message[1:].decode())
                handshake |= isinstance(message, bytes) and message[:1] == b"\x00"
        except ConnectionClosed:
            closed = True
    if closed and errors:
        return "error", errors
    if not closed and not errors:
        return "ignored", errors
    return "bad", errors


def test_thousand_malformed_messages_harm_nobody(golden_dir):
    user = sf.read(golden_dir / "user.wav", dtype="float32")[0]
    cases = build_cases(random.Random(SEED))
    with running_server("--max-sessions", "8") as srv:
        url = srv.ws_url + "/api/chat"

        async def flood():
            gate = asyncio.Semaphore(CONCURRENCY)

            async def one(case: Case):
                async with gate:
                    return case, await run_case(url, case)

            return await asyncio.gather(*(one(c) for c in cases))

        async def scenario():
            good = asyncio.create_task(chat(str(httpx.URL(url, params={"text_prompt": "hi"})), user))
            outcomes = await flood()
            return await good, outcomes

        good, outcomes = asyncio.run(scenario())

        bad = [(c.name, c.query, outcome, errors) for c, (outcome, errors) in outcomes if outcome == "bad"]
        assert not bad, bad[:5]
        for case, (outcome, errors) in outcomes:
            if case.expect != "either":
                assert outcome == case.expect, (case.name, case.query, outcome, errors)
            if outcome == "error":
                assert errors[0].strip(), case.name  # said in words
        refused = {c.name for c, (o, _) in outcomes if o == "error"}
        assert {"corrupt ogg", "not opus", "oversize", "bad query"} <= refused

        # The good caller kept its real-time call: all of its audio came back, recognisably.
        assert good.errors == [] and good.handshake
        assert len(good.pcm) >= len(user)
        assert echo_similarity(user, good.pcm) >= 0.8

        with httpx.Client(base_url=srv.url) as client:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and client.get("/healthz").json()["active"]:
                time.sleep(0.1)
            health = client.get("/healthz").json()
            assert health["active"] == 0 and health["queued"] == 0
            assert client.get("/readyz").status_code == 200
            metrics = client.get("/metrics").text
            assert "personaplex_active_slots 0.0" in metrics
        assert srv.alive()
