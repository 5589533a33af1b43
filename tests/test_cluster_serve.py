"""`serve --workers 2 --engine-workers 2 --engine echo`: the real supervisor, two front-end
processes on one port (SO_REUSEPORT), two engine-worker processes; real WebSockets and Opus
(the sphn client), the Twilio Media Streams simulator; faults by real signals.

What these check is where calls go and what faults do; how well the cluster keeps time (late
frames, hop, gaps) is measured by bench/cluster_load.py, so a busy machine fails nothing here.
Durations are bounded at several times what they take on a quiet machine."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import numpy as np
import pytest
import soundfile as sf
from scipy.signal import resample_poly
from support_cluster import cluster_state, process_alive, wait_for, worker_by_id
from support_server import chat, echo_similarity, running_server
from support_twilio import RATE, TwilioSimulator

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

SR = 24000
AUTH_TOKEN = "cluster-test-auth-token"
PUBLIC_URL = "https://voice.example.test"


def wait_cluster_up(server, workers: int = 2, frontends: int = 2) -> dict:
    """Until every engine worker is up and connected to every front-end (seen from both)."""
    state: dict = {}

    def up() -> bool:
        nonlocal state
        state = cluster_state(server.url)
        return len(state["workers"]) == workers and all(
            w["up"] and len(w["sessions_by_frontend"]) == frontends for w in state["workers"]
        )

    wait_for(up, timeout=60, what="cluster up")
    return state


def chat_url(server, **query: str) -> str:
    params = {"text_prompt": "You enjoy having a good conversation.", **query}
    return str(httpx.URL(server.ws_url + "/api/chat", params=params))


@pytest.fixture(scope="module")
def user_wav(golden_dir) -> np.ndarray:
    audio, rate = sf.read(golden_dir / "user.wav", dtype="float32")
    assert rate == SR
    return audio[: 4 * SR]


class Watcher:
    """Polls /api/cluster while calls run: which front-end x worker pairs carried sessions, and
    what each front-end said about torch."""

    def __init__(self, server):
        self.server = server
        self.pairs: set[tuple[str, str]] = set()
        self.frontends: dict[str, dict] = {}
        self.peak_used: dict[str, int] = {}

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            state = await asyncio.to_thread(cluster_state, self.server.url)
            self.frontends[state["frontend"]["id"]] = state["frontend"]
            for worker in state["workers"]:
                used = worker["slots"]["used"]
                self.peak_used[worker["id"]] = max(self.peak_used.get(worker["id"], 0), used)
                for frontend, count in worker["sessions_by_frontend"].items():
                    if count:
                        self.pairs.add((frontend, worker["id"]))
            await asyncio.sleep(0.1)


def bridge_records(base_url: str, call_sids: list[str]) -> list[dict]:
    """The Twilio bridge's record of each call, from every front-end (each keeps its own)."""
    found: dict[str, dict] = {}
    headers = {"Authorization": f"Bearer {TWILIO_ENV['PERSONAPLEX_TWILIO_API_TOKEN']}"}

    def all_found() -> bool:
        for record in httpx.get(base_url + "/twilio/calls", headers=headers).json()["calls"]:
            if record["call_sid"] in call_sids and record.get("metrics"):
                found[record["call_sid"]] = record
        return len(found) == len(call_sids)

    wait_for(all_found, timeout=20, what="every call's record")
    return list(found.values())


def metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


TWILIO_ENV = {
    "TWILIO_AUTH_TOKEN": AUTH_TOKEN,
    "TWILIO_ACCOUNT_SID": "",  # no REST client: nothing may reach Twilio's cloud
    "PUBLIC_URL": PUBLIC_URL,
    "PERSONAPLEX_TWILIO_API_TOKEN": "cluster-test-api-token",
}


async def phone_call(sim: TwilioSimulator, speech_8k: np.ndarray):
    """One simulated call: webhook (ticket), Media Stream (maybe on the other front-end),
    speech in real time, a second to hear the end of the echo."""
    call_sid, url, params = await asyncio.to_thread(sim.answer)
    async with sim.media_stream(url, params, call_sid=call_sid) as call:
        for _ in range(500):  # until our session is running and the audio flows
            if call.played or call.closed.is_set():
                break
            await asyncio.sleep(0.01)
        await call.play(speech_8k)
        await call.play(np.zeros(RATE, np.float32))
    return call


