"""`personaplex-voice phone …`: try a phone setup before owning a number.

    personaplex-voice phone simulate --carrier plivo --url http://127.0.0.1:8998 --wav hello.wav
    personaplex-voice phone simulate --carrier asterisk --audiosocket 127.0.0.1:9092 --rate 16000 …
    personaplex-voice phone keypair          # an Ed25519 pair: the simulator signs as Telnyx

`simulate` is a caller on the carrier's side: the answer webhook signed as that carrier signs
(with the same secrets as the server, from the carrier's usual variables), the stream opened as
the carrier opens it, the WAV said at real time in the carrier's codec, DTMF keys when asked, the
agent's audio played by a model of the carrier's buffer (marks and clears answered as the
carrier answers them), then the caller hangs up. It prints what happened as JSON and can save
what the caller heard. Asterisk's AudioSocket leg is plain TCP: `--audiosocket HOST:PORT` runs
the carrier's own simulator (personaplex_asterisk.simulate) for it.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from personaplex_voice.audio.io import read_audio, write_wav
from personaplex_voice.audio.resample import resample
from personaplex_voice.errors import UserError

app = typer.Typer(help="Phone lines: simulate a carrier's call against a server.", no_args_is_help=True)


def parse_digits(specs: list[str]) -> list[tuple[float, str]]:
    """`0@2.5` (key 0, 2.5 s into the WAV) -> (2.5, "0"), sorted by time."""
    keys = []
    for spec in specs:
        key, _, at = spec.partition("@")
        try:
            keys.append((float(at or 0), key))
        except ValueError:
            raise UserError(f"--dtmf {spec!r}: give KEY@SECONDS, e.g. 0@2.5") from None
        if len(key) != 1 or key not in "0123456789*#ABCD":
            raise UserError(f"--dtmf {spec!r}: one key of 0-9 * # A-D")
    return sorted(keys)


async def _simulate(
    carrier: str,
    url: str,
    public_url: str | None,
    pcm_24k: np.ndarray,
    digits: list[tuple[float, str]],
    to: str,
    from_: str,
    side_options: dict[str, Any],
) -> tuple[dict[str, Any], np.ndarray, int]:
    from .simulator import PhoneSimulator, load_side, say_with_keys

    try:
        side = load_side(carrier, **side_options)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    sim = PhoneSimulator(side, url, public_url)
    started = time.monotonic()
    try:
        offer = await sim.answer(to=to, from_=from_)
    except RuntimeError as exc:
        raise UserError(str(exc)) from None
    except OSError as exc:
        raise UserError(f"cannot reach {url}: {exc}") from None
    line = resample(pcm_24k, 24000, offer.inbound.rate)
    async with sim.stream(offer) as call:
        waited = await call.answered(timeout=30)
        answered_s = time.monotonic() - started
        await say_with_keys(call, line, offer.inbound.rate, digits)
        ended_by_server = call.closed.is_set()
    heard = call.heard()
    summary = {
        "carrier": carrier,
        "call_id": offer.call_id,
        "stream_url": offer.url.split("@")[-1],
        "audio_in": offer.inbound.describe(),
        "audio_out": offer.outbound.describe(),
        "answered_after_s": round(answered_s, 3),
        "silence_before_agent_s": round(waited / offer.inbound.rate, 3),
        "said_s": round(len(line) / offer.inbound.rate, 3),
        "heard_s": round(len(heard) / offer.outbound.rate, 3),
        "messages_heard": len(call.played),
        "late_messages": call.late_messages,
        "max_queued_ms": round(call.max_queued_s * 1000, 1),
        "marks_answered": len(call.marks_echoed),
        "clears": call.clears,
        "dropped_by_clear_ms": [round(s * 1000, 1) for s in call.dropped_by_clear_s],
        "dtmf": "".join(key for _, key in digits),
        "ended_by": "server" if ended_by_server else "caller",
        "close_code": call.close_code,
    }
    bad_chunks = getattr(side, "bad_chunks", None)  # messages of ours the carrier's rules refuse
    if bad_chunks is not None:
        summary["messages_breaking_carrier_rules"] = len(bad_chunks)
    return summary, heard, offer.outbound.rate


async def _simulate_audiosocket(
    url: str,
    listener: str,
    rate: int,
    pcm_24k: np.ndarray,
    digits: list[tuple[float, str]],
    to: str,
    from_: str,
) -> tuple[dict[str, Any], np.ndarray, int]:
    """Asterisk's AudioSocket leg (plain TCP, not a stream the phone simulator opens): the
    carrier's own simulator, with the API key its chan_websocket side reads."""
    try:
        from personaplex_asterisk.config import parse_listen
        from personaplex_asterisk.sim import side
        from personaplex_asterisk.simulate import simulate_call
    except ImportError as exc:
        raise UserError(f"the Asterisk carrier is not installed ({exc})") from None
    try:
        api_key = side().api_key
    except ValueError as exc:
        raise UserError(str(exc)) from None
    try:
        return await simulate_call(
            url,
            api_key,
            pcm_24k,
            mode="audiosocket",
            audiosocket=parse_listen(listener),
            rate=rate,
            digits=digits,
            to=to,
            from_=from_,
        )
    except RuntimeError as exc:
        raise UserError(str(exc)) from None
    except OSError as exc:
        raise UserError(f"cannot reach {url} or the AudioSocket listener {listener}: {exc}") from None


