"""Actions: the caller's keys and the agent's own words act on the call through Twilio's REST
API (faked at its HTTP boundary), each at most as configured, each in the call record; the
persona's length limit ends with a goodbye; a lost engine ends with an apology or a fallback."""

from __future__ import annotations

import asyncio
import xml.etree.ElementTree as ET
from urllib.parse import urlsplit

import numpy as np
import pytest
from personaplex_phone.actions import ActionMatcher, parse_rules
from personaplex_phone.personas import PersonaBook
from support_twilio import bridge_harness, parse_stream_twiml

from personaplex_voice.engine.loopback import LoopbackEngine
from personaplex_voice.errors import UserError

# The loopback engine says this, one piece per 80 ms frame, over and over.
PIECES = [" Please", " hold", " while", " I", " check.", None, None, None]
PERSONAS = """
default: desk
personas:
  desk:
    text_prompt: "You answer for Acme."
    max_call_s: MAXCALL
    goodbye: "Sorry, we are out of time. Goodbye."
    actions:
      - on_dtmf: "0"
        do: transfer
        to: "+15551230099"
        announce: "Connecting you to a colleague."
        whisper: "A caller from the Acme line."
      - on_dtmf: "7"
        do: transfer
        to: "sip:queue@pbx.example.test"
      - on_dtmf: "9"
        do: hangup
        say: "Thanks for calling."
      - on_dtmf: "5"
        do: redirect
        url: "https://ivr.example.test/menu.xml"
  holder:
    text_prompt: "You look things up."
    actions:
      - on_agent_text: "hold\\\\s+while"
        do: play
        say: "One moment please."
        then: resume
"""


def harness(tmp_path, max_call_s: float = 60.0, **settings):
    engine = LoopbackEngine(num_slots=2, text_pieces=PIECES)
    return bridge_harness(PERSONAS.replace("MAXCALL", str(max_call_s)), tmp_path, engine=engine, **settings)


def twiml_of(sent) -> ET.Element:
    return ET.fromstring(sent.data["Twiml"])


async def press_on_a_live_call(h, digit: str):
    """A call that has audio flowing; `digit` pressed; returns (call_sid, the simulated call)."""
    call_sid, url, params = await asyncio.to_thread(h.sim.answer)
    async with h.sim.media_stream(url, params, call_sid=call_sid) as call:
        await call.answered()
        await call.dtmf(digit)
        talker = asyncio.create_task(call.play(np.zeros(8000 * 5, np.float32)))
        await asyncio.wait_for(call.closed.wait(), 10)
        talker.cancel()
    return call_sid, call


async def test_dtmf_0_transfers_with_dial_to_the_configured_number(tmp_path) -> None:
    with harness(tmp_path) as h:
        call_sid, call = await press_on_a_live_call(h, "0")
        record = await asyncio.to_thread(h.record, call_sid)
        (update,) = h.cloud.updates()
        whisper = await asyncio.to_thread(
            h.sim.follow, twiml_of(update).find("./Dial/Number").get("url"), call_sid
        )
    assert urlsplit(update.url).path.endswith(f"/Calls/{call_sid}.json")
    root = twiml_of(update)
    assert [c.tag for c in root] == ["Say", "Dial"]
    assert root.find("Say").text == "Connecting you to a colleague."
    assert root.find("./Dial/Number").text == "+15551230099"
    # What the person answering hears first: our signed whisper webhook.
    assert ET.fromstring(whisper.text).find("Say").text == "A caller from the Acme line."
    (action,) = record["actions"]
    assert action["action"] == "transfer" and action["ok"] and action["trigger"] == "dtmf 0"
    assert record["end_reason"] == "action transfer to +15551230099 (dtmf 0)"
    assert h.cloud.hangups() == []  # Twilio follows the <Dial>; nobody hangs the caller up
    assert call.close_code == 1000


async def test_a_sip_transfer_dials_the_uri(tmp_path) -> None:
    with harness(tmp_path) as h:
        await press_on_a_live_call(h, "7")
        (update,) = h.cloud.updates()
    assert twiml_of(update).find("./Dial/Sip").text == "sip:queue@pbx.example.test"


