// Opus through WebCodecs (AudioEncoder / AudioDecoder), in Ogg pages made by ogg.js.
import { OggDemuxer, OggMuxer } from "./ogg.js";

export const WIRE_RATE = 24000; // the server's sample rate, both directions
const FRAME_US = 20000; // 20 ms Opus packets

export function webCodecsAvailable() {
  return typeof AudioEncoder !== "undefined" && typeof AudioDecoder !== "undefined";
}

// Streaming linear-interpolation resampler (the browser's capture/playback rate ↔ 24 kHz).
export class Resampler {
  constructor(inRate, outRate) {
    this.step = inRate / outRate;
    this.same = inRate === outRate;
    this.t = 1; // read position in [previous sample, ...input]
    this.prev = 0;
  }

  process(input) {
    if (this.same || input.length === 0) return input;
    const out = new Float32Array(Math.ceil((input.length + 1 - this.t) / this.step) + 1);
    let n = 0;
    let t = this.t;
    while (t < input.length) {
      const i = Math.floor(t);
      const f = t - i;
      const a = i === 0 ? this.prev : input[i - 1];
      out[n++] = a + (input[i] - a) * f;
      t += this.step;
    }
    this.t = t - input.length;
    this.prev = input[input.length - 1];
    return out.subarray(0, n);
  }
}

// PCM (24 kHz float32) in, Ogg pages out (headers first, then one page per 20 ms packet).
export class OggOpusEncoder {
  constructor(onPages, onError) {
    this.onPages = onPages;
    this.muxer = new OggMuxer();
    this.timestampUs = 0;
    this.granule = 0;
    this.headersSent = false;
    this.encoder = new AudioEncoder({
      output: (chunk, meta) => this.onChunk(chunk, meta),
      error: (e) => onError(`audio encoder: ${e.message || e}`),
    });
    this.encoder.configure({
      codec: "opus",
      sampleRate: WIRE_RATE,
      numberOfChannels: 1,
      bitrate: 32000,
      opus: { frameDuration: FRAME_US, complexity: 5 },
    });
  }

  encode(samples) {
    if (this.encoder.state !== "configured" || samples.length === 0) return;
    const data = new AudioData({
      format: "f32-planar",
      sampleRate: WIRE_RATE,
      numberOfFrames: samples.length,
      numberOfChannels: 1,
      timestamp: this.timestampUs,
      data: samples,
    });
    this.timestampUs += Math.round((samples.length * 1e6) / WIRE_RATE);
    this.encoder.encode(data);
    data.close();
  }

  onChunk(chunk, meta) {
    const packet = new Uint8Array(chunk.byteLength);
    chunk.copyTo(packet);
    let out = [];
    if (!this.headersSent) {
      const preSkip = preSkipFrom(meta?.decoderConfig?.description) ?? 312;
      this.granule = preSkip;
      out.push(this.muxer.headers(WIRE_RATE, preSkip));
      this.headersSent = true;
    }
    this.granule += Math.round(((chunk.duration || FRAME_US) * 48000) / 1e6);
    out.push(this.muxer.page(packet, this.granule));
    this.onPages(out.length === 1 ? out[0] : joinBytes(out));
  }

  close() {
    if (this.encoder.state !== "closed") this.encoder.close();
  }
}

// Ogg pages in (any split), PCM at `outRate` out.
export class OggOpusDecoder {
  constructor(outRate, onPcm, onError) {
    this.outRate = outRate;
    this.onPcm = onPcm;
    this.onError = onError;
    this.demuxer = new OggDemuxer();
    this.decoder = null;
    this.resampler = null;
    this.timestampUs = 0;
  }

  push(bytes) {
    for (const packet of this.demuxer.push(bytes)) {
      if (startsWith(packet, "OpusHead")) this.configure(packet);
      else if (startsWith(packet, "OpusTags")) continue;
      else if (this.decoder) this.decodePacket(packet);
    }
  }

  configure(head) {
    if (this.decoder) this.decoder.close();
    this.decoder = new AudioDecoder({
      output: (audio) => this.onAudio(audio),
      error: (e) => this.onError(`audio decoder: ${e.message || e}`),
    });
    this.decoder.configure({ codec: "opus", sampleRate: 48000, numberOfChannels: 1, description: head });
  }

  decodePacket(packet) {
    const chunk = new EncodedAudioChunk({ type: "key", timestamp: this.timestampUs, data: packet });
    this.timestampUs += FRAME_US;
    this.decoder.decode(chunk);
  }

  onAudio(audio) {
    const samples = new Float32Array(audio.numberOfFrames);
    audio.copyTo(samples, { planeIndex: 0, format: "f32-planar" });
    if (!this.resampler) this.resampler = new Resampler(audio.sampleRate, this.outRate);
    audio.close();
    this.onPcm(this.resampler.process(samples));
  }

  close() {
    if (this.decoder && this.decoder.state !== "closed") this.decoder.close();
  }
}

function preSkipFrom(description) {
  if (!description) return null;
  const bytes = description instanceof ArrayBuffer ? new Uint8Array(description) : new Uint8Array(description.buffer, description.byteOffset, description.byteLength);
  if (bytes.length < 19 || !startsWith(bytes, "OpusHead")) return null;
  return bytes[10] | (bytes[11] << 8);
}

function startsWith(bytes, ascii) {
  if (bytes.length < ascii.length) return false;
  for (let i = 0; i < ascii.length; i++) if (bytes[i] !== ascii.charCodeAt(i)) return false;
  return true;
}

function joinBytes(parts) {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}
