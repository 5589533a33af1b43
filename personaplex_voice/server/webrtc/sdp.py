"""What the WebRTC endpoint reads from an SDP offer, and the Opus parameters it writes in its answer.

aiortc negotiates the session; this module only answers what aiortc does not decide for us:

* is there audio we can take: an `m=audio` section offering Opus (RFC 7587), checked before a
  peer connection is built, so a wrong offer gets a 400 saying why;
* what the peer's Opus decoder asks of our encoder (RFC 7587 §6.1: `useinbandfec`, `usedtx`
  in the *offer's* fmtp are the receiver's preferences);
* our own receiver's preferences, written into the answer's fmtp (aiortc writes none): in-band
  FEC wanted (`useinbandfec=1`, so a browser encodes it), no DTX asked for (`usedtx=0`: the model
  listens all the time and a continuous stream keeps the server's clock independent of timers;
  DTX from a sender that uses it anyway is handled), mono (`stereo=0`, `sprop-stereo=0`);
* the ICE lines of a WHIP trickle PATCH (`application/trickle-ice-sdpfrag`, RFC 8840).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["OfferFacts", "SdpError", "SdpFragment", "answer_with_opus_fmtp", "parse_offer", "parse_sdpfrag"]

MAX_SDP_BYTES = 64 * 1024  # a browser's audio + data offer is ~3-6 KB; with video ~10 KB
OUR_OPUS_FMTP = {"minptime": "10", "useinbandfec": "1", "usedtx": "0", "stereo": "0", "sprop-stereo": "0"}

_RTPMAP = re.compile(r"^a=rtpmap:(\d+) ([^/\s]+)/(\d+)", re.IGNORECASE)
_FMTP = re.compile(r"^a=fmtp:(\d+) (.*)$", re.IGNORECASE)


class SdpError(ValueError):
    """The SDP cannot be used; the message says why, for the client."""


@dataclass(frozen=True)
class OfferFacts:
    opus_payload_type: int
    peer_wants_fec: bool  # the peer's decoder uses in-band FEC: our encoder adds it
    peer_wants_dtx: bool  # the peer's decoder asks for DTX
    has_data_channel: bool
    media: tuple[str, ...]  # the m= kinds in order (audio, video, application...)


@dataclass
class SdpFragment:
    ice_ufrag: str | None = None
    ice_pwd: str | None = None
    candidates: list[tuple[str, str | None, int]] = field(default_factory=list)  # (line, mid, index)
    end_of_candidates: bool = False


def _lines(sdp: str) -> list[str]:
    return [line.strip() for line in sdp.replace("\r\n", "\n").split("\n") if line.strip()]


def _sections(lines: list[str]) -> list[list[str]]:
    """The session part, then one list per m= section (its m= line first)."""
    sections: list[list[str]] = [[]]
    for line in lines:
        if line.startswith("m="):
            sections.append([])
        sections[-1].append(line)
    return sections


def _fmtp(value: str) -> dict[str, str]:
    out = {}
    for part in value.split(";"):
        key, _, val = part.strip().partition("=")
        if key:
            out[key.strip().lower()] = val.strip()
    return out


def parse_offer(sdp: str) -> OfferFacts:
    if len(sdp) > MAX_SDP_BYTES:
        raise SdpError(f"the offer is {len(sdp)} bytes, at most {MAX_SDP_BYTES}")
    lines = _lines(sdp)
    if not lines or not lines[0].startswith("v="):
        raise SdpError("the body is not an SDP offer (it must start with v=0)")
    sections = _sections(lines)[1:]
    kinds = tuple(section[0][2:].split(" ", 1)[0] for section in sections)
    for section in sections:
        if not section[0].startswith("m=audio"):
            continue
        if section[0].split(" ")[1:2] == ["0"]:
            continue  # a rejected m-line
        opus = [
            int(m.group(1)) for line in section if (m := _RTPMAP.match(line)) and m.group(2).lower() == "opus"
        ]
        if not opus:
            continue
        params = next(
            (
                _fmtp(m.group(2))
                for line in section
                if (m := _FMTP.match(line)) and int(m.group(1)) == opus[0]
            ),
            {},
        )
        return OfferFacts(
            opus_payload_type=opus[0],
            peer_wants_fec=params.get("useinbandfec") == "1",
            peer_wants_dtx=params.get("usedtx") == "1",
            has_data_channel="application" in kinds,
            media=kinds,
        )
    if "audio" not in kinds:
        raise SdpError("the offer has no audio (an m=audio section with Opus is needed)")
    raise SdpError("the offer's audio has no Opus codec (this server speaks Opus only, RFC 7587)")


def answer_with_opus_fmtp(answer: str) -> str:
    """`answer` with our Opus receiver parameters in its audio section's fmtp (merged into any
    aiortc wrote, ours winning)."""
    lines = answer.replace("\r\n", "\n").rstrip("\n").split("\n")
    out: list[str] = []
    section_is_audio = False
    opus_pt: str | None = None
    pending_fmtp_after: int | None = None
    for line in lines:
        if line.startswith("m="):
            if section_is_audio and opus_pt is not None and pending_fmtp_after is not None:
                out.insert(pending_fmtp_after + 1, _fmtp_line(opus_pt, {}))
            section_is_audio, opus_pt, pending_fmtp_after = line.startswith("m=audio"), None, None
        elif section_is_audio and (m := _RTPMAP.match(line)) and m.group(2).lower() == "opus":
            opus_pt, pending_fmtp_after = m.group(1), len(out)
        elif section_is_audio and opus_pt is not None and (m := _FMTP.match(line)) and m.group(1) == opus_pt:
            out.append(_fmtp_line(opus_pt, _fmtp(m.group(2))))
            pending_fmtp_after = None
            continue
        out.append(line)
    if section_is_audio and opus_pt is not None and pending_fmtp_after is not None:
        out.insert(pending_fmtp_after + 1, _fmtp_line(opus_pt, {}))
    return "\r\n".join(out) + "\r\n"


def _fmtp_line(pt: str, existing: dict[str, str]) -> str:
    merged = {**existing, **OUR_OPUS_FMTP}
    return f"a=fmtp:{pt} " + ";".join(f"{k}={v}" for k, v in merged.items())


def parse_sdpfrag(body: str) -> SdpFragment:
    """The ICE lines of an RFC 8840 SDP fragment (what a WHIP client PATCHes)."""
    if len(body) > MAX_SDP_BYTES:
        raise SdpError(f"the fragment is {len(body)} bytes, at most {MAX_SDP_BYTES}")
    fragment = SdpFragment()
    mid: str | None = None
    index = -1
    for line in _lines(body):
        if line.startswith("m="):
            index += 1
            mid = None
        elif line.startswith("a=mid:"):
            mid = line[6:]
        elif line.startswith("a=ice-ufrag:"):
            fragment.ice_ufrag = line[12:]
        elif line.startswith("a=ice-pwd:"):
            fragment.ice_pwd = line[10:]
        elif line.startswith("a=candidate:"):
            fragment.candidates.append((line[2:], mid, max(index, 0)))
        elif line == "a=end-of-candidates":
            fragment.end_of_candidates = True
    return fragment
