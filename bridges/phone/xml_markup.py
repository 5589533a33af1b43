"""What carriers' XML call markup shares (Plivo XML, TeXML, ExoML): the document with its XML
declaration, and a render for steps that link nowhere (a goodbye, a whisper). Which element each
step becomes is the carrier's own vocabulary (its markup module)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence

from .carrier import Dial, Hangup, Resume, Say, Step

# A carrier's render: steps -> its document, with the URLs of ours a transfer's whisper and a
# resume point at.
Render = Callable[..., str]


def xml_document(root: ET.Element, encoding: str = "UTF-8") -> str:
    return f'<?xml version="1.0" encoding="{encoding}"?>' + ET.tostring(root, encoding="unicode")


def _no_whisper(dial: Dial) -> None:
    return None


def _no_resume(resume: Resume) -> str:
    return ""


def unlinked(render: Render, steps: Sequence[Step]) -> str:
    """`render(steps)` for steps that need no URL of ours."""
    return render(steps, whisper_url=_no_whisper, resume_url=_no_resume)


def say_and_hang_up(render: Render, message: str) -> str:
    """Tell the caller `message` (busy, a configuration problem) and end the call."""
    return unlinked(render, [Say(message), Hangup()])


def say_only(render: Render, message: str) -> str:
    """Just `message` (a whisper to the person a call is put through to)."""
    return unlinked(render, [Say(message)])