def test_chat_and_phone_calls_land_on_both_front_ends_and_both_engine_workers(user_wav):
    # 12 slots for 8 calls: two front-ends placing at once never race for the very last slot
    args = ("--workers", "2", "--engine-workers", "2", "--max-sessions", "6", "--twilio")
    with running_server(*args, env=TWILIO_ENV) as server:
        wait_cluster_up(server)
        watcher = Watcher(server)
        sim = TwilioSimulator(server.url, AUTH_TOKEN, public_url=PUBLIC_URL)
        speech_8k = resample_poly(user_wav, 1, 3).astype(np.float32)

        async def scenario():
            stop = asyncio.Event()
            watching = asyncio.create_task(watcher.run(stop))
            inputs = [np.roll(user_wav, i * SR // 3) for i in range(4)]
            chats = [chat(chat_url(server, seed=str(i)), x) for i, x in enumerate(inputs)]
            phones = [phone_call(sim, np.roll(speech_8k, i * RATE // 3)) for i in range(4)]
            results = await asyncio.gather(*chats, *phones)
            stop.set()
            await watching
            return inputs, results[:4], results[4:]

        inputs, chats, phones = asyncio.run(scenario())
        for sent, result in zip(inputs, chats, strict=True):
            assert result.errors == [] and result.handshake and result.close_code == 1000
            assert echo_similarity(sent, result.pcm) >= 0.8
        for i, call in enumerate(phones):
            sent = resample_poly(np.roll(speech_8k, i * RATE // 3), 3, 1)
            heard = resample_poly(call.played_audio(), 3, 1)
            assert not call.others and call.close_code == 1000, (call.others, call.close_code)
            assert echo_similarity(sent, heard) >= 0.8
        # Every call's record, from whichever front-end served it.
        records = bridge_records(server.url, [c.call_sid for c in phones])
        assert {r["end_reason"] for r in records} == {"stop"}, records
        assert {f for f, _ in watcher.pairs} == {"fe0", "fe1"}, watcher.pairs
        assert {w for _, w in watcher.pairs} == {"w0", "w1"}, watcher.pairs
        assert sum(watcher.peak_used.values()) >= 6  # they ran at once
        assert all(not f["torch_loaded"] for f in watcher.frontends.values())
        metrics = httpx.get(server.url + "/metrics").text
        assert 'personaplex_ticks_total{worker="w0"}' in metrics and 'worker="w1"' in metrics


async def timed_chat(url: str, audio: np.ndarray) -> tuple:
    """`chat`, and the monotonic time it ended (the server's close, or ours)."""
    result = await chat(url, audio, max_tail_s=5)
    return result, time.monotonic()


def max_gap_s(result, after: float) -> float:
    """Longest wait between two audio messages received after `after` (monotonic)."""
    times = [t for t, _ in result.arrivals if t >= after]
    return float(np.max(np.diff(times))) if len(times) > 1 else 0.0


def test_a_killed_engine_worker_ends_only_its_calls_and_comes_back(user_wav):
    with running_server("--workers", "1", "--engine-workers", "2", "--max-sessions", "4") as server:
        state = wait_cluster_up(server, frontends=1)
        victim = worker_by_id(state, "w0")

        async def scenario():
            long = np.tile(user_wav, 2)  # 8 s: the kill lands mid-call
            calls = [asyncio.create_task(timed_chat(chat_url(server, seed=str(i)), long)) for i in range(4)]
            placed: dict = {}

            def all_placed() -> bool:
                nonlocal placed
                placed = cluster_state(server.url)["frontend"]["session_workers"]
                return len(placed) == 4

            await asyncio.to_thread(wait_for, all_placed, 20)
            await asyncio.sleep(1.5)
            killed_at = time.monotonic()
            os.kill(victim["pid"], signal.SIGKILL)
            # a new call while w0 is down goes to w1
            fresh, _ = await timed_chat(chat_url(server), user_wav[: 2 * SR])
            results = await asyncio.gather(*calls)
            return placed, killed_at, fresh, results

        placed, killed_at, fresh, results = asyncio.run(scenario())
        on_victim = sorted(placed.values()).count("w0")
        assert 1 <= on_victim <= 3  # spread over both workers
        lost = [(r, t) for r, t in results if r.errors]
        kept = [r for r, _ in results if not r.errors]
        assert len(lost) == on_victim and len(kept) == 4 - on_victim
        for result, ended_at in lost:
            assert result.errors == ["the session ended on the server (engine_lost)"]
            assert ended_at - killed_at < 2.0, ended_at - killed_at  # at once: the socket closed
        for result in kept:  # the other worker's calls went on, whole
            assert result.close_code == 1000 and len(result.pcm) >= 2 * len(user_wav)
            assert echo_similarity(np.tile(user_wav, 2), result.pcm) >= 0.8
            assert max_gap_s(result, killed_at - 0.5) < 1.0
        assert fresh.errors == [] and echo_similarity(user_wav[: 2 * SR], fresh.pcm) >= 0.8

        def back() -> bool:
            worker = worker_by_id(cluster_state(server.url), "w0")
            return worker["up"] and worker["pid"] != victim["pid"] and worker["generation"] == 1

        wait_for(back, timeout=30, what="w0 restarted")
        assert not process_alive(victim["pid"])
        metrics = httpx.get(server.url + "/metrics").text
        assert 'personaplex_engine_worker_restarts{worker="w0"} 1.0' in metrics
        assert metric_sum(metrics, "personaplex_frontend_engine_lost_sessions_total") == on_victim


def test_a_killed_front_end_frees_its_slots_and_is_restarted(user_wav):
    # 6 slots for 4 calls: the two front-ends never race for the very last slot
    with running_server("--workers", "2", "--engine-workers", "1", "--max-sessions", "6") as server:
        wait_cluster_up(server, workers=1)

        async def scenario():
            long = np.tile(user_wav, 2)
            calls = [asyncio.create_task(timed_chat(chat_url(server), long)) for _ in range(4)]
            state: dict = {}

            def both_used() -> bool:
                nonlocal state
                state = cluster_state(server.url)
                counts = state["workers"][0]["sessions_by_frontend"]
                return sum(counts.values()) == 4

            await asyncio.to_thread(wait_for, both_used, 20)
            worker = state["workers"][0]
            victim = max(worker["sessions_by_frontend"], key=worker["sessions_by_frontend"].get)
            victim_pid = worker["frontend_pids"][victim]
            held = worker["sessions_by_frontend"][victim]
            os.kill(victim_pid, signal.SIGKILL)
            killed_at = time.monotonic()

            def freed() -> bool:
                w = cluster_state(server.url)["workers"][0]
                return w["slots"]["used"] == 4 - held and w["sessions_by_frontend"].get(victim, 0) == 0

            await asyncio.to_thread(wait_for, freed, 5, 0.02)
            freed_after = time.monotonic() - killed_at
            results = await asyncio.gather(*calls)
            return victim, victim_pid, held, freed_after, results

        victim, victim_pid, held, freed_after, results = asyncio.run(scenario())
        assert freed_after < 2.0, freed_after  # at once: the socket closed
        # the dead front-end's callers lost their socket; the other front-end's finished normally
        codes = sorted(r.close_code for r, _ in results)
        assert codes.count(1000) == 4 - held and all(r.errors == [] for r, _ in results)

        def restarted() -> bool:
            pids = cluster_state(server.url)["workers"][0]["frontend_pids"]
            return victim in pids and pids[victim] != victim_pid

        wait_for(restarted, timeout=30, what="front-end restarted")


def test_sigterm_drains_new_calls_refused_running_calls_finish(user_wav):
    with running_server("--workers", "2", "--engine-workers", "1", "--drain-s", "30") as server:
        wait_cluster_up(server, workers=1)

        async def scenario():
            audio = user_wav[: 3 * SR]
            running = asyncio.create_task(chat(chat_url(server), audio))
            await asyncio.to_thread(
                wait_for, lambda: cluster_state(server.url)["active"] == 1, 20, 0.05, "call running"
            )
            server.process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            # off this loop, which streams the running call
            ready = [await asyncio.to_thread(httpx.get, server.url + "/readyz") for _ in range(4)]
            refused = await chat(chat_url(server), audio[:SR])
            result = await running
            code = await asyncio.to_thread(server.process.wait, 30)
            return audio, ready, refused, result, code

        audio, ready, refused, result, code = asyncio.run(scenario())
        assert {r.status_code for r in ready} == {503}
        assert {r.json()["status"] for r in ready} == {"draining"}
        assert not refused.handshake and refused.close_code == 1013 and "full" in refused.errors[0]
        assert result.errors == [] and result.close_code == 1000  # it finished on its own
        assert echo_similarity(audio, result.pcm) >= 0.8
        assert code == 0
