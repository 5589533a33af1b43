"""Hostile input on every line, against `personaplex-voice serve --engine echo` with every carrier
(and Asterisk's AudioSocket listener) under uvicorn, the carriers' REST APIs faked by a recording
local server (support_phone):

- a stream whose ticket is made up, already used or expired, and whose start names a live call
  (its call id; on Telnyx its call-control id too), is closed 1008 and does nothing to that
  call: no request to the carrier's API, no status or end in its record, its audio going on;
- table-driven hostile input per carrier (support_hostile: webhook bodies nested at the depth
  limit and beyond, numbers of 400 digits, non-ASCII digits, NaN and infinity, bodies that stall
  or are too large, clients that leave half way; the same in stream messages, signature headers
  and the Asterisk sockets): each gets the expected refusal (a 4xx, or the WebSocket close code
  its protocol uses), and the server's log has no ERROR line and no traceback;
- a stream that fails before its start gives its call's reservation back (the host's count,
  polled; the bound only detects a hang), while a replay of the answer webhook still gets the
  same answer and no second slot; a `stop` before `start` is a clean close (1000).

bench/abuse.py measures how many such cases a second the server refuses beside good calls.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import numpy as np
import pytest
from personaplex_phone.simulator import PhoneSimulator, StreamOffer
from support_hostile import (
    CLOSE_INVALID,
    CLOSE_NORMAL,
    CLOSE_POLICY,
    DEEP,
    HANG_S,
    JSON_STREAMS,
    MADE_UP,
    WS_CARRIERS,
    Outcome,
    asterisk_round,
    carrier_round,
    genesys_round,
    left_after_upgrade,
    ticket_of,
    webhook_round,
    with_ticket,
    ws_case,
)
from support_phone import (
    CARRIERS,
    PUBLIC_URL,
    FakeCarrierApis,
    calls_state,
    carrier_env,
    carrier_side,
    record_of,
    speechlike,
    wait_idle,
)
from support_server import ServerProcess, free_port, running_server

pytestmark = pytest.mark.timeout(300)

CONNECT_TIMEOUT_S = 3.0  # the server's PERSONAPLEX_PHONE_STREAM_CONNECT_TIMEOUT_S: tickets expire fast
BODY_TIMEOUT_S = 2.0  # its PERSONAPLEX_HTTP_REQUEST_TIMEOUT_S: a webhook body stalled this long: 408
PERSONAS = "default: desk\npersonas:\n  desk: {text_prompt: 'You answer for Acme.'}\n"


@pytest.fixture(scope="module")
def apis() -> Iterator[FakeCarrierApis]:
    fake = FakeCarrierApis().start()
    yield fake
    fake.stop()


@pytest.fixture(scope="module")
def audiosocket() -> tuple[str, int]:
    return "127.0.0.1", free_port()


@pytest.fixture(scope="module")
def server(tmp_path_factory, apis, audiosocket) -> Iterator[ServerProcess]:
    personas = tmp_path_factory.mktemp("hostile") / "personas.yaml"
    personas.write_text(PERSONAS)
    env = {
        **carrier_env(apis.url, str(personas)),
        "PERSONAPLEX_PHONE_STREAM_CONNECT_TIMEOUT_S": str(CONNECT_TIMEOUT_S),
        "PERSONAPLEX_HTTP_REQUEST_TIMEOUT_S": str(BODY_TIMEOUT_S),
    }
    carriers = ",".join((*CARRIERS, "asterisk", "jambonz", "genesys"))
    listen = f"{audiosocket[0]}:{audiosocket[1]}"
    args = ("--carriers", carriers, "--audiosocket", listen, "--max-sessions", "4")
    with running_server(*args, env=env) as proc:
        yield proc


def simulator(server: ServerProcess, carrier: str) -> PhoneSimulator:
    return PhoneSimulator(carrier_side(carrier), server.url, public_url=PUBLIC_URL)


def assert_clean_log(text: str) -> None:
    """No ERROR line and no traceback: a peer's bad input is one WARNING (or INFO) line."""
    bad = [line for line in text.splitlines() if " ERROR " in line or "Traceback" in line]
    assert not bad, "\n".join(bad[:10])


