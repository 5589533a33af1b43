"""Plivo XML: our answers and the phone call's instructions.

The answer is a bidirectional `<Stream>` that keeps the call up while it runs:
`<Stream bidirectional="true" keepCallAlive="true" contentType="audio/x-l16;rate=16000"
extraHeaders="…">wss://…</Stream>`; the URL is the element's text. Instructions for a live call
are Plivo XML documents Plivo fetches when the call is transferred to their URL.

`extraHeaders` (docs.plivo.com/docs/voice/xml/audiostream): `key=value` pairs joined by `,`, at
most 512 bytes, "only characters [A-Z], [a-z], [0-9] allowed". Our keys and values are any text
(a persona's name, a flow's values), so each is written in base32 (RFC 4648, lower case, no `=`
padding: letters and digits only) after a first pair `ppenc=b32` that says so, and read back by
wire.py; pairs that would not fit in 512 bytes are left out (the call's own record still has
them), with a warning.
"""

from __future__ import annotations

import base64
import logging
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping, Sequence

from personaplex_phone import carrier as phone
from personaplex_phone import xml_markup

log = logging.getLogger(__name__)

XML = "application/xml"
EXTRA_HEADERS_MAX_BYTES = 512  # Plivo's limit for the whole attribute
ENCODED_MARK = "ppenc=b32"  # first pair: the others are base32 (wire.extra_headers reads it)


def alphanumeric(text: str) -> str:
    """`text` in letters and digits only: base32 of its UTF-8, lower case, unpadded."""
    return base64.b32encode(text.encode()).decode("ascii").rstrip("=").lower()


def extra_headers(values: Mapping[str, str]) -> str:
    """`key=value,key=value` in Plivo's alphabet, as many pairs (in order) as fit Plivo's limit."""
    if not values:
        return ""
    pairs = [ENCODED_MARK]
    used = len(ENCODED_MARK)
    for key, value in values.items():
        pair = f"{alphanumeric(key)}={alphanumeric(value)}"
        cost = len(pair) + 1
        if used + cost > EXTRA_HEADERS_MAX_BYTES:
            log.warning("plivo: extraHeaders: %r left out (over Plivo's 512 bytes)", key)
            continue
        pairs.append(pair)
        used += cost
    return ",".join(pairs)


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
