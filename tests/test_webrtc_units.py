"""The WebRTC transport's parts, alone and deterministic: the caller's RTP audio path (FEC, loss,
DTX, late packets, the clock), the agent's packet pacing, Opus packets, SDP, ICE settings,
persona parameters and the data channel dialects. No sockets; times are given, not read."""

from __future__ import annotations

import json

import numpy as np
import pytest
from support_twilio import speechlike

from personaplex_voice.audio.budget import DecodeBudget, DecodeBudgetExceeded, DecodeLimits
from personaplex_voice.audio.opus_packets import OpusPacketDecoder, OpusPacketEncoder
from personaplex_voice.server import protocol
from personaplex_voice.server.protocol import ChatParams, QueryError
from personaplex_voice.server.webrtc.caller_audio import CallerAudio
from personaplex_voice.server.webrtc.dialects import ChatKinds, Rtvi
from personaplex_voice.server.webrtc.ice import IceServerError, parse_ice_servers
from personaplex_voice.server.webrtc.params import caller_facts, fill_prompt, merged_query
from personaplex_voice.server.webrtc.sdp import SdpError, answer_with_opus_fmtp, parse_offer, parse_sdpfrag

SR = 24000
PACKET = 480  # 20 ms at 24 kHz
TICKS = 960  # 20 ms at the RTP clock


def speech(seconds: float = 2.0, seed: int = 3) -> np.ndarray:
    return speechlike(seconds, seed, SR)


def voiced(seconds: float = 3.0) -> np.ndarray:
    """A vowel-like sound (harmonics of a gliding pitch, syllable-rate loudness): what SILK, and
    its in-band FEC, codes as speech."""
    t = np.arange(round(seconds * SR)) / SR
    phase = 2 * np.pi * np.cumsum(140 + 20 * np.sin(2 * np.pi * 0.7 * t)) / SR
    harmonics = sum((0.3 / k) * np.sin(k * phase) for k in range(1, 12))
    return (0.5 * harmonics * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)


def packets_of(pcm: np.ndarray, **options) -> list[bytes]:
    return [p.data for p in OpusPacketEncoder(SR, **options).encode(pcm)]


def snr_db(reference: np.ndarray, test: np.ndarray) -> float:
    noise = test.astype(np.float64) - reference.astype(np.float64)
    return float(10 * np.log10(np.sum(reference.astype(np.float64) ** 2) / max(np.sum(noise**2), 1e-30)))


class Collector:
    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []

    def __call__(self, pcm: np.ndarray) -> None:
        self.parts.append(pcm)

    @property
    def pcm(self) -> np.ndarray:
        return np.concatenate(self.parts) if self.parts else np.zeros(0, np.float32)


def caller(**options) -> tuple[CallerAudio, Collector]:
    out = Collector()
    return CallerAudio(OpusPacketDecoder(SR), out, DecodeBudget(SR), **options), out


def feed(
    audio: CallerAudio, packets: list[bytes], drop=(), start_seq=65530, start_ts=2**32 - 3 * TICKS
) -> None:
    """Packets 20 ms apart in time, RTP counters starting near their wrap points; `drop` are
    the indices that never arrive."""
    for i, data in enumerate(packets):
        if i in drop:
            continue
        audio.on_packet((start_seq + i) % 65536, (start_ts + i * TICKS) % 2**32, data, now=i * 0.02)


# -- Opus packets ---------------------------------------------------------------------------------


def test_the_encoder_carries_fec_that_rebuilds_a_lost_frame_better_than_concealment():
    def holes(fec: bool) -> tuple[float, float]:
        """Median SNR of each lost frame rebuilt from the next packet, and concealed."""
        packets = packets_of(voiced(), fec=fec, expected_loss_pct=10)
        full = np.concatenate([d.decode(p) for d in [OpusPacketDecoder(SR)] for p in packets])
        rebuilt, concealed = [], []
        for lost in range(10, 140, 3):
            reference = full[lost * PACKET : (lost + 1) * PACKET]
            for use_fec, scores in ((True, rebuilt), (False, concealed)):
                decoder = OpusPacketDecoder(SR)
                for p in packets[:lost]:
                    decoder.decode(p)
                got = decoder.recover(packets[lost + 1], PACKET) if use_fec else decoder.conceal(PACKET)
                scores.append(snr_db(reference, got))
        return float(np.median(rebuilt)), float(np.median(concealed))

    with_fec, concealed = holes(fec=True)
    assert with_fec > concealed + 6, (with_fec, concealed)
    # Without FEC the next packet carries nothing to rebuild from: recover() is concealment.
    assert holes(fec=False)[0] == pytest.approx(holes(fec=False)[1])