ASTERISK_FORMATS = {8000: "slin", 16000: "slin16", 24000: "slin24"}  # chan_websocket's, by rate


@app.command()
def simulate(
    carrier: Annotated[
        str, typer.Option(help="twilio, telnyx, plivo, vonage, exotel, asterisk, jambonz or genesys")
    ],
    url: Annotated[str, typer.Option(help="Where the server is reached, e.g. http://127.0.0.1:8998")],
    wav: Annotated[Path, typer.Option(help="What the caller says (any rate; played at real time)")],
    public_url: Annotated[
        str | None, typer.Option(help="The server's PUBLIC_URL, what the carrier signs over (default: --url)")
    ] = None,
    dtmf: Annotated[
        list[str] | None,
        typer.Option(help="A key and when to press it, KEY@SECONDS into the WAV (repeatable)"),
    ] = None,
    to: Annotated[str, typer.Option(help="The number called")] = "+15550100001",
    from_: Annotated[str, typer.Option("--from", help="The caller's number")] = "+15550100002",
    out: Annotated[Path | None, typer.Option(help="Save what the caller heard here (WAV)")] = None,
    wideband: Annotated[
        bool, typer.Option(help="Telnyx: the caller's leg is wideband (L16 16 kHz), not PCMU 8 kHz")
    ] = False,
    audiosocket: Annotated[
        str | None,
        typer.Option(
            help="Asterisk: call over AudioSocket, to the server's listener HOST:PORT (else chan_websocket)"
        ),
    ] = None,
    rate: Annotated[
        int | None, typer.Option(help="Asterisk: the leg's rate, 8000, 16000 (the default) or 24000")
    ] = None,
) -> None:
    """Call the server as CARRIER would, saying WAV; prints what happened (JSON)."""
    from . import parse_carriers

    (name,) = parse_carriers(carrier) or [""]
    if name != "asterisk" and (audiosocket or rate):
        raise UserError("--audiosocket and --rate are Asterisk's: use them with --carrier asterisk")
    if rate is not None and rate not in ASTERISK_FORMATS:
        raise UserError(f"--rate {rate}: Asterisk's legs here are 8000, 16000 or 24000 Hz")
    digits = parse_digits(dtmf or [])
    pcm = read_audio(wav)
    options: dict[str, Any] = {}
    if name == "telnyx" and wideband:
        options = {"inbound_codec": "L16", "inbound_rate": 16000}
    if name == "asterisk":
        options = {"fmt": ASTERISK_FORMATS[rate or 16000]}
    if audiosocket:
        call = _simulate_audiosocket(url, audiosocket, rate or 16000, pcm, digits, to, from_)
    else:
        call = _simulate(name, url, public_url, pcm, digits, to, from_, options)
    summary, heard, heard_rate = asyncio.run(call)
    if out is not None:
        write_wav(out, heard, heard_rate, subtype="PCM_16")
        summary["heard_wav"] = str(out)
    typer.echo(json.dumps(summary, indent=2))


@app.command()
def keypair() -> None:
    """A new Ed25519 key pair: TELNYX_PUBLIC_KEY for the server, TELNYX_PRIVATE_KEY for `simulate`."""
    try:
        from personaplex_telnyx.sim import keypair as make
    except ImportError as exc:
        raise UserError(f"the Telnyx carrier is not installed ({exc})") from None
    private, public = make()
    typer.echo(f"TELNYX_PUBLIC_KEY={public}\nTELNYX_PRIVATE_KEY={private}")
