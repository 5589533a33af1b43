"""`personaplex-voice call`: place an outbound phone call bridged to a running server's agent.

The call is placed with Twilio's REST API from this process; when the callee answers, Twilio
fetches the server's signed `/twilio/voice` webhook (at `PUBLIC_URL`) with the persona's name,
and the conversation runs on that server like any incoming call.
"""

from __future__ import annotations

from typing import Annotated

import typer
from personaplex_phone.personas import PersonaBook

from personaplex_voice.errors import UserError
from twilio.http import HttpClient

from .calls import CallControl
from .config import TwilioSettings


def make_http_client() -> HttpClient | None:
    """The HTTP layer of Twilio's REST client (None: twilio's default). Tests replace this."""
    return None


def call(
    to: Annotated[str, typer.Option("--to", help="Number to call, E.164 (+15551234567)")],
    from_: Annotated[str, typer.Option("--from", help="Your Twilio number (caller ID), E.164")],
    persona: Annotated[
        str | None,
        typer.Option("--persona", help="Persona name from the server's personas file (default: its default)"),
    ] = None,
    public_url: Annotated[
        str | None,
        typer.Option("--public-url", help="Where Twilio reaches the server [env PUBLIC_URL]"),
    ] = None,
    personas_file: Annotated[
        str | None,
        typer.Option(
            "--personas",
            help="Check --persona against this personas file first [env PERSONAPLEX_TWILIO_PERSONAS_FILE]",
        ),
    ] = None,
    time_limit: Annotated[
        int | None, typer.Option("--time-limit", help="Hang up after this many seconds", min=1)
    ] = None,
    var: Annotated[
        list[str] | None,
        typer.Option("--var", help="NAME=VALUE for the persona's prompt template (repeatable)"),
    ] = None,
) -> None:
    """Call a phone number and connect it to the agent (needs TWILIO_ACCOUNT_SID, TWILIO_AUTH_TOKEN)."""
    overrides: dict[str, object] = {}
    if public_url:
        overrides["public_url"] = public_url
    if personas_file:
        overrides["personas_file"] = personas_file
    try:
        settings = TwilioSettings(**overrides)
    except ValueError as exc:
        raise UserError(f"bad Twilio settings: {exc}") from None
    if settings.personas_file is not None and (persona is not None or var):
        book = PersonaBook.load(settings.personas_file)
        name = persona if persona is not None else book.default
        if name not in book.specs:
            known = ", ".join(sorted(book.specs))
            raise UserError(f"unknown persona {name!r} in {settings.personas_file} (known: {known})")
        undeclared = sorted(
            {v.partition("=")[0].strip() for v in var or []} - set(book.specs[name].variables)
        )
        if undeclared:
            raise UserError(f"persona {name!r} declares no variable(s) {', '.join(undeclared)}")
    variables: dict[str, str] = {}
    for item in var or []:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise UserError(f"--var {item!r}: give NAME=VALUE")
        variables[name.strip()] = value
    control = CallControl(settings, http_client=make_http_client())
    call_sid = control.place_call(to, from_, persona=persona, time_limit_s=time_limit, variables=variables)
    typer.echo(call_sid)