async def test_hangup_ends_the_call_and_the_record_says_why(tmp_path) -> None:
    with harness(tmp_path) as h:
        call_sid, _ = await press_on_a_live_call(h, "9")
        record = await asyncio.to_thread(h.record, call_sid)
        (update,) = h.cloud.updates()
    assert [c.tag for c in twiml_of(update)] == ["Say", "Hangup"]
    assert record["end_reason"] == "action hangup (dtmf 9)"
    assert record["actions"][0]["action"] == "hangup" and record["live"] is False
    assert h.manager.active_count == 0


async def test_redirect_hands_the_call_to_the_users_twiml(tmp_path) -> None:
    with harness(tmp_path) as h:
        await press_on_a_live_call(h, "5")
        (update,) = h.cloud.updates()
    assert update.data["Url"] == "https://ivr.example.test/menu.xml" and update.data["Method"] == "POST"


async def test_a_refused_transfer_keeps_the_caller_with_the_agent(tmp_path) -> None:
    with harness(tmp_path) as h:
        h.cloud.refuse_updates = True
        call_sid, url, params = await asyncio.to_thread(h.sim.answer)
        async with h.sim.media_stream(url, params, call_sid=call_sid) as call:
            await call.answered()
            await call.dtmf("0")
            await call.play(np.zeros(8000, np.float32))
            assert not call.closed.is_set()
        record = await asyncio.to_thread(h.record, call_sid)
    assert record["actions"][0]["ok"] is False and record["end_reason"] == "stop"


async def test_an_agent_text_rule_fires_once_and_play_resumes_the_same_session(tmp_path) -> None:
    with harness(tmp_path) as h:
        call_sid, url, params = await asyncio.to_thread(lambda: h.sim.answer(query="persona=holder"))
        async with h.sim.media_stream(url, params, call_sid=call_sid) as first:
            talker = asyncio.create_task(first.play(np.zeros(8000 * 5, np.float32)))
            await asyncio.wait_for(first.closed.wait(), 10)  # the phrase came: our side ended it
            talker.cancel()
        (update,) = h.cloud.updates()
        root = twiml_of(update)
        assert [c.tag for c in root] == ["Say", "Redirect"]
        assert root.find("Say").text == "One moment please."
        session = h.manager.sessions[0]  # held while Twilio says the message
        # Twilio follows the <Redirect> to our webhook: the held call comes back on a new stream.
        answer = await asyncio.to_thread(h.sim.follow, root.find("Redirect").text, call_sid)
        stream_url, stream_params = parse_stream_twiml(answer.text)
        async with h.sim.media_stream(stream_url, stream_params, call_sid=call_sid) as second:
            await second.answered()
            await second.play(np.zeros(8000 * 2, np.float32))  # the phrase comes round 3 more times
            assert h.manager.sessions == [session]  # the same conversation goes on
        record = await asyncio.to_thread(h.record, call_sid)
    assert len(h.cloud.updates()) == 1  # `times: 1`: the phrase fired the rule once
    (action,) = record["actions"]
    assert action["action"] == "play" and action["trigger"] == "agent said 'hold while'"
    texts = [p["text"] for p in record["transcript"]]
    assert texts.count(" hold") >= 3
    frames = [p["frame"] for p in record["transcript"]]
    assert frames == sorted(frames)  # one session's frames, in order, across both streams
    assert record["end_reason"] == "stop"
    assert [s["status"] for s in record["statuses"]].count("stream-resumed") == 1


async def test_a_persona_length_limit_ends_with_a_spoken_goodbye(tmp_path) -> None:
    with harness(tmp_path, max_call_s=1.0) as h:
        call_sid, url, params = await asyncio.to_thread(h.sim.answer)
        async with h.sim.media_stream(url, params, call_sid=call_sid) as call:
            talker = asyncio.create_task(call.play(np.zeros(8000 * 5, np.float32)))
            await asyncio.wait_for(call.closed.wait(), 10)
            talker.cancel()
        record = await asyncio.to_thread(h.record, call_sid)
        updates = h.cloud.updates()
    assert record["end_reason"] == "max duration"
    root = twiml_of(updates[-1])
    assert [c.tag for c in root] == ["Say", "Hangup"]
    assert root.find("Say").text == "Sorry, we are out of time. Goodbye."


