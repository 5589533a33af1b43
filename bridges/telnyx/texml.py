"""TeXML, Telnyx's call markup: our answers and the phone call's instructions.

The answer connects the call to our stream in bidirectional RTP mode:
`<Connect><Stream url=… track="inbound_track" codec="PCMU" bidirectionalMode="rtp"
bidirectionalCodec="PCMU" bidirectionalSamplingRate="8000">` with `<Parameter>`s that come back
in the stream's start. `codec` asks Telnyx to stream the caller's audio in a codec we read (the
call's own codec otherwise: G.722, Opus, AMR-WB on an HD leg); Telnyx transcodes between PCMU
and PCMA (developers.telnyx.com/docs/voice/programmable-voice/texml-verbs/stream). Instructions
for a live call (a goodbye, a transfer with words, a message then back to the agent) are TeXML
documents Telnyx fetches by URL.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping, Sequence

from personaplex_phone import carrier as phone
from personaplex_phone import xml_markup

XML = "application/xml"


# The codecs TeXML's <Stream codec> takes that we read; anything else we ask as PCMU.
STREAM_CODECS = ("PCMU", "PCMA")


def connect_stream(url: str, parameters: Mapping[str, str], codec: str, rate: int) -> str:
    """`codec` and `rate`: what we send back (bidirectional); the caller's audio is asked for
    in the same codec where TeXML offers it, else in PCMU."""
    response = ET.Element("Response")
    connect = ET.SubElement(response, "Connect")
    stream = ET.SubElement(
        connect,
        "Stream",
        {
            "url": url,
            "track": "inbound_track",
            "codec": codec if codec in STREAM_CODECS else "PCMU",
            "bidirectionalMode": "rtp",
            "bidirectionalCodec": codec,
            "bidirectionalSamplingRate": str(rate),
        },
    )
    for name, value in parameters.items():
        ET.SubElement(stream, "Parameter", {"name": name, "value": value})
    return xml_markup.xml_document(response)


def say_and_hang_up(message: str) -> str:
    return xml_markup.say_and_hang_up(render, message)


def say_only(message: str) -> str:
    return xml_markup.say_only(render, message)


def render(
    steps: Sequence[phone.Step],
    *,
    whisper_url: Callable[[phone.Dial], str | None],
    resume_url: Callable[[phone.Resume], str],
) -> str:
    response = ET.Element("Response")
    for step in steps:
        if isinstance(step, phone.Say):
            ET.SubElement(response, "Say").text = step.text
        elif isinstance(step, phone.Play):
            ET.SubElement(response, "Play").text = step.url
        elif isinstance(step, phone.Dial):
            dial = ET.SubElement(response, "Dial", {"callerId": step.caller_id} if step.caller_id else {})
            url = whisper_url(step)
            target = ET.SubElement(dial, "Sip" if step.target.startswith(("sip:", "sips:")) else "Number")
            target.text = step.target
            if url:
                target.set("url", url)
        elif isinstance(step, phone.Hangup):
            ET.SubElement(response, "Hangup")
        elif isinstance(step, phone.Redirect):
            ET.SubElement(response, "Redirect", {"method": "POST"}).text = step.url
        elif isinstance(step, phone.Resume):
            ET.SubElement(response, "Redirect", {"method": "POST"}).text = resume_url(step)
    return xml_markup.xml_document(response)
