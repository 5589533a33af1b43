// Minimal Ogg container for one Opus stream (RFC 3533 pages, RFC 7845 Opus mapping).
// The muxer writes one packet per page; the demuxer accepts any page layout and bytes split
// across WebSocket messages.

const CRC_TABLE = (() => {
  // CRC-32 as Ogg defines it: polynomial 0x04C11DB7, MSB first, initial value 0, no final xor.
  const table = new Uint32Array(256);
  for (let i = 0; i < 256; i++) {
    let r = i << 24;
    for (let k = 0; k < 8; k++) r = r & 0x80000000 ? (r << 1) ^ 0x04c11db7 : r << 1;
    table[i] = r >>> 0;
  }
  return table;
})();

export function oggCrc(bytes) {
  let crc = 0;
  for (let i = 0; i < bytes.length; i++) {
    crc = ((crc << 8) ^ CRC_TABLE[((crc >>> 24) ^ bytes[i]) & 0xff]) >>> 0;
  }
  return crc >>> 0;
}

const FLAG_CONTINUED = 0x01;
const FLAG_BOS = 0x02;
const FLAG_EOS = 0x04;

// OpusHead (RFC 7845 §5.1): mono, mapping family 0.
export function opusHead(inputSampleRate, preSkip = 312) {
  const head = new Uint8Array(19);
  head.set([0x4f, 0x70, 0x75, 0x73, 0x48, 0x65, 0x61, 0x64]); // "OpusHead"
  const view = new DataView(head.buffer);
  head[8] = 1; // version
  head[9] = 1; // channels
  view.setUint16(10, preSkip, true);
  view.setUint32(12, inputSampleRate, true);
  view.setInt16(16, 0, true); // output gain
  head[18] = 0; // channel mapping family
  return head;
}

export function opusTags(vendor = "personaplex-voice web") {
  const vendorBytes = new TextEncoder().encode(vendor);
  const tags = new Uint8Array(8 + 4 + vendorBytes.length + 4);
  tags.set([0x4f, 0x70, 0x75, 0x73, 0x54, 0x61, 0x67, 0x73]); // "OpusTags"
  const view = new DataView(tags.buffer);
  view.setUint32(8, vendorBytes.length, true);
  tags.set(vendorBytes, 12);
  view.setUint32(12 + vendorBytes.length, 0, true); // no user comments
  return tags;
}

export class OggMuxer {
  constructor(serial = (Math.random() * 0xffffffff) >>> 0) {
    this.serial = serial;
    this.sequence = 0;
  }

  // One page holding one whole packet. `granule` is the Opus granule position (48 kHz samples).
  page(packet, granule, { bos = false, eos = false } = {}) {
    const lacing = [];
    let left = packet.length;
    while (left >= 255) {
      lacing.push(255);
      left -= 255;
    }
    lacing.push(left); // a final value < 255 ends the packet (0 when the length is a multiple of 255)
    if (lacing.length > 255) throw new Error(`packet too large for one Ogg page (${packet.length} bytes)`);
    const page = new Uint8Array(27 + lacing.length + packet.length);
    const view = new DataView(page.buffer);
    page.set([0x4f, 0x67, 0x67, 0x53]); // "OggS"
    page[4] = 0; // version
    page[5] = (bos ? FLAG_BOS : 0) | (eos ? FLAG_EOS : 0);
    view.setBigInt64(6, BigInt(granule), true);
    view.setUint32(14, this.serial, true);
    view.setUint32(18, this.sequence++, true);
    view.setUint32(22, 0, true); // CRC, filled below
    page[26] = lacing.length;
    page.set(lacing, 27);
    page.set(packet, 27 + lacing.length);
    view.setUint32(22, oggCrc(page), true);
    return page;
  }

  headers(inputSampleRate, preSkip) {
    const head = this.page(opusHead(inputSampleRate, preSkip), 0, { bos: true });
    const tags = this.page(opusTags(), 0);
    const out = new Uint8Array(head.length + tags.length);
    out.set(head);
    out.set(tags, head.length);
    return out;
  }
}

export class OggDemuxer {
  constructor() {
    this.buffer = new Uint8Array(0);
    this.partial = []; // pieces of a packet continued on the next page
  }

  // Feed bytes; returns the complete packets found, in order.
  push(bytes) {
    const merged = new Uint8Array(this.buffer.length + bytes.length);
    merged.set(this.buffer);
    merged.set(bytes, this.buffer.length);
    const packets = [];
    let pos = 0;
    while (merged.length - pos >= 27) {
      if (merged[pos] !== 0x4f || merged[pos + 1] !== 0x67 || merged[pos + 2] !== 0x67 || merged[pos + 3] !== 0x53) {
        throw new Error("not an Ogg page (bad capture pattern)");
      }
      const segments = merged[pos + 26];
      const headerLen = 27 + segments;
      if (merged.length - pos < headerLen) break;
      let bodyLen = 0;
      for (let i = 0; i < segments; i++) bodyLen += merged[pos + 27 + i];
      if (merged.length - pos < headerLen + bodyLen) break;
      if (!(merged[pos + 5] & FLAG_CONTINUED)) this.partial = [];
      let offset = pos + headerLen;
      let start = offset;
      for (let i = 0; i < segments; i++) {
        const lace = merged[pos + 27 + i];
        offset += lace;
        if (lace < 255) {
          this.partial.push(merged.slice(start, offset));
          packets.push(concat(this.partial));
          this.partial = [];
          start = offset;
        }
      }
      if (start < offset) this.partial.push(merged.slice(start, offset));
      pos += headerLen + bodyLen;
    }
    this.buffer = merged.slice(pos);
    return packets;
  }
}

function concat(parts) {
  if (parts.length === 1) return parts[0];
  const total = parts.reduce((n, p) => n + p.length, 0);
  const out = new Uint8Array(total);
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}
