"""One WebRTC call: a peer connection (aiortc) carrying one session of the session API.

The one owner of a call's transport state: its peer connection (replaced whole when a Pipecat
client restarts it), the caller's audio path (`CallerAudio`), the agent's (`AgentTrack` fed
through a `PacketPacer`), the data channel and the dialect spoken on it, and how the call ends.
The session (slot, queue, persona) is the host's: the call is handed it open, and closes it
exactly once, when the call ends for any reason.

Life of a call:
1. the endpoint opened the session (refusals are its HTTP answers) and calls `start(offer)`:
   the peer connection is built (Opus only, audio `sendrecv`, any other media `inactive`), the
   answer returned;
2. the data channel gets the metadata (and again while the call waits in the queue), then the
   handshake once the persona is in its slot; the caller's audio reaches the session from then
   on (before, it is decoded and dropped, as the page's microphone starts before the handshake);
3. every session frame goes out as four paced Opus packets, its text on the data channel;
4. the call ends when the client hangs up (WHIP DELETE, RTVI `disconnect-bot`, a DTLS close),
   when the peer vanishes (nothing received for `peer_timeout_s`: no RTP, RTCP, data or ICE
   consent) or never connects (`connect_timeout_s`), when its audio breaks the decode budget, or
   when the session ends on the server (idle, limit, shutdown). A server-side end is told to
   the client first on the data channel (the dialect's error), then the peer connection closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiortc import (
    RTCBundlePolicy,
    RTCConfiguration,
    RTCIceServer,
    RTCPeerConnection,
    RTCRtpSender,
    RTCSessionDescription,
)
from aiortc.sdp import candidate_from_sdp

from personaplex_voice.audio.budget import DecodeBudget, DecodeBudgetExceeded, TokenBucket
from personaplex_voice.audio.opus_packets import RTP_CLOCK, OpusPacketDecoder, OpusPacketEncoder
from personaplex_voice.engine.base import FRAME_SIZE, SAMPLE_RATE, PersonaError, SaturatedError
from personaplex_voice.server.chat import BYTES_BURST, BYTES_PER_S
from personaplex_voice.server.protocol import ChatParams
from personaplex_voice.server.webrtc.agent_audio import AgentTrack, PacketPacer
from personaplex_voice.server.webrtc.caller_audio import CallerAudio
from personaplex_voice.server.webrtc.dialects import MAX_INBOUND_BYTES, Dialect, Payload, inbound_kind
from personaplex_voice.server.webrtc.ice import IceServer
from personaplex_voice.server.webrtc.metrics import WebRTCMetrics
from personaplex_voice.server.webrtc.sdp import OfferFacts, SdpFragment, answer_with_opus_fmtp, parse_offer
from personaplex_voice.session_api import CallSession, MediaMeter, slips_warning

log = logging.getLogger("personaplex_voice.server.webrtc")

QUEUE_POLL_S = 0.25
WATCH_EVERY_S = 1.0
CLOCK_EVERY_S = 0.020
MAX_PENDING_MESSAGES = 50  # data-channel messages kept until the channel opens
MAX_BUFFERED_BYTES = 256 * 1024  # a client not reading its data channel loses text past this
MIN_EXPECTED_LOSS_PCT = 5  # FEC is always carried: the first loss is rebuilt, not only later ones
FRAME_TICKS = FRAME_SIZE * RTP_CLOCK // SAMPLE_RATE  # RTP ticks per 80 ms session frame
GATHER_TIMEOUT_S = 10.0  # building an answer (ICE gathering through STUN/TURN included)
# The caller's audio is pushed this far ahead of the session's tick (see `_align_phase`).
INPUT_MARGIN_S = 0.060


class CallEnded(Exception):
    """Why a call ends: `kind` for the metrics and the client, `message` in words, and the
    session's close reason."""

    def __init__(self, kind: str, message: str, close_reason: str = "client", tell_client: bool = True):
        super().__init__(message)
        self.kind, self.message, self.close_reason, self.tell_client = (
            kind,
            message,
            close_reason,
            tell_client,
        )


@dataclass(frozen=True)
class CallConfig:
    ice_servers: tuple[IceServer, ...]
    peer_timeout_s: float
    connect_timeout_s: float
    realtime: bool  # the host keeps an 80 ms clock: the caller's silence is concealed by time


