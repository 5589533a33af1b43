// AudioWorklet processors, loaded with audioWorklet.addModule("worklets.js").
//
// "capture": input 0 = microphone, input 1 = the agent audio being played. Posts both, in
//   blocks, to the main thread (mic → encoder; both → the optional stereo recording).
// "playback": a jitter buffer in front of the speakers. Starts once `target` samples are
//   buffered, counts missed samples on underrun (and then buffers a little more), drops the
//   oldest audio when far behind, and reports its counters a few times per second.

const CAPTURE_BLOCK = 960; // samples per message to the main thread

class CaptureProcessor extends AudioWorkletProcessor {
  constructor() {
    super();
    this.mic = new Float32Array(CAPTURE_BLOCK);
    this.agent = new Float32Array(CAPTURE_BLOCK);
    this.fill = 0;
  }

  process(inputs) {
    const mic = inputs[0] && inputs[0][0];
    const agent = inputs[1] && inputs[1][0];
    const n = (mic && mic.length) || (agent && agent.length) || 128;
    for (let i = 0; i < n; i++) {
      this.mic[this.fill] = mic ? mic[i] : 0;
      this.agent[this.fill] = agent ? agent[i] : 0;
      if (++this.fill === CAPTURE_BLOCK) {
        this.port.postMessage({ mic: this.mic, agent: this.agent }, [this.mic.buffer, this.agent.buffer]);
        this.mic = new Float32Array(CAPTURE_BLOCK);
        this.agent = new Float32Array(CAPTURE_BLOCK);
        this.fill = 0;
      }
    }
    return true;
  }
}

class PlaybackProcessor extends AudioWorkletProcessor {
  constructor() {
    super();
    this.reset();
    this.port.onmessage = (event) => {
      const msg = event.data;
      if (msg.type === "pcm") this.enqueue(msg.samples);
      else if (msg.type === "reset") this.reset();
    };
  }

  reset() {
    this.queue = [];
    this.offset = 0; // read position in queue[0]
    this.buffered = 0;
    this.playing = false;
    this.target = Math.round(0.12 * sampleRate); // start after 120 ms
    this.maxTarget = Math.round(0.4 * sampleRate);
    this.played = 0; // samples of agent audio sent to the speakers
    this.missed = 0; // samples of silence inserted because audio came late
    this.dropped = 0; // samples thrown away because the buffer was far behind
    this.sinceReport = 0;
  }

  enqueue(samples) {
    this.queue.push(samples);
    this.buffered += samples.length;
    // Far behind (a burst after a network stall): drop the oldest audio back to the target, so
    // the conversation does not stay delayed for the rest of the call.
    if (this.playing && this.buffered > this.target + Math.round(0.16 * sampleRate)) {
      let excess = this.buffered - this.target;
      while (excess > 0 && this.queue.length) {
        const head = this.queue[0];
        const n = Math.min(head.length - this.offset, excess);
        this.offset += n;
        excess -= n;
        this.buffered -= n;
        this.dropped += n;
        if (this.offset === head.length) {
          this.queue.shift();
          this.offset = 0;
        }
      }
    }
  }

  process(inputs, outputs) {
    const out = outputs[0][0];
    let i = 0;
    if (!this.playing && this.buffered >= this.target) this.playing = true;
    if (this.playing) {
      while (i < out.length && this.queue.length) {
        const head = this.queue[0];
        const n = Math.min(head.length - this.offset, out.length - i);
        out.set(head.subarray(this.offset, this.offset + n), i);
        i += n;
        this.offset += n;
        this.buffered -= n;
        if (this.offset === head.length) {
          this.queue.shift();
          this.offset = 0;
        }
      }
      this.played += i;
      if (i < out.length) {
        // Underrun: play silence, wait for more audio, and keep a bigger cushion from now on.
        this.missed += out.length - i;
        this.playing = false;
        this.target = Math.min(this.maxTarget, this.target + Math.round(0.02 * sampleRate));
      }
    }
    for (let k = i; k < out.length; k++) out[k] = 0;
    for (let c = 1; c < outputs[0].length; c++) outputs[0][c].set(out);
    this.sinceReport += out.length;
    if (this.sinceReport >= sampleRate / 10) {
      this.sinceReport = 0;
      this.port.postMessage({
        played: this.played,
        missed: this.missed,
        dropped: this.dropped,
        buffered: this.buffered,
        target: this.target,
        sampleRate,
      });
    }
    return true;
  }
}

registerProcessor("capture", CaptureProcessor);
registerProcessor("playback", PlaybackProcessor);
