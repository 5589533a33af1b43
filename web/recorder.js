// Records the conversation as a stereo 16-bit WAV: agent on the left, user on the right.
export class ConversationRecorder {
  constructor(sampleRate) {
    this.sampleRate = sampleRate;
    this.left = [];
    this.right = [];
    this.frames = 0;
    this.active = false;
  }

  start() {
    this.left = [];
    this.right = [];
    this.frames = 0;
    this.active = true;
  }

  add(agent, user) {
    if (!this.active) return;
    this.left.push(agent.slice());
    this.right.push(user.slice());
    this.frames += agent.length;
  }

  stop() {
    this.active = false;
    return new Blob([wavBytes(this.left, this.right, this.frames, this.sampleRate)], { type: "audio/wav" });
  }

  get seconds() {
    return this.frames / this.sampleRate;
  }
}

function wavBytes(leftBlocks, rightBlocks, frames, sampleRate) {
  const dataBytes = frames * 4; // 2 channels × 16 bit
  const buffer = new ArrayBuffer(44 + dataBytes);
  const view = new DataView(buffer);
  const text = (at, s) => [...s].forEach((c, i) => view.setUint8(at + i, c.charCodeAt(0)));
  text(0, "RIFF");
  view.setUint32(4, 36 + dataBytes, true);
  text(8, "WAVE");
  text(12, "fmt ");
  view.setUint32(16, 16, true); // fmt chunk size
  view.setUint16(20, 1, true); // PCM
  view.setUint16(22, 2, true); // channels
  view.setUint32(24, sampleRate, true);
  view.setUint32(28, sampleRate * 4, true); // byte rate
  view.setUint16(32, 4, true); // block align
  view.setUint16(34, 16, true); // bits per sample
  text(36, "data");
  view.setUint32(40, dataBytes, true);
  let at = 44;
  const toInt16 = (x) => Math.max(-32768, Math.min(32767, Math.round(x * 32767)));
  for (let b = 0; b < leftBlocks.length; b++) {
    const l = leftBlocks[b];
    const r = rightBlocks[b];
    for (let i = 0; i < l.length; i++) {
      view.setInt16(at, toInt16(l[i]), true);
      view.setInt16(at + 2, toInt16(r[i]), true);
      at += 4;
    }
  }
  return buffer;
}