def test_dtx_packets_are_marked_and_the_decoder_rejects_garbage():
    encoder = OpusPacketEncoder(SR, dtx=True)
    packets = encoder.encode(np.zeros(SR, np.float32))
    assert sum(p.dtx for p in packets) > len(packets) // 2  # silence leaves as DTX frames
    assert not any(p.dtx for p in OpusPacketEncoder(SR).encode(speech(0.5)))
    with pytest.raises(ValueError):
        OpusPacketDecoder(SR).decode(b"")
    with pytest.raises(ValueError):
        OpusPacketDecoder(SR).decode(b"\xff" * 3000)


# -- the caller's audio ----------------------------------------------------------------------------


def test_in_order_packets_come_out_as_the_decoded_stream_across_counter_wraps():
    pcm = speech(1.0)
    packets = packets_of(pcm)
    audio, out = caller()
    feed(audio, packets)
    reference = OpusPacketDecoder(SR)
    expected = np.concatenate([reference.decode(p) for p in packets])
    assert np.array_equal(out.pcm, expected)  # the same decoder calls: bit for bit
    assert audio.stats.lost_packets == 0 and audio.stats.resyncs == 0 and audio.stats.packets == len(packets)


def test_lost_packets_are_rebuilt_from_fec_and_the_stream_keeps_its_length():
    def run(fec: bool) -> tuple[CallerAudio, np.ndarray, np.ndarray]:
        packets = packets_of(voiced(), fec=fec, expected_loss_pct=10)
        audio, out = caller()
        feed(audio, packets, drop={*range(10, 141, 5), 141})  # 140 and 141: one hole of two
        reference = OpusPacketDecoder(SR)
        return audio, out.pcm, np.concatenate([reference.decode(p) for p in packets])

    audio, got, expected = run(fec=True)
    assert len(got) == len(expected)  # every hole filled exactly once
    assert audio.stats.lost_packets == 28
    assert audio.stats.fec_ms == 20.0 * 27  # the last lost frame of each of the 27 holes
    assert audio.stats.concealed_ms == 20.0  # packet 140: the packet after it was lost too

    def hole_snr(out: np.ndarray, ref: np.ndarray) -> float:
        return float(
            np.median(
                [
                    snr_db(ref[i * PACKET : (i + 1) * PACKET], out[i * PACKET : (i + 1) * PACKET])
                    for i in range(10, 140, 5)
                ]
            )
        )

    _, plain, plain_expected = run(fec=False)
    assert hole_snr(got, expected) > hole_snr(plain, plain_expected) + 6


def test_a_dtx_pause_is_filled_with_comfort_noise_not_counted_as_loss():
    pcm = np.concatenate([speech(0.5), np.zeros(SR, np.float32), speech(0.5, seed=4)])
    encoded = OpusPacketEncoder(SR, dtx=True).encode(pcm)
    audio, out = caller()
    seq = 100
    for i, p in enumerate(encoded):
        if p.dtx:
            continue  # a sender does not transmit these
        audio.on_packet(seq, i * TICKS, p.data, now=i * 0.02)
        seq += 1
    assert audio.stats.lost_packets == 0 and audio.stats.fec_ms == 0 and audio.stats.dtx_ms > 500
    last = max(i for i, p in enumerate(encoded) if not p.dtx)
    assert len(out.pcm) == (last + 1) * PACKET
    pause = out.pcm[int(0.7 * SR) : int(1.3 * SR)]
    assert np.sqrt(np.mean(pause**2)) < 0.01  # quiet, as the caller was


def test_late_and_duplicate_packets_are_dropped_and_counted():
    packets = packets_of(speech(0.5))
    audio, out = caller()
    for i in (0, 1, 3, 2, 3, 4):  # 2 arrives after 3 (its hole is filled), 3 twice
        audio.on_packet(i, i * TICKS, packets[i], now=i * 0.02)
    assert audio.stats.late_packets == 2 and audio.stats.lost_packets == 1
    assert len(out.pcm) == 5 * PACKET


