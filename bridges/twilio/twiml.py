"""TwiML answers, built with the `twilio` package's classes (it escapes attributes and text)."""

from __future__ import annotations

from collections.abc import Mapping

from twilio.twiml.voice_response import Connect, VoiceResponse


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
