"""One reservation per call: a signed answer webhook sent again (a replay, or the carrier
retrying) gets the very same answer and holds no second slot. Twilio's signatures carry no time,
so before this three copies of one signed `/twilio/voice` answered stream, stream, busy."""

from __future__ import annotations

import asyncio

from support_twilio import HttpSink, bridge_harness, parse_stream_twiml

PERSONAS = "default: desk\npersonas:\n  desk: {text_prompt: 'You answer for Acme.'}\n"


def test_three_copies_of_one_twilio_webhook_hold_one_reservation(tmp_path) -> None:
    with bridge_harness(PERSONAS, tmp_path) as h:
        first, second, third = (h.sim.voice_webhook(call_sid="CA" + "1" * 32) for _ in range(3))
        urls = {parse_stream_twiml(r.text)[0] for r in (first, second, third)}
        assert len(urls) == 1, [first.text, second.text, third.text]
        assert h.manager.reserved_count == 1  # the harness has 2 slots: one is still free
        other = h.sim.voice_webhook()  # another call gets the other slot
        assert "<Stream" in other.text and h.manager.reserved_count == 2


def test_a_replay_after_the_call_ended_gets_no_stream(tmp_path) -> None:
    with bridge_harness(PERSONAS, tmp_path) as h:
        call_sid = "CA" + "2" * 32
        assert "<Stream" in h.sim.voice_webhook(call_sid=call_sid).text
        assert h.sim.status_callback(call_sid, "completed").status_code == 204
        assert h.manager.reserved_count == 0  # the call's end gave its slot back
        again = h.sim.voice_webhook(call_sid=call_sid)
        assert "<Stream" not in again.text and "<Hangup" in again.text
        assert h.manager.reserved_count == 0


def test_concurrent_copies_share_one_decision(tmp_path) -> None:
    """Copies that arrive while the first is still being answered (its context lookup takes a
    while) wait for its answer: one lookup, one reservation, one stream URL."""
    slow = (
        "default: desk\npersonas:\n  desk:\n    text_prompt: 'Hi {name}.'\n    variables: {name: there}\n"
        "    context_url: URL\n    context_timeout_s: 3\n"
    )

    async def burst(h) -> list[str]:
        call_sid = "CA" + "3" * 32
        replies = await asyncio.gather(
            *(asyncio.to_thread(h.sim.voice_webhook, call_sid=call_sid) for _ in range(5))
        )
        return [parse_stream_twiml(r.text)[0] for r in replies]

    with (
        HttpSink(lambda n: (200, {"name": "Omar"}), delay_s=0.5) as crm,
        bridge_harness(slow.replace("URL", crm.url), tmp_path, webhook_secret="s") as h,
    ):
        assert len(set(asyncio.run(burst(h)))) == 1
        assert h.manager.reserved_count == 1 and len(crm.received) == 1