def test_the_clock_conceals_a_stall_once_and_the_late_packets_are_dropped():
    packets = packets_of(speech(1.0))
    audio, out = caller(conceal_after_s=0.04)
    for i in range(10):
        audio.on_packet(i, i * TICKS, packets[i], now=i * 0.02)
        audio.on_clock(i * 0.02 + 0.01)
    # Nothing for 200 ms: each 20 ms past the 40 ms allowance is concealed as it comes due.
    for k in range(1, 11):
        audio.on_clock(0.19 + k * 0.02)
    concealed = audio.stats.concealed_ms
    assert 100 <= concealed <= 160, concealed
    # The delayed packets arrive in a burst: those whose audio was concealed are dropped.
    for i in range(10, 20):
        audio.on_packet(i, i * TICKS, packets[i], now=0.40)
    assert audio.stats.late_packets == round(concealed / 20)
    assert len(out.pcm) == 20 * PACKET  # the timeline never got longer than the sender's


def test_after_a_loop_stall_the_clock_waits_for_the_packets_that_queued():
    packets = packets_of(speech(0.5))
    audio, out = caller(conceal_after_s=0.04)
    audio.on_packet(0, 0, packets[0], now=0.0)
    audio.on_clock(0.01)
    audio.on_clock(0.50)  # the loop was stalled 490 ms: its packets are still to be handed over
    assert audio.stats.concealed_ms == 0
    for i in range(1, 10):
        audio.on_packet(i, i * TICKS, packets[i], now=0.50)
    assert audio.stats.late_packets == 0 and len(out.pcm) == 10 * PACKET


def test_a_long_silence_is_filled_for_a_second_at_most_then_the_sender_is_followed():
    packets = packets_of(speech(0.5))
    audio, out = caller(conceal_after_s=0.04, max_fill_s=1.0)
    audio.on_packet(0, 0, packets[0], now=0.0)
    t = 0.0
    while t < 5.0:  # muted for five seconds (no RTP at all)
        t += 0.02
        audio.on_clock(t)
    assert 990 <= audio.stats.concealed_ms <= 1000
    audio.on_packet(1, 250 * TICKS, packets[1], now=5.0)  # its timestamps ran on meanwhile
    assert audio.stats.resyncs == 1
    assert len(out.pcm) == 2 * PACKET + round(audio.stats.concealed_ms / 1000 * SR)


def test_a_flood_faster_than_real_time_is_refused_by_the_decode_budget():
    packets = packets_of(speech(1.0))
    budget = DecodeBudget(SR, DecodeLimits(speed=1.5, burst_s=0.5))
    audio = CallerAudio(OpusPacketDecoder(SR), lambda pcm: None, budget)
    with pytest.raises(DecodeBudgetExceeded) as refused:
        for i in range(200):  # 4 s of audio at one instant
            audio.on_packet(i, i * TICKS, packets[i % len(packets)], now=0.0)
    assert refused.value.reason == "too_fast"


def test_damaged_packets_are_concealed_and_counted():
    packets = packets_of(speech(0.5))
    audio, out = caller()
    audio.on_packet(0, 0, packets[0], now=0.0)
    audio.on_packet(1, TICKS, b"\xff\xff\xff" + b"\x00" * 1400, now=0.02)
    audio.on_packet(2, 2 * TICKS, packets[2], now=0.04)
    assert audio.stats.rejected_packets in (0, 1)  # libopus decodes some garbage as noise
    assert len(out.pcm) >= 3 * PACKET - 1


# -- the agent's packets ---------------------------------------------------------------------------


def test_a_frames_packets_leave_20_ms_apart_with_timestamps_from_the_frame_index():
    from personaplex_voice.server.webrtc.agent_audio import PacketPacer

    encoder = OpusPacketEncoder(SR, dtx=True)
    pacer = PacketPacer(max_packets=10)
    pacer.add_frame(7 * 3840, encoder.encode(speech(0.08)), arrival=100.0, rate=SR)
    got = [pacer.pop() for _ in range(len(pacer))]
    assert [p.due for p in got] == pytest.approx([100.0, 100.02, 100.04, 100.06])
    assert [p.pts for p in got] == [7 * 3840 + k * 960 for k in range(4)]
    pacer.add_frame(8 * 3840, encoder.encode(np.zeros(SR, np.float32))[-4:], arrival=100.08, rate=SR)
    assert len(pacer) < 4  # DTX frames are not sent
    for i in range(10):
        pacer.add_frame(i * 3840, encoder.encode(speech(0.08, seed=i)), arrival=101.0, rate=SR)
    assert len(pacer) == 10 and pacer.dropped > 0  # bounded: the oldest go


