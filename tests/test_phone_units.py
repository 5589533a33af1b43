"""The carrier-neutral phone call's parts on their own: audio formats, the journal's bounded
memory, the registry's one reservation per call, per-carrier personas. No server, no sockets."""

from __future__ import annotations

import json

import numpy as np
import pytest
from personaplex_phone.audio_path import InboundAudio, OutboundAudio, codec_for, silence_chunk
from personaplex_phone.carrier import AudioFormat, Reply
from personaplex_phone.journal import CallJournal
from personaplex_phone.personas import PersonaBook
from personaplex_phone.records import RecordStore, valid_sid
from personaplex_phone.registry import HISTORY, CallRegistry, StreamTicket
from support_twilio import sine_fit_snr_db, tone

from personaplex_voice.audio.telephony import l16_decode, l16_encode
from personaplex_voice.errors import UserError

L16_BE_16K = AudioFormat("l16", 16000, big_endian=True)
L16_LE_16K = AudioFormat("l16", 16000)


# --- L16: the byte order is explicit ---------------------------------------------------------------


def test_l16_byte_order_is_what_each_format_says() -> None:
    pcm = np.array([0.5, -0.25], np.float32)  # 16384, -8192
    assert l16_encode(pcm, big_endian=True) == bytes([0x40, 0x00, 0xE0, 0x00])
    assert l16_encode(pcm, big_endian=False) == bytes([0x00, 0x40, 0x00, 0xE0])
    assert np.array_equal(l16_decode(bytes([0x40, 0x00]), big_endian=True), [0.5])
    assert np.array_equal(l16_decode(bytes([0x40, 0x00]), big_endian=False), [64 / 32768])
    with pytest.raises(ValueError, match="whole 2-byte samples"):
        l16_decode(b"\x00\x01\x02", big_endian=False)