class _RtpTap:
    """Takes the place of aiortc's jitter buffer on the call's audio receiver.

    aiortc's audio jitter buffer waits for a lost packet until 16 packets have passed (320 ms)
    and has no FEC; its decoder thread decodes at 48 kHz stereo into a queue nobody would read.
    The receiver still does everything before its buffer (SRTP, statistics for the RTCP receiver
    reports a browser's encoder sizes its FEC by, payload type checks), then hands each packet
    here; nothing ever reaches its decoder. (Pipecat replaces the same attribute for video.)"""

    capacity = 16

    def __init__(self, on_packet: Any) -> None:
        self._on_packet = on_packet

    def add(self, packet: Any) -> tuple[bool, None]:
        self._on_packet(packet)
        return False, None


def _opus_preferences() -> list[Any]:
    return [c for c in RTCRtpSender.getCapabilities("audio").codecs if c.mimeType.lower() == "audio/opus"]


class WebRTCCall:
    def __init__(
        self,
        *,
        call_id: str,
        endpoint: str,
        session: CallSession,
        params: ChatParams,
        dialect: Dialect,
        config: CallConfig,
        metrics: WebRTCMetrics,
        meter: MediaMeter,
        metadata: Any,
        on_end: Any,
    ) -> None:
        self.id = call_id
        self.endpoint = endpoint
        self.session = session
        self.params = params
        self.dialect = dialect
        self.config = config
        self.metrics = metrics
        self._meter = meter
        self._metadata = metadata  # () -> dict: the session's 0x04 object
        self._on_end = on_end  # (call) -> None: the service forgets it
        self._pc: RTCPeerConnection | None = None
        self._track: AgentTrack | None = None
        self._pacer = PacketPacer()
        self._budget = DecodeBudget(SAMPLE_RATE)
        self._data_bytes = TokenBucket(BYTES_PER_S, BYTES_BURST)  # /api/chat's message budget
        self._caller: CallerAudio | None = None
        self._encoder: OpusPacketEncoder | None = None
        self._channel: Any = None
        self._pending: deque[Payload] = deque(maxlen=MAX_PENDING_MESSAGES)
        self._tasks: list[asyncio.Task[None]] = []
        self._finisher: asyncio.Task[None] | None = None
        self._live = False  # the handshake is out: the caller's audio reaches the session
        self._phased = False  # the uplink margin is set (at the first audio after the handshake)
        self._connected = False
        self._ever_connected = False
        self._answered_at = time.monotonic()
        self._last_heard = time.monotonic()
        self._rx_packets = -1
        self._remote_ufrag: str | None = None
        self._offer: OfferFacts | None = None
        self._counted: dict[str, float] = {}
        self.dropped_text = 0
        self.pre_ready_ms = 0.0
        self.local_sdp = ""  # the last answer given
        self.ended: CallEnded | None = None
        self.ended_event = asyncio.Event()

    # -- signalling ------------------------------------------------------------------------------

    async def start(self, offer_sdp: str) -> str:
        """The answer to the first offer; starts the call's tasks."""
        self._offer = parse_offer(offer_sdp)
        self._encoder = OpusPacketEncoder(
            SAMPLE_RATE,
            fec=self._offer.peer_wants_fec,
            dtx=self._offer.peer_wants_dtx,
            expected_loss_pct=MIN_EXPECTED_LOSS_PCT,
        )
        answer = await self._new_peer(offer_sdp)
        self._tasks = [
            asyncio.create_task(self._run(), name=f"webrtc-{self.id[:12]}-run"),
            asyncio.create_task(self._watch(), name=f"webrtc-{self.id[:12]}-watch"),
        ]
        if self.config.realtime:
            self._tasks.append(asyncio.create_task(self._clock(), name=f"webrtc-{self.id[:12]}-clock"))
        return answer

    async def renegotiate(self, offer_sdp: str, restart: bool) -> str:
        """A new offer on a live call (Pipecat's client): on the same peer connection, or, with
        `restart`, on a new one that carries on the same session (an ICE restart after the
        network changed: the conversation goes on)."""
        parse_offer(offer_sdp)
        if restart or self._pc is None:
            old, self._pc = self._pc, None  # its state changes no longer speak for the call
            if self._track is not None:
                self._track.stop()
            if old is not None:
                await old.close()
            self._connected = False
            self._answered_at = time.monotonic()
            self._channel = None
            return await self._new_peer(offer_sdp)
        pc = self._pc
        await pc.setRemoteDescription(RTCSessionDescription(sdp=offer_sdp, type="offer"))
        self._configure_transceivers(pc)
        await pc.setLocalDescription(await pc.createAnswer())
        self.local_sdp = answer_with_opus_fmtp(pc.localDescription.sdp)
        return self.local_sdp

    async def abort(self) -> None:
        """Undo a `start` that failed (the endpoint closes the session)."""
        if self._track is not None:
            self._track.stop()
        pc, self._pc = self._pc, None
        if pc is not None:
            with contextlib.suppress(Exception):
                await pc.close()

    async def add_candidates(self, fragment: SdpFragment) -> None:
        """Trickled ICE candidates (WHIP PATCH, Pipecat PATCH)."""
        pc = self._pc
        if pc is None:
            return
        for line, mid, index in fragment.candidates:
            candidate = candidate_from_sdp(line.split(":", 1)[1] if line.startswith("candidate:") else line)
            candidate.sdpMid = mid
            candidate.sdpMLineIndex = index
            await pc.addIceCandidate(candidate)
        if fragment.end_of_candidates:
            await pc.addIceCandidate(None)

    @property
    def remote_ice_ufrag(self) -> str | None:
        return self._remote_ufrag

    async def _new_peer(self, offer_sdp: str) -> str:
        servers = [
            RTCIceServer(s.urls[0] if len(s.urls) == 1 else list(s.urls), s.username, s.credential)
            for s in self.config.ice_servers
        ]
        pc = RTCPeerConnection(RTCConfiguration(iceServers=servers, bundlePolicy=RTCBundlePolicy.MAX_BUNDLE))
        self._pc = pc
        pc.on("datachannel", self._on_channel)
        pc.on("connectionstatechange", lambda: self._on_state(pc))
        # Made before the offer is applied, so its codec preferences (Opus only) decide the
        # negotiation: aiortc picks a transceiver's codecs when the remote description is set.
        self._track = AgentTrack(self._pacer)
        audio = pc.addTransceiver(self._track, direction="sendrecv")
        audio.setCodecPreferences(_opus_preferences())
        await pc.setRemoteDescription(RTCSessionDescription(sdp=offer_sdp, type="offer"))
        self._remote_ufrag = next(
            (line[12:].strip() for line in offer_sdp.splitlines() if line.startswith("a=ice-ufrag:")), None
        )
        self._configure_transceivers(pc)
        self._caller = CallerAudio(OpusPacketDecoder(SAMPLE_RATE), self._caller_pcm, self._budget)
        # The one private attribute touched (see _RtpTap); tests/test_webrtc_units.py fails if
        # an aiortc release renames it.
        audio.receiver._RTCRtpReceiver__jitter_buffer = _RtpTap(self._on_rtp)
        async with asyncio.timeout(GATHER_TIMEOUT_S):
            await pc.setLocalDescription(await pc.createAnswer())
        self._rx_packets = -1
        self.local_sdp = answer_with_opus_fmtp(pc.localDescription.sdp)
        return self.local_sdp

    def _configure_transceivers(self, pc: RTCPeerConnection) -> None:
        """Audio: the first audio transceiver (ours, Opus only), both ways; anything else the
        offer brought (a camera, a second audio line) inactive."""
        audio_seen = False
        for transceiver in pc.getTransceivers():
            if transceiver.kind == "audio" and not audio_seen:
                audio_seen = True
                transceiver.direction = "sendrecv"
            else:
                transceiver.direction = "inactive"

    # -- events from aiortc ----------------------------------------------------------------------

    def _on_state(self, pc: RTCPeerConnection) -> None:
        if pc is not self._pc or self.ended is not None:
            return
        state = pc.connectionState
        if state == "connected" and not self._connected:
            self._connected = True
            if not self._ever_connected:
                self._ever_connected = True
                self.metrics.open_calls.set(self.metrics.open_calls.value + 1)
            self._last_heard = time.monotonic()
        elif state == "failed":
            self.end_soon(
                CallEnded("ice", "the network path to the caller failed (ICE/DTLS)", tell_client=False)
            )
        elif state == "closed":
            self.end_soon(CallEnded("client", "the caller hung up", tell_client=False))

    def _on_channel(self, channel: Any) -> None:
        if self._channel is not None and self._channel.readyState == "open":
            return  # one channel per call: a second one is not spoken to
        self._channel = channel
        channel.on("message", self._on_message)
        channel.on("open", self._flush_pending)
        if channel.readyState == "open":
            self._flush_pending()

    def _on_message(self, message: Payload) -> None:
        self._last_heard = time.monotonic()
        if self.ended is not None:
            return
        if not self._data_bytes.take(len(message)):
            limit = f"over {BYTES_PER_S // 1024} KiB/s"
            why = f"the client sends far more data than a voice call needs ({limit})"
            self.end_soon(CallEnded("too_fast", why, "refused"))
            return
        if len(message) > MAX_INBOUND_BYTES:
            return
        self.metrics.data_messages_in.inc(label=inbound_kind(message))
        said = self.dialect.read(message)
        if said.hang_up:
            self.end_soon(CallEnded("client", "the caller hung up", tell_client=False))
        elif said.ready_request and self._live:
            self._send(self.dialect.ready())

    def _on_rtp(self, packet: Any) -> None:
        """Called inside aiortc's receive path: must not raise."""
        now = time.monotonic()
        self._last_heard = now
        caller = self._caller
        if caller is None or self.ended is not None:
            return
        started = time.perf_counter()
        try:
            caller.on_packet(packet.sequence_number, packet.timestamp, packet.payload, now)
        except DecodeBudgetExceeded as exc:
            self.end_soon(CallEnded(exc.reason, str(exc), "refused"))
        except Exception:
            log.exception("webrtc call %s: the caller's audio failed", self.id)
            self.end_soon(CallEnded("internal", "internal server error", "transport_error"))
        finally:
            self._meter.add(time.perf_counter() - started)

    def _caller_pcm(self, pcm: np.ndarray) -> None:
        if not self._live or self.session.closed:
            self.pre_ready_ms += 1000 * len(pcm) / SAMPLE_RATE
            return
        if not self._phased:  # the caller's first audio since the handshake (see _align_phase)
            self._phased = True
            self._align_phase(len(pcm))
        self.session.push(pcm)

    # -- the data channel ------------------------------------------------------------------------

    def _send(self, payloads: list[Payload]) -> None:
        channel = self._channel
        for payload in payloads:
            if channel is None or channel.readyState != "open":
                self._pending.append(payload)
            elif channel.bufferedAmount > MAX_BUFFERED_BYTES:
                self.dropped_text += 1
            else:
                channel.send(payload)

    def _flush_pending(self) -> None:
        channel = self._channel
        while self._pending and channel is not None and channel.readyState == "open":
            channel.send(self._pending.popleft())

    async def _drain_channel(self, timeout_s: float = 1.0) -> None:
        """Give a last message the time to leave before the peer connection closes."""
        channel = self._channel
        deadline = time.monotonic() + timeout_s
        while channel is not None and channel.readyState == "open" and channel.bufferedAmount > 0:
            if time.monotonic() > deadline:
                return
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # SCTP hands the chunk to DTLS in its own task

    # -- the call's tasks ------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            self._send(self.dialect.metadata(self._metadata()))
            await self._wait_until_ready()
            self._live = True
            self._send(self.dialect.ready())
            await self._pump()
            reason = self.session.close_reason or "ended"
            code = "shutdown" if reason == "shutdown" else reason
            raise CallEnded("session_ended", f"the session ended on the server ({reason})", code)
        except CallEnded as ended:
            self.end_soon(ended)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("webrtc call %s failed", self.id)
            self.end_soon(CallEnded("internal", "internal server error", "transport_error"))

    async def _wait_until_ready(self) -> None:
        ready = asyncio.ensure_future(self.session.ready())
        position = self.session.queue_position
        try:
            while True:
                done, _ = await asyncio.wait({ready}, timeout=QUEUE_POLL_S)
                if ready in done:
                    try:
                        ready.result()
                    except PersonaError as exc:
                        raise CallEnded("persona", str(exc), "refused") from None
                    except SaturatedError as exc:
                        raise CallEnded("saturated", str(exc), "saturated") from None
                    except Exception:
                        reason = self.session.close_reason or "closed"
                        raise CallEnded(
                            "session_ended", f"the session could not start ({reason})", reason
                        ) from None
                    if position:
                        self._send(self.dialect.metadata(self._metadata()))
                    return
                if self.session.queue_position != position:
                    position = self.session.queue_position
                    self._send(self.dialect.metadata(self._metadata()))
        finally:
            if not ready.done():
                ready.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await ready

    def _align_phase(self, first: int) -> None:
        """An uplink jitter buffer of `INPUT_MARGIN_S`, set once against the session's clock,
        just before the caller's first audio (`first` samples) after the handshake reaches the
        session (not at the handshake: the media may still be connecting then, and the session
        would count the wait as late frames).

        The caller's audio comes in 20 ms packets and the session takes 80 ms frames at its
        ticks, waiting a little (`late_wait_s`) for a frame that is not complete: with the
        packets' phase left to chance, a tick can fall just as a frame's last packet is due,
        and a few ms of network or scheduling jitter then make the frame late (80 ms of silence
        in what the model hears). A little silence pushed first puts every frame's end
        `INPUT_MARGIN_S` before its tick, so that much jitter (or two lost packets in a row,
        concealed by the clock), plus the session's own wait, costs nothing. Lossless hosts wait
        for input anyway: nothing is pushed there."""
        if not self.config.realtime:
            return
        margin = round(INPUT_MARGIN_S * SAMPLE_RATE)
        until_tick = self.session.seconds_to_next_tick()
        if until_tick is None:
            # The engine's clock is idle and starts with this session's first full frame: it
            # starts now, and leaves the margin queued behind that frame.
            lead = FRAME_SIZE + margin - first
        else:
            arriving = first + round(until_tick * SAMPLE_RATE)  # caller audio queued by that tick
            lead = (margin - arriving) % FRAME_SIZE
        if lead > 0:
            self.session.push(np.zeros(lead, np.float32))

    async def _pump(self) -> None:
        encoder = self._encoder
        assert encoder is not None
        async for out in self.session.frames():
            if out.text:
                self._send(self.dialect.text(out.text))
            started = time.perf_counter()
            packets = encoder.encode(out.pcm)
            self._pacer.add_frame(out.index * FRAME_TICKS, packets, time.monotonic(), SAMPLE_RATE)
            self._meter.add(time.perf_counter() - started)
            if self._track is not None:
                self._track.wake()

    async def _clock(self) -> None:
        while True:
            await asyncio.sleep(CLOCK_EVERY_S)
            caller = self._caller
            if caller is None or self.ended is not None:
                continue
            started = time.perf_counter()
            try:
                caller.on_clock(time.monotonic())
            except DecodeBudgetExceeded as exc:
                self.end_soon(CallEnded(exc.reason, str(exc), "refused"))
            finally:
                self._meter.add(time.perf_counter() - started)

    async def _watch(self) -> None:
        """Connect and vanish timeouts, and the loss the peer reports (it sizes our FEC)."""
        while True:
            await asyncio.sleep(WATCH_EVERY_S)
            now = time.monotonic()
            pc = self._pc
            if pc is None:
                continue
            if not self._connected:
                if now - self._answered_at > self.config.connect_timeout_s:
                    self.end_soon(
                        CallEnded(
                            "connect_timeout",
                            f"the caller's WebRTC connection did not come up within "
                            f"{self.config.connect_timeout_s:g} s (ICE/DTLS)",
                            tell_client=False,
                        )
                    )
                continue
            await self._read_stats(pc, now)
            if now - self._last_heard > self.config.peer_timeout_s:
                self.end_soon(
                    CallEnded(
                        "peer_timeout",
                        f"nothing heard from the caller for {self.config.peer_timeout_s:g} s",
                        tell_client=False,
                    )
                )
            self._count_audio_stats()

    async def _read_stats(self, pc: RTCPeerConnection, now: float) -> None:
        stats = await pc.getStats()
        received = 0
        lost_fraction = None
        for entry in stats.values():
            if entry.type == "transport":
                received += entry.packetsReceived
            elif entry.type == "remote-inbound-rtp" and entry.kind == "audio":
                lost_fraction = entry.fractionLost
        if received != self._rx_packets:
            if self._rx_packets >= 0:
                self._last_heard = now  # RTCP, SCTP, ICE consent: the peer is there
            self._rx_packets = received
        if lost_fraction is not None and self._encoder is not None:
            self._encoder.set_expected_loss(max(MIN_EXPECTED_LOSS_PCT, 100 * lost_fraction))

    def _count_audio_stats(self) -> None:
        """Fold the caller audio's counts into the process metrics (as differences)."""
        caller = self._caller
        if caller is None:
            return
        s = caller.stats
        now = {
            "packets": s.packets,
            "lost": s.lost_packets,
            "late": s.late_packets,
            "fec": s.fec_ms / 1000,
            "plc": s.concealed_ms / 1000,
            "dtx": s.dtx_ms / 1000,
            "sent": self._track.sent_packets if self._track is not None else 0,
            "dropped": self._pacer.dropped,
        }
        delta = {k: v - self._counted.get(k, 0) for k, v in now.items()}
        self._counted = now
        m = self.metrics
        if delta["packets"] > 0:
            m.caller_packets.inc(delta["packets"])
        if delta["lost"] > 0:
            m.caller_lost_packets.inc(delta["lost"])
        if delta["late"] > 0:
            m.caller_late_packets.inc(delta["late"])
        for how in ("fec", "plc", "dtx"):
            if delta[how] > 0:
                m.caller_filled_seconds.inc(delta[how], label=how)
        if delta["sent"] > 0:
            m.agent_packets.inc(delta["sent"])
        if delta["dropped"] > 0:
            m.agent_dropped_packets.inc(delta["dropped"])

    # -- the end ---------------------------------------------------------------------------------

    def end_soon(self, ended: CallEnded) -> asyncio.Task[None]:
        """Ends the call once (the first reason wins), in a task of its own."""
        if self._finisher is None:
            self.ended = ended
            self._finisher = asyncio.create_task(self._finish(ended), name=f"webrtc-{self.id[:12]}-end")
        return self._finisher

    async def end(self, ended: CallEnded) -> None:
        await asyncio.shield(self.end_soon(ended))

    async def _finish(self, ended: CallEnded) -> None:
        try:
            if ended.kind != "client":
                self.metrics.errors.inc(label=ended.kind)
            if ended.tell_client and self._channel is not None:
                self._send(self.dialect.error(ended.message, ended.kind))
                await self._drain_channel()
            self._live = False
            await self.session.close(reason=ended.close_reason)
            for task in self._tasks:
                task.cancel()
            for task in self._tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            if self._track is not None:
                self._track.stop()
            pc, self._pc = self._pc, None
            if pc is not None:
                with contextlib.suppress(Exception):
                    await pc.close()
            self._count_audio_stats()
            if self._ever_connected:
                self.metrics.open_calls.set(max(0.0, self.metrics.open_calls.value - 1))
            self._log_end(ended)
        finally:
            self._on_end(self)
            self.ended_event.set()

    def _log_end(self, ended: CallEnded) -> None:
        """Two INFO lines (why the call ended; the session's counts, as /api/chat logs them, and
        the caller's RTP), and the WARNING of a session that lost audio to keep the clock."""
        stats = self.session.stats
        media = self._meter.summary(stats["duration_s"])
        caller = self._caller.stats.as_dict() if self._caller is not None else {}
        log.info("webrtc call %s (%s) ended (%s): %s", self.id, self.endpoint, ended.kind, ended.message)
        log.info(
            "session %s closed (%s): %.1f s of audio, %d late frames, %d dropped output frames, "
            "media path %.2f ms per second; caller RTP %d packets, %d lost, %d late, fec %.0f ms, "
            "concealed %.0f ms, dtx %.0f ms",
            self.session.id,
            self.session.close_reason or ended.close_reason,
            stats["duration_s"],
            stats["late_frames"],
            stats["dropped_output_frames"],
            media.get("media_ms_per_s", 0.0),
            caller.get("packets", 0),
            caller.get("lost_packets", 0),
            caller.get("late_packets", 0),
            caller.get("fec_ms", 0.0),
            caller.get("concealed_ms", 0.0),
            caller.get("dtx_ms", 0.0),
        )
        warning = slips_warning(stats.get("dropped_ms") or {}, stats.get("inserted_ms") or {})
        if warning:
            log.warning("session %s %s", self.session.id, warning)
