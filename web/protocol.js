// /api/chat messages: first byte = kind (see personaplex_voice/server/protocol.py).
export const Kind = Object.freeze({
  HANDSHAKE: 0x00,
  AUDIO: 0x01,
  TEXT: 0x02,
  CONTROL: 0x03,
  METADATA: 0x04,
  ERROR: 0x05,
  PING: 0x06,
});

const utf8 = new TextDecoder();

export function encodeAudio(oggBytes) {
  const out = new Uint8Array(1 + oggBytes.length);
  out[0] = Kind.AUDIO;
  out.set(oggBytes, 1);
  return out;
}

// Returns {kind, payload, text?, data?}; unknown kinds come back as-is for the caller to ignore.
export function decodeMessage(buffer) {
  const bytes = new Uint8Array(buffer);
  if (bytes.length === 0) return null;
  const kind = bytes[0];
  const payload = bytes.subarray(1);
  switch (kind) {
    case Kind.TEXT:
    case Kind.ERROR:
      return { kind, payload, text: utf8.decode(payload) };
    case Kind.METADATA:
      try {
        return { kind, payload, data: JSON.parse(utf8.decode(payload)) };
      } catch {
        return { kind, payload, data: null };
      }
    default:
      return { kind, payload };
  }
}

export function chatUrl(params) {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const url = new URL(`${scheme}//${location.host}/api/chat`);
  for (const [key, value] of Object.entries(params)) {
    if (value !== undefined && value !== null && value !== "") url.searchParams.set(key, String(value));
  }
  return url.toString();
}
