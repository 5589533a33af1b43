"""TwiML answers, built with the `twilio` package's classes (it escapes attributes and text)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from personaplex_phone import carrier as phone

from twilio.twiml.voice_response import Connect, Dial, VoiceResponse


def connect_stream(stream_url: str, parameters: Mapping[str, str], status_callback: str | None = None) -> str:
    """`<Connect><Stream url=…>` with `<Parameter>`s: a bidirectional Media Stream.

    Twilio refuses Stream URLs with a query string, so everything the socket needs travels as
    `<Parameter>`s and comes back in the `start` message's `customParameters`.
    """
    if "?" in stream_url:
        raise ValueError("a <Stream> url must not have a query string; use parameters")
    response = VoiceResponse()
    connect = Connect()
    stream_kwargs = {"url": stream_url}
    if status_callback:
        stream_kwargs["status_callback"] = status_callback
    stream = connect.stream(**stream_kwargs)
    for name, value in parameters.items():
        stream.parameter(name=name, value=value)
    response.append(connect)
    return str(response)


def say_and_hang_up(message: str) -> str:
    """Tell the caller something (busy, configuration problem) and end the call."""
    response = VoiceResponse()
    response.say(message)
    response.hangup()
    return str(response)


def redirect(url: str) -> str:
    """Hand the call to the TwiML at `url` (a fallback of the user's)."""
    response = VoiceResponse()
    response.redirect(url, method="POST")
    return str(response)


def say_or_play(response: VoiceResponse, say: str | None, play_url: str | None) -> None:
    if say:
        response.say(say)
    if play_url:
        response.play(play_url)


def transfer(to: str, *, announce: str | None, whisper_url: str | None, caller_id: str | None) -> str:
    """`<Say>` (optional) then `<Dial>` to a number or a SIP URI; `whisper_url` is fetched by
    Twilio when the far end answers and played to it alone, before the two are connected."""
    response = VoiceResponse()
    if announce:
        response.say(announce)
    dial = Dial(caller_id=caller_id) if caller_id else Dial()
    target = {"url": whisper_url} if whisper_url else {}
    if to.startswith(("sip:", "sips:")):
        dial.sip(to, **target)
    else:
        dial.number(to, **target)
    response.append(dial)
    return str(response)


def play_then(say: str | None, play_url: str | None, *, resume_url: str | None) -> str:
    """A short message, then back to the agent (`<Redirect>` to our webhook) or the end."""
    response = VoiceResponse()
    say_or_play(response, say, play_url)
    if resume_url:
        response.redirect(resume_url, method="POST")
    else:
        response.hangup()
    return str(response)


def say_only(message: str) -> str:
    """A TwiML document that just says `message` (a whisper to the person a call is put through to)."""
    response = VoiceResponse()
    response.say(message)
    return str(response)


def render(
    steps: Sequence[phone.Step],
    *,
    whisper_url: Callable[[phone.Dial], str | None],
    resume_url: Callable[[phone.Resume], str],
) -> str:
    """The phone call's instructions as one TwiML document (`Markup` steps are given whole)."""
    response = VoiceResponse()
    for step in steps:
        if isinstance(step, phone.Say):
            response.say(step.text)
        elif isinstance(step, phone.Play):
            response.play(step.url)
        elif isinstance(step, phone.Dial):
            dial = Dial(caller_id=step.caller_id) if step.caller_id else Dial()
            url = whisper_url(step)
            target = {"url": url} if url else {}
            if step.target.startswith(("sip:", "sips:")):
                dial.sip(step.target, **target)
            else:
                dial.number(step.target, **target)
            response.append(dial)
        elif isinstance(step, phone.Hangup):
            response.hangup()
        elif isinstance(step, phone.Redirect):
            response.redirect(step.url, method="POST")
        elif isinstance(step, phone.Resume):
            response.redirect(resume_url(step), method="POST")
    return str(response)
