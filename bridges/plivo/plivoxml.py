"""Plivo XML: our answers and the phone call's instructions.

The answer is a bidirectional `<Stream>` that keeps the call up while it runs:
`<Stream bidirectional="true" keepCallAlive="true" contentType="audio/x-l16;rate=16000"
extraHeaders="persona=desk">wss://…</Stream>`; the URL is the element's text. Instructions for a
live call are Plivo XML documents Plivo fetches when the call is transferred to their URL.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping, Sequence
from urllib.parse import quote

from personaplex_phone import carrier as phone
from personaplex_phone import xml_markup

XML = "application/xml"


def extra_headers(values: Mapping[str, str]) -> str:
    """`key=value,key=value`, each part percent-encoded (a value may hold a comma)."""
    return ",".join(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in values.items())


def stream(url: str, parameters: Mapping[str, str], content_type: str) -> str:
    response = ET.Element("Response")
    attributes = {"bidirectional": "true", "keepCallAlive": "true", "contentType": content_type}
    if parameters:
        attributes["extraHeaders"] = extra_headers(parameters)
    ET.SubElement(response, "Stream", attributes).text = url
    return xml_markup.xml_document(response, "utf-8")


def render(
    steps: Sequence[phone.Step],
    *,
    whisper_url: Callable[[phone.Dial], str | None],
    resume_url: Callable[[phone.Resume], str],
) -> str:
    response = ET.Element("Response")
    for step in steps:
        if isinstance(step, phone.Say):
            ET.SubElement(response, "Speak").text = step.text
        elif isinstance(step, phone.Play):
            ET.SubElement(response, "Play").text = step.url
        elif isinstance(step, phone.Dial):
            attributes = {"callerId": step.caller_id} if step.caller_id else {}
            url = whisper_url(step)
            if url:
                attributes["confirmSound"] = url  # played to whoever answers, before connecting
            dial = ET.SubElement(response, "Dial", attributes)
            sip = step.target.startswith(("sip:", "sips:"))
            ET.SubElement(dial, "User" if sip else "Number").text = step.target
        elif isinstance(step, phone.Hangup):
            ET.SubElement(response, "Hangup")
        elif isinstance(step, phone.Redirect):
            ET.SubElement(response, "Redirect").text = step.url
        elif isinstance(step, phone.Resume):
            ET.SubElement(response, "Redirect").text = resume_url(step)
    return xml_markup.xml_document(response, "utf-8")


def say_and_hang_up(message: str) -> str:
    return xml_markup.say_and_hang_up(render, message)


def say_only(message: str) -> str:
    return xml_markup.say_only(render, message)