def test_aiortc_still_keeps_the_receivers_jitter_buffer_where_the_call_replaces_it():
    """call.py replaces one private attribute of aiortc's RTCRtpReceiver (see _RtpTap): a
    release that renames it must fail here, not silently decode at 48 kHz into nowhere."""
    import asyncio

    from aiortc import RTCPeerConnection

    async def check() -> None:
        pc = RTCPeerConnection()
        transceiver = pc.addTransceiver("audio")
        receiver = transceiver.receiver
        assert hasattr(receiver, "_RTCRtpReceiver__jitter_buffer")
        assert hasattr(receiver._RTCRtpReceiver__jitter_buffer, "add")
        await pc.close()

    asyncio.run(check())


# -- SDP ------------------------------------------------------------------------------------------

CHROME_OFFER = "\r\n".join(
    [
        "v=0",
        "o=- 4611731400430051336 2 IN IP4 127.0.0.1",
        "s=-",
        "t=0 0",
        "a=group:BUNDLE 0 1",
        "m=audio 9 UDP/TLS/RTP/SAVPF 111 63 9 0 8",
        "c=IN IP4 0.0.0.0",
        "a=ice-ufrag:abcd",
        "a=ice-pwd:0123456789abcdef0123456789",
        "a=mid:0",
        "a=sendrecv",
        "a=rtpmap:111 opus/48000/2",
        "a=fmtp:111 minptime=10;useinbandfec=1",
        "a=rtpmap:63 red/48000/2",
        "a=rtpmap:9 G722/8000",
        "a=rtpmap:0 PCMU/8000",
        "a=rtpmap:8 PCMA/8000",
        "m=application 9 UDP/DTLS/SCTP webrtc-datachannel",
        "c=IN IP4 0.0.0.0",
        "a=mid:1",
        "a=sctp-port:5000",
        "",
    ]
)


def test_an_offer_is_read_for_opus_and_what_its_decoder_wants():
    facts = parse_offer(CHROME_OFFER)
    assert facts.opus_payload_type == 111 and facts.peer_wants_fec and not facts.peer_wants_dtx
    assert facts.has_data_channel and facts.media == ("audio", "application")
    with pytest.raises(SdpError, match="no Opus"):
        parse_offer(CHROME_OFFER.replace("opus", "speex"))
    with pytest.raises(SdpError, match="no audio"):
        parse_offer("v=0\r\nm=application 9 UDP/DTLS/SCTP webrtc-datachannel\r\n")
    with pytest.raises(SdpError, match="not an SDP"):
        parse_offer("hello")


def test_the_answer_says_what_our_opus_decoder_wants():
    answer = "v=0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 111\r\na=rtpmap:111 opus/48000/2\r\na=mid:0\r\n"
    out = answer_with_opus_fmtp(answer)
    assert "a=fmtp:111 minptime=10;useinbandfec=1;usedtx=0;stereo=0;sprop-stereo=0" in out
    merged = answer_with_opus_fmtp(answer + "a=fmtp:111 maxplaybackrate=48000;useinbandfec=0\r\n")
    line = next(x for x in merged.split("\r\n") if x.startswith("a=fmtp:111"))
    assert "maxplaybackrate=48000" in line and "useinbandfec=1" in line and line.count("useinbandfec") == 1


def test_a_trickle_fragment_is_read():
    frag = parse_sdpfrag(
        "a=ice-ufrag:abcd\r\na=ice-pwd:xyz\r\nm=audio 9 RTP/AVP 0\r\na=mid:0\r\n"
        "a=candidate:1 1 udp 2122260223 192.0.2.1 61764 typ host\r\na=end-of-candidates\r\n"
    )
    assert frag.ice_ufrag == "abcd" and frag.ice_pwd == "xyz" and frag.end_of_candidates
    assert frag.candidates == [("candidate:1 1 udp 2122260223 192.0.2.1 61764 typ host", "0", 0)]


# -- settings and requests -------------------------------------------------------------------------