@pytest.mark.parametrize(
    "fmt", [AudioFormat("pcmu", 8000), AudioFormat("pcma", 8000), L16_BE_16K, L16_LE_16K]
)
def test_each_format_round_trips_a_tone_through_the_call(fmt) -> None:
    """The caller's audio up to 24 kHz and the agent's back down, 20 ms messages each way."""
    inbound, outbound = InboundAudio(fmt), OutboundAudio(fmt)
    sent = tone(1000.0, 1.0, rate=fmt.rate)
    data = codec_for(fmt).encode(sent)
    up = np.concatenate(
        [inbound.convert(data[i : i + fmt.chunk_bytes]) for i in range(0, len(data), fmt.chunk_bytes)]
    )
    assert len(up) == 24000
    chunks = []
    for i in range(0, len(up), 1920):
        chunks += outbound.convert(up[i : i + 1920])
    assert all(len(c) == fmt.chunk_bytes for c in chunks)
    back = np.concatenate([outbound.decode(c) for c in chunks])
    assert sine_fit_snr_db(back[400:-400], 1000.0, fmt.rate) >= 30.0
    assert silence_chunk(fmt) == codec_for(fmt).encode(np.zeros(fmt.rate // 50, np.float32))


def test_formats_say_what_they_are() -> None:
    assert AudioFormat("pcmu", 8000).chunk_bytes == 160 and L16_BE_16K.chunk_bytes == 640
    assert L16_BE_16K.describe() == "L16 16 kHz big-endian" and L16_BE_16K.wideband


# --- the journal: the one writer, a bounded summary once ended ------------------------------------


async def test_an_ended_call_keeps_a_bounded_summary_and_its_record_on_disk(tmp_path) -> None:
    store = RecordStore(tmp_path, max_age_s=3600, max_bytes=1 << 30)
    journal = CallJournal("CA" + "1" * 32, "twilio", store)
    journal.stream_started("MZ1", "desk", {"name": "x"}, keep_files=True)
    journal.session_started("s1", "You answer. " * 300)
    for i in range(5000):
        journal.transcript({"t": i * 0.08, "frame": i, "text": " word"})
    for i in range(300):
        journal.status(f"s{i}")
        journal.dtmf("1")
        journal.action({"rule": 0, "action": "play", "ok": True, "i": i})
    await journal.finish("stop", {"frames_in": 1}, None, {})
    summary = journal.summary()
    assert len(json.dumps(summary)) < 8000  # whatever the call did
    assert journal.record.transcript == [] and journal.record.prompt is None
    assert summary["transcript_pieces"] == 5000 and summary["actions_total"] == 64
    on_disk = store.load(journal.call_id)
    assert len(on_disk["transcript"]) == 5000 and on_disk["end_reason"] == "stop"
    assert on_disk["prompt"].startswith("You answer.")


def test_the_registry_keeps_the_newest_calls_and_never_a_live_ones_journal() -> None:
    registry = CallRegistry()
    live = registry.journal("CA-live", "twilio")
    live.record.live = True
    for i in range(HISTORY + 50):
        registry.status(f"CA{i:06d}", "telnyx", "webhook")
    assert len(registry.calls) == HISTORY
    assert registry.find("CA-live") is live and registry.find("CA000000") is None


def test_one_outstanding_ticket_per_call() -> None:
    registry = CallRegistry()
    answer = Reply("<Response/>", "application/xml")
    registry.issued(StreamTicket("t1", "plivo", "desk", "call-1", 1e12, answer))
    assert registry.outstanding("plivo", "call-1").ticket_id == "t1"
    assert registry.outstanding("vonage", "call-1") is None  # per carrier
    with pytest.raises(LookupError):
        registry.claim("t1", "call-2")  # another call's stream
    assert registry.claim("t1", "call-1").ticket_id == "t1"
    assert registry.outstanding("plivo", "call-1") is None  # redeemed: the next answer is fresh


def test_call_ids_of_every_carrier_are_safe_folder_names() -> None:
    for good in ("CA" + "0" * 32, "v3:abc-DEF_123", "b1c3e5f6-0000-4a4b-8c8d-000000000000"):
        assert valid_sid(good)
    for bad in ("..", "../etc", "a/b", ".hidden", "x", "a" * 200):
        assert not valid_sid(bad)


# --- personas: pinned per carrier and number --------------------------------------------------------


def test_personas_may_be_pinned_per_carrier_and_number(tmp_path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        "default: desk\n"
        "personas: {desk: {}, sales: {}, hindi: {}}\n"
        "numbers: {'+15550001': sales}\n"
        "carriers:\n"
        "  exotel: {default: hindi}\n"
        "  telnyx: {numbers: {'+15550001': desk}}\n"
    )
    book = PersonaBook.load(path)
    assert book.for_number("+15550001", "twilio") == "sales"
    assert book.for_number("+15550001", "telnyx") == "desk"  # the carrier's own pin wins
    assert book.for_number("+15550001", "exotel") == "sales"  # then the number's
    assert book.for_number("+15550002", "exotel") == "hindi"  # then the carrier's default
    assert book.for_number("+15550002", "plivo") == "desk"
    path.write_text("personas: {default: {}}\ncarriers: {telnyx: {default: ghost}}\n")
    with pytest.raises(UserError, match="ghost"):
        PersonaBook.load(path)


# --- carriers stay apart -----------------------------------------------------------------------------


def test_no_carrier_imports_another_and_none_imports_torch() -> None:
    """A carrier knows the phone call (personaplex_phone) and personaplex_voice's plain parts, never
    another carrier (what they share is written once in personaplex_phone) nor torch."""
    import ast
    import importlib
    from pathlib import Path

    from personaplex_phone import CARRIERS

    packages = set(CARRIERS.values())
    for name, package in CARRIERS.items():
        folder = Path(importlib.import_module(package).__file__).parent
        for path in sorted(folder.glob("*.py")):
            tree = ast.parse(path.read_text())
            names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
            roots = {n.split(".")[0] for n in names}
            others = roots & (packages - {package})
            assert not others, f"{name}: {path.name} imports {others}"
            assert "torch" not in roots, f"{name}: {path.name} imports torch"
