// A WebRTC call through WHIP (RFC 9725): POST the offer to /api/whip, DELETE the session to hang up.
// The microphone track goes to the server as Opus (the browser's encoder, with in-band FEC since
// the server's answer asks for it); the agent's track plays through an <audio> element (the
// browser's echo canceller then knows what it plays) and is tapped into the page's audio graph for
// the meter and the recording. The data channel carries the /api/chat message kinds (protocol.js).
import { Kind, decodeMessage } from "./protocol.js";

const GATHER_WAIT_MS = 2000; // send the offer with the candidates gathered by then
const PING_MS = 1000; // 0x06 on the data channel: the server knows the page is still there
const MISDIRECTED_RETRIES = 6; // a cluster front-end that does not hold the call answers 421

async function waitForGathering(pc) {
  if (pc.iceGatheringState === "complete") return;
  await new Promise((resolve) => {
    const timer = setTimeout(resolve, GATHER_WAIT_MS);
    pc.addEventListener("icegatheringstatechange", () => {
      if (pc.iceGatheringState === "complete") {
        clearTimeout(timer);
        resolve();
      }
    });
  });
}

// `fetch` again on a fresh connection while a front-end that does not hold the call says 421.
async function fetchCall(url, init) {
  let response;
  for (let i = 0; i < MISDIRECTED_RETRIES; i++) {
    response = await fetch(url, { ...init, cache: "no-store", keepalive: false });
    if (response.status !== 421) return response;
  }
  return response;
}

export class WebRtcCall {
  // handlers: {onMessage(msg), onTrack(stream), onClose(reason), onError(text)}
  constructor(params, micStream, handlers) {
    this.params = params;
    this.mic = micStream;
    this.handlers = handlers;
    this.pc = null;
    this.channel = null;
    this.location = null;
    this.closed = false;
    this.stats = {};
    this.pinger = null;
  }

  async start() {
    const config = await this.config();
    const pc = new RTCPeerConnection({ iceServers: config.ice_servers || [] });
    this.pc = pc;
    for (const track of this.mic.getAudioTracks()) pc.addTrack(track, this.mic);
    this.channel = pc.createDataChannel("personaplex", { ordered: true });
    this.channel.binaryType = "arraybuffer";
    this.channel.onmessage = (event) => {
      const msg = decodeMessage(event.data);
      if (msg) this.handlers.onMessage(msg);
    };
    this.channel.onopen = () => {
      this.pinger = setInterval(() => {
        if (this.channel.readyState === "open") this.channel.send(new Uint8Array([Kind.PING]));
      }, PING_MS);
    };
    pc.ontrack = (event) => this.handlers.onTrack(event.streams[0] || new MediaStream([event.track]));
    pc.onconnectionstatechange = () => {
      if (this.closed) return;
      if (pc.connectionState === "failed") this.handlers.onClose("The network path to the server failed (ICE).");
      else if (pc.connectionState === "closed") this.handlers.onClose(null);
    };
    await pc.setLocalDescription(await pc.createOffer());
    await waitForGathering(pc);
    const url = new URL("/api/whip", location.href);
    for (const [key, value] of Object.entries(this.params)) {
      if (value !== undefined && value !== null && value !== "") url.searchParams.set(key, String(value));
    }
    const response = await fetch(url, {
      method: "POST",
      headers: { "content-type": "application/sdp" },
      body: pc.localDescription.sdp,
    });
    if (response.status !== 201) {
      const reason = (await response.text()).trim() || `the server answered ${response.status}`;
      throw new Error(reason);
    }
    this.location = new URL(response.headers.get("location"), url).toString();
    await pc.setRemoteDescription({ type: "answer", sdp: await response.text() });
  }

  async config() {
    const url = new URL("/api/webrtc", location.href);
    if (this.params.token) url.searchParams.set("token", this.params.token);
    const response = await fetch(url, { cache: "no-store" });
    const body = await response.json().catch(() => ({}));
    if (!response.ok) throw new Error(body.detail || `the server answered ${response.status}`);
    if (!body.available) throw new Error(body.reason || "this server does not serve WebRTC");
    return body;
  }

  // Network and jitter-buffer numbers from getStats(), for the stats table.
  async readStats() {
    if (!this.pc) return this.stats;
    const report = await this.pc.getStats();
    const s = {};
    report.forEach((entry) => {
      if (entry.type === "candidate-pair" && entry.nominated && entry.state === "succeeded") {
        if (entry.currentRoundTripTime !== undefined) s.rttMs = 1000 * entry.currentRoundTripTime;
      } else if (entry.type === "inbound-rtp" && entry.kind === "audio") {
        s.packetsReceived = entry.packetsReceived;
        s.packetsLost = entry.packetsLost;
        s.jitterMs = 1000 * (entry.jitter || 0);
        s.bytesReceived = entry.bytesReceived;
        if (entry.jitterBufferEmittedCount) {
          s.jitterBufferMs = (1000 * entry.jitterBufferDelay) / entry.jitterBufferEmittedCount;
          if (entry.jitterBufferTargetDelay !== undefined) {
            s.jitterBufferTargetMs = (1000 * entry.jitterBufferTargetDelay) / entry.jitterBufferEmittedCount;
          }
        }
        s.playedSeconds = entry.totalSamplesDuration;
        if (entry.totalSamplesReceived) {
          s.concealedMs = (1000 * (entry.concealedSamples || 0) * (entry.totalSamplesDuration || 0)) / entry.totalSamplesReceived;
          s.insertedMs = (1000 * (entry.insertedSamplesForDeceleration || 0) * (entry.totalSamplesDuration || 0)) / entry.totalSamplesReceived;
          s.removedMs = (1000 * (entry.removedSamplesForAcceleration || 0) * (entry.totalSamplesDuration || 0)) / entry.totalSamplesReceived;
        }
        s.fecPackets = entry.fecPacketsReceived;
      } else if (entry.type === "outbound-rtp" && entry.kind === "audio") {
        s.bytesSent = entry.bytesSent;
      } else if (entry.type === "remote-inbound-rtp" && entry.kind === "audio") {
        s.remoteLossFraction = entry.fractionLost;
        if (entry.roundTripTime !== undefined && s.rttMs === undefined) s.rttMs = 1000 * entry.roundTripTime;
      }
    });
    const total = (s.packetsReceived || 0) + (s.packetsLost || 0);
    s.lossPct = total ? (100 * (s.packetsLost || 0)) / total : 0;
    this.stats = s;
    return s;
  }

  async hangUp() {
    if (this.closed) return;
    this.closed = true;
    clearInterval(this.pinger);
    const where = this.location;
    if (this.pc) this.pc.close(); // a DTLS close: the server ends the call even if the DELETE is lost
    if (where) {
      try {
        const headers = this.params.token ? { authorization: `Bearer ${this.params.token}` } : {};
        await fetchCall(where, { method: "DELETE", headers });
      } catch (e) {
        console.warn("WHIP DELETE failed", e);
      }
    }
  }
}