async def settled_log(server: ServerProcess, mark: int) -> str:
    await asyncio.sleep(0.3)  # the last refusals' lines
    return server.log()[mark:]


async def reserved(server: ServerProcess) -> int:
    return (await asyncio.to_thread(calls_state, server))["reserved"]


async def until_reserved(server: ServerProcess, count: int) -> None:
    """Polls the host's reservations down to `count` (the bound only detects a hang)."""
    deadline = time.monotonic() + HANG_S
    while (now := await reserved(server)) != count:
        assert time.monotonic() < deadline, f"{now} reservation(s) kept, not {count}"
        await asyncio.sleep(0.05)


async def end_call(sim: PhoneSimulator, offer: StreamOffer) -> None:
    """The carrier says the call is over: a reservation it still holds goes (Asterisk's, which
    has no status webhook, expires)."""
    if sim.side.name not in ("asterisk", "genesys"):
        assert await sim.status(offer.call_id, "completed") == 204


# --- a stream presenting a ticket that is not its call's ------------------------------------------


@pytest.mark.parametrize("carrier", WS_CARRIERS)
async def test_a_stream_with_a_made_up_used_or_expired_ticket_does_nothing_to_the_call_it_names(
    server, apis, carrier
) -> None:
    await wait_idle(server)
    mark = len(server.log())
    sim = simulator(server, carrier)
    victim = await sim.answer()
    late = await sim.answer()  # another call, whose ticket expires unused
    rate = victim.inbound.rate
    async with sim.stream(victim) as call:
        await call.answered()
        await asyncio.sleep(CONNECT_TIMEOUT_S + 0.5)  # `late`'s ticket expires meanwhile
        await call.play(np.zeros(rate // 10, np.float32))
        before = len(apis.requests_for(carrier))
        heard = len(call.played)
        tickets = {"made up": MADE_UP, "used": ticket_of(victim), "expired": ticket_of(late)}
        for what, ticket in tickets.items():
            # The carrier's own opening, naming the live call (Telnyx: its call-control id too).
            async with sim.stream(with_ticket(victim, ticket), hang_up=False) as hostile:
                await asyncio.wait_for(hostile.closed.wait(), HANG_S)
            assert hostile.close_code == CLOSE_POLICY, (what, hostile.close_code)
            assert not hostile.played, what
        # The live call goes on: its audio still echoes, it is still the one live call.
        await call.play(speechlike(1.0, rate))
        # Its echo comes back (Exotel's 200 ms messages come a few hundred ms after the speech).
        deadline = time.monotonic() + HANG_S
        while len(call.played) <= heard:
            assert time.monotonic() < deadline, "the live call's audio no longer comes back"
            await asyncio.sleep(0.05)
        live = (await asyncio.to_thread(calls_state, server))["live"]
        assert [c["call_sid"] for c in live] == [victim.call_id]
        await asyncio.sleep(0.5)  # a request the refusals might have made would have come by now
        assert apis.requests_for(carrier)[before:] == []  # nothing asked of the carrier's API
    await wait_idle(server)
    record = await asyncio.to_thread(record_of, server, victim.call_id)
    assert record["end_reason"] == "stop", record["end_reason"]
    assert [s["status"] for s in record["statuses"]].count("stream-started") == 1
    assert record["actions"] == []
    await end_call(sim, late)
    text = await settled_log(server, mark)
    assert_clean_log(text)
    refusals = [line for line in text.splitlines() if " WARNING " in line and "ticket refused" in line]
    assert len(refusals) == len(tickets), text[-3000:]  # one WARNING line each, and nothing more


# How a stream fails before its start: an unreadable first message, the carrier gone without a
# word, or (the Twilio-style JSON streams, which have one) a stop.
PRE_START_FAILURES = [
    *((carrier, how) for how in ("unreadable", "left") for carrier in (*WS_CARRIERS, "asterisk")),
    *((carrier, "stop") for carrier in JSON_STREAMS),
]


@pytest.mark.parametrize(("carrier", "how"), PRE_START_FAILURES)
async def test_a_stream_that_fails_before_its_start_gives_its_reservation_back(server, carrier, how) -> None:
    await wait_idle(server)
    mark = len(server.log())
    sim = simulator(server, carrier)
    call_id = sim.new_call_id()
    answer = sim.side.answer_request(PUBLIC_URL, call_id, "+15550100001", "+15550100002")
    status, body = await sim.request(answer)
    offer = sim.side.parse_answer(call_id, status, body)
    assert offer is not None and await reserved(server) == 1
    if how == "unreadable":
        assert await ws_case(server, sim.side, offer, ["[" * DEEP]) == CLOSE_INVALID
    elif how == "left":
        await left_after_upgrade(server, sim, offer)
    else:
        # The caller hangs up while the stream connects: the carrier's greeting (where it has
        # one), then its stop.
        opening = sim.side.opening(offer, "SS0123456789abcdef")
        stop = json.dumps({"event": "stop", "sequenceNumber": "2", "stop": {"callSid": call_id}})
        assert await ws_case(server, sim.side, offer, [*opening[:-1], stop]) == CLOSE_NORMAL
    await until_reserved(server, 0)  # free again at once
    if carrier != "asterisk":  # the dialplan's request is no carrier's webhook: each is a new call
        # The answer webhook again (a replay, the carrier retrying): the same answer, no slot.
        again = await sim.request(answer)
        assert sim.side.parse_answer(call_id, *again).url == offer.url
        assert await reserved(server) == 0
        await end_call(sim, offer)
    assert_clean_log(await settled_log(server, mark))


def assert_refused(outcomes: list[Outcome]) -> None:
    wrong = [str(o) for o in outcomes if not o.ok]
    assert not wrong, "\n".join(wrong)
    assert len(outcomes) >= 7  # the table ran


@pytest.mark.parametrize("carrier", WS_CARRIERS)
async def test_hostile_input_is_refused_and_logged_without_an_error(server, carrier) -> None:
    await wait_idle(server)
    mark = len(server.log())
    sim = simulator(server, carrier)
    offer = await sim.answer()  # a real call: its URL for the made-up ticket, its own ticket last
    outcomes = await carrier_round(server, carrier, sim, offer, own=offer)
    if carrier not in JSON_STREAMS:
        await end_call(sim, offer)  # its ticket unused: the carrier says the call is over
    outcomes += await webhook_round(server, carrier, sim)
    assert_refused(outcomes)
    await wait_idle(server)
    assert_clean_log(await settled_log(server, mark))


async def test_hostile_input_on_asterisk_is_refused_and_logged_without_an_error(server, audiosocket) -> None:
    """The dialplan's requests, chan_websocket's events (plain text and JSON) and AudioSocket's
    binary messages."""
    await wait_idle(server)
    mark = len(server.log())
    sim = simulator(server, "asterisk")
    outcomes = await webhook_round(server, "asterisk", sim)
    outcomes += await asterisk_round(server, sim, audiosocket)
    assert_refused(outcomes)
    await until_reserved(server, 0)  # every leg failed before its start: no slot kept
    await wait_idle(server)
    assert_clean_log(await settled_log(server, mark))


async def test_hostile_input_on_genesys_is_refused_and_logged_without_an_error(server) -> None:
    await wait_idle(server)
    mark = len(server.log())
    outcomes = await genesys_round(server, simulator(server, "genesys"))
    assert_refused(outcomes)
    await wait_idle(server)
    assert_clean_log(await settled_log(server, mark))
