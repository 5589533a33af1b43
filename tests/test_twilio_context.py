"""Per-call context: each caller's own facts in the persona's prompt.

The prompt template is filled from the flow's query parameters on the signed webhook URL, the
call's own facts and a context webhook (a real HTTP server here, standing in for a CRM), and
the rendered prompt is what the session gets (read back from GET /twilio/calls/{sid}). A lookup
that never answers leaves the defaults, and the call still starts at once.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from personaplex_phone.personas import PersonaBook
from personaplex_phone.webhooks import sign
from support_cli import assert_one_line_error, call_cli
from support_twilio import HttpSink, bridge_harness

from personaplex_voice.errors import UserError

SECRET = "context-test-secret"
PERSONAS = """
default: care
personas:
  care:
    text_prompt: >-
      You work for CitySan Services. Verify customer name {customer_name}.
      Current schedule: {schedule}. The caller dials from {From}. Literal {{braces}} stay.
    variables: {customer_name: "unknown", schedule: "not on file"}
    CONTEXT
"""


def personas(context_url: str | None = None, timeout_s: float = 1.5) -> str:
    line = f"context_url: {context_url}\n    context_timeout_s: {timeout_s}" if context_url else ""
    return PERSONAS.replace("CONTEXT", line)


async def first_audio_after_start(h, call_sid: str, url: str, params: dict) -> float:
    """Seconds from `start` to the first agent audio the simulator plays."""
    async with h.sim.media_stream(url, params, call_sid=call_sid) as call:
        started = time.monotonic()
        await call.answered(timeout=10)
        return call.played[0].arrival - started


def test_the_flows_query_parameters_fill_the_prompt(tmp_path) -> None:
    with bridge_harness(personas(), tmp_path, webhook_secret=SECRET) as h:
        call_sid, url, params = h.sim.answer(from_="+15550107777", query="customer_name=Omar%20Torres")
        # Carried on to the stream beside its ticket (a stream served elsewhere knows them too).
        assert params == {"persona": "care", "customer_name": "Omar Torres"}
        asyncio.run(first_audio_after_start(h, call_sid, url, params))
        record = h.record(call_sid)
    prompt = record["prompt"]
    assert "Verify customer name Omar Torres." in prompt
    assert "Current schedule: not on file." in prompt  # the declared default
    assert "dials from +15550107777" in prompt and "Literal {braces} stay." in prompt
    assert record["variables"] == {"customer_name": "Omar Torres", "schedule": "not on file"}


def test_a_context_webhook_supplies_a_variable(tmp_path) -> None:
    answer = {"schedule": "every other week", "customer_name": "Omar Torres", "ignored": "x"}
    with (
        HttpSink(lambda n: (200, answer)) as crm,
        bridge_harness(personas(crm.url + "/context"), tmp_path, webhook_secret=SECRET) as h,
    ):
        call_sid, url, params = h.sim.answer(query="customer_name=Someone%20Else")
        asyncio.run(first_audio_after_start(h, call_sid, url, params))
        record = h.record(call_sid)
    assert "Current schedule: every other week." in record["prompt"]
    assert "Verify customer name Omar Torres." in record["prompt"]  # the CRM is asked last
    assert "ignored" not in record["variables"]
    (request,) = crm.received
    facts = json.loads(request.body)
    assert facts["call_sid"] == call_sid and facts["persona"] == "care"
    assert facts["variables"]["customer_name"] == "Someone Else"  # what the flow said
    assert request.headers["x-personaplex-signature"] == sign(SECRET, request.body)


def test_a_context_webhook_that_never_answers_leaves_the_defaults(tmp_path) -> None:
    with (
        HttpSink(delay_s=8.0) as crm,
        bridge_harness(personas(crm.url, timeout_s=0.5), tmp_path, webhook_secret=SECRET) as h,
    ):
        t0 = time.monotonic()
        call_sid, url, params = h.sim.answer(query="schedule=weekly")
        webhook_s = time.monotonic() - t0
        assert crm.received, "the context webhook was not asked"
        to_audio_s = asyncio.run(first_audio_after_start(h, call_sid, url, params))
        record = h.record(call_sid)
    assert webhook_s < 0.5 + 2.0  # the lookup's timeout bounds the webhook's answer
    assert to_audio_s < 2.0, f"first audio {to_audio_s:.2f} s after start"
    assert "Verify customer name unknown." in record["prompt"]
    assert "Current schedule: weekly." in record["prompt"]  # the flow's value still counts


def test_same_facts_reuse_the_prefilled_prompt(tmp_path) -> None:
    """The engine's persona cache keys on the rendered text: a caller with the same facts starts
    from the cached prefill, another caller's facts get their own (within its byte bound)."""
    with bridge_harness(personas(), tmp_path, webhook_secret=SECRET) as h:
        hits = []
        for name in ("Omar%20Torres", "Omar%20Torres", "Ana%20Ruiz"):
            call_sid, url, params = h.sim.answer(query=f"customer_name={name}")
            asyncio.run(first_audio_after_start(h, call_sid, url, params))
            hits.append(h.record(call_sid)["metrics"]["session"]["cache_hit"])
    assert hits == [False, True, False]


def test_an_undeclared_template_variable_is_refused_at_load_with_one_line(tmp_path, monkeypatch) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        "personas:\n  default:\n    text_prompt: 'Hello {customer_name}, account {account_id}.'\n"
        "    variables: {customer_name: there}\n"
    )
    with pytest.raises(UserError) as info:
        PersonaBook.load(path)
    assert "\n" not in str(info.value) and "{account_id}" in str(info.value)
    monkeypatch.setenv("TWILIO_AUTH_TOKEN", "x")
    monkeypatch.setenv("PERSONAPLEX_TWILIO_PERSONAS_FILE", str(path))
    proc = call_cli("serve", "--engine", "echo", "--twilio", "--port", "0")
    assert_one_line_error(proc, str(path), "{account_id}", "variables")


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("Hi {name!r}", "bad field"),
        ("Hi {0}", "bad field"),
        ("Hi {user.name}", "bad field"),
        ("Hi } there", "literal braces"),
    ],
)
def test_malformed_templates_are_refused(tmp_path, template, message) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(f"personas:\n  default:\n    text_prompt: '{template}'\n    variables: {{name: x}}\n")
    with pytest.raises(UserError, match=message):
        PersonaBook.load(path)


def test_values_are_one_bounded_line(tmp_path) -> None:
    with bridge_harness(personas(), tmp_path, webhook_secret=SECRET) as h:
        long = "A%0A" + "b" * 2000  # a newline and far too long
        call_sid, url, params = h.sim.answer(query=f"customer_name={long}&persona=care")
        asyncio.run(first_audio_after_start(h, call_sid, url, params))
        value = h.record(call_sid)["variables"]["customer_name"]
    assert "\n" not in value and value.startswith("A b") and len(value) == 400