def test_ice_servers_from_urls_or_json_with_their_link_headers():
    servers = parse_ice_servers("stun:stun.example.com:3478, turn:al%40ice:s3cret@turn.example.com:3478")
    assert servers[0].as_json() == {"urls": ["stun:stun.example.com:3478"]}
    assert servers[1].as_json() == {
        "urls": ["turn:turn.example.com:3478"],
        "username": "al@ice",
        "credential": "s3cret",
    }
    assert servers[1].link_headers() == [
        '<turn:turn.example.com:3478>; rel="ice-server"; username="al@ice"; credential="s3cret"; '
        'credential-type="password"'
    ]
    listed = parse_ice_servers(
        json.dumps([{"urls": ["turns:t.example.com:443"], "username": "u", "credential": "p"}])
    )
    assert listed[0].urls == ("turns:t.example.com:443",)
    for bad in ("http://example.com", "turn:turn.example.com", '[{"urls": "turn:x"}]', "[not json"):
        with pytest.raises(IceServerError):
            parse_ice_servers(bad)
    assert parse_ice_servers("") == []


def test_a_persona_from_json_and_query_with_caller_facts():
    body = {
        "text_prompt": "Greet {customer_name} about order {order}.",
        "seed": 42,
        "greedy": True,
        "caller": {"customer_name": "Omar Torres", "order": 1234},
    }
    given = merged_query({"voice_prompt": "NATF2"}, body)
    params = ChatParams.from_query(given)
    assert params.seed == 42 and params.greedy and params.voice_prompt == "NATF2"
    facts = caller_facts(given, body)
    filled = fill_prompt(params, facts, 4000)
    assert filled.text_prompt == "Greet Omar Torres about order 1234."
    from_query = caller_facts({"caller.customer_name": "Ana"}, None)
    assert fill_prompt(
        ChatParams(text_prompt="Hi {customer_name}, {unknown}"), from_query, 4000
    ).text_prompt == ("Hi Ana, {unknown}")
    for bad in ({"caller": "x"}, {"caller": {"bad-name": "x"}}, {"caller": {"a": "x" * 501}}):
        with pytest.raises(QueryError):
            caller_facts({}, bad)
    with pytest.raises(QueryError, match="too long"):
        fill_prompt(ChatParams(text_prompt="{a}" * 3), {"a": "x" * 500}, 1000)
    with pytest.raises(QueryError):
        merged_query({}, {"seed": {"nested": 1}})


# -- the data channel dialects ---------------------------------------------------------------------


def test_the_chat_dialect_speaks_the_api_chat_kinds():
    kinds = ChatKinds()
    assert protocol.decode(kinds.ready()[0]).kind == protocol.Kind.HANDSHAKE
    assert protocol.decode(kinds.text(" hi")[0]).text() == " hi"
    meta = protocol.decode(kinds.metadata({"session_id": "s"})[0])
    assert meta.kind == protocol.Kind.METADATA and meta.json() == {"session_id": "s"}
    error = protocol.decode(kinds.error("the server is full", "capacity")[0])
    assert error.kind == protocol.Kind.ERROR and error.text() == "the server is full"


def test_the_rtvi_dialect_speaks_as_pipecats_server():
    rtvi = Rtvi()
    assert rtvi.read("ping: 1733000000000").hang_up is False
    assert rtvi.ready() == []  # bot-ready answers client-ready, never comes before it
    said = rtvi.read(json.dumps({"label": "rtvi-ai", "type": "client-ready", "id": "abc", "data": {}}))
    assert said.ready_request
    ready = json.loads(rtvi.ready()[0])
    assert ready["type"] == "bot-ready" and ready["id"] == "abc" and ready["label"] == "rtvi-ai"
    assert json.loads(rtvi.text(" hello")[0]) == {
        "label": "rtvi-ai",
        "type": "bot-transcription",
        "data": {"text": " hello"},
    }
    error, left = (json.loads(m) for m in rtvi.error("the server is full", "capacity"))
    assert error["type"] == "error" and error["data"] == {"message": "the server is full", "fatal": True}
    assert left == {"type": "signalling", "message": {"type": "peerLeft"}}
    mute = {"type": "signalling", "message": {"type": "trackStatus", "receiver_index": 0, "enabled": False}}
    assert rtvi.read(json.dumps(mute)).mic_enabled is False
    assert rtvi.read(json.dumps({"label": "rtvi-ai", "type": "disconnect-bot", "id": "1"})).hang_up
    assert rtvi.read("{not json").hang_up is False and rtvi.read(b"\x00\x01").hang_up is False