@pytest.mark.parametrize(
    "fallback", ["", "https://fallback.example.test/queue.xml", "<Response><Dial>+15550009</Dial></Response>"]
)
async def test_a_call_whose_engine_was_lost_hears_an_apology_or_the_fallback(tmp_path, fallback) -> None:
    with harness(tmp_path, engine_lost_twiml=fallback) as h:
        call_sid, url, params = await asyncio.to_thread(h.sim.answer)
        async with h.sim.media_stream(url, params, call_sid=call_sid) as call:
            await call.answered()
            h.manager.sessions[0].close_nowait("engine_lost")  # its engine worker died
            talker = asyncio.create_task(call.play(np.zeros(8000 * 5, np.float32)))
            await asyncio.wait_for(call.closed.wait(), 10)
            talker.cancel()
        record = await asyncio.to_thread(h.record, call_sid)
        (update,) = h.cloud.updates()
    assert record["end_reason"] == "session ended: engine_lost"
    if fallback.startswith("https:"):
        assert update.data["Url"] == fallback
    elif fallback:
        assert update.data["Twiml"] == fallback
    else:
        root = twiml_of(update)
        assert [c.tag for c in root] == ["Say", "Hangup"]
        assert "lost the connection" in root.find("Say").text
    assert h.cloud.hangups() == []


# --- the rules on their own ------------------------------------------------------------------------


def test_the_text_matcher_sees_phrases_across_pieces_once() -> None:
    rules = parse_rules(
        [
            {"on_agent_text": "transfer you", "do": "hangup"},
            {"on_agent_text": "goodbye", "do": "hangup", "times": 0},
        ]
    )
    matcher = ActionMatcher(rules)
    pieces = [" I", " will", " trans", "fer", " you", " now."]
    fired = [(r.index, phrase) for piece in pieces for r, phrase in matcher.on_agent_text(piece)]
    assert fired == [(0, "transfer you")]
    assert [r.index for r in matcher.on_agent_text(" transfer you")] == []  # times: 1 is spent
    assert [r.index for p in [" Good", "bye!", " goodbye"] for r, _ in matcher.on_agent_text(p)] == [1, 1]


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ("{do: dance, on_dtmf: '1'}", "`do` must be one of"),
        ("{do: hangup}", "exactly one of"),
        ("{do: hangup, on_dtmf: '1', on_agent_text: x}", "exactly one of"),
        ("{do: hangup, on_dtmf: '12'}", "one key"),
        ("{do: hangup, on_agent_text: '(unclosed'}", "not a regular expression"),
        ("{do: transfer, on_dtmf: '0', to: 'not a number'}", "phone number"),
        ("{do: redirect, on_dtmf: '0', url: 'ftp://x'}", r"http\(s\) URL"),
        ("{do: play, on_dtmf: '0'}", "needs `say` or `play_url`"),
        ("{do: hangup, on_dtmf: '0', to: '+1555'}", "does not take"),
        ("{do: hangup, on_dtmf: '0', times: -1}", "times"),
    ],
)
def test_bad_rules_are_refused_at_load(tmp_path, rule, message) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(f"personas:\n  default:\n    actions: [{rule}]\n")
    with pytest.raises(UserError, match=message) as info:
        PersonaBook.load(path)
    assert "actions[0]" in str(info.value)


async def test_a_held_call_that_does_not_come_back_is_ended(tmp_path) -> None:
    with harness(tmp_path, resume_timeout_s=0.5) as h:
        call_sid, url, params = await asyncio.to_thread(lambda: h.sim.answer(query="persona=holder"))
        async with h.sim.media_stream(url, params, call_sid=call_sid) as call:
            talker = asyncio.create_task(call.play(np.zeros(8000 * 5, np.float32)))
            await asyncio.wait_for(call.closed.wait(), 10)
            talker.cancel()
        assert h.manager.active_count == 1  # held for its return
        for _ in range(100):
            if h.manager.active_count == 0:
                break
            await asyncio.sleep(0.05)
        record = await asyncio.to_thread(h.record, call_sid)
    assert h.manager.active_count == 0 and h.cloud.hangups() == [call_sid]
    assert record["end_reason"] == "the caller did not come back after a message" and not record["live"]
