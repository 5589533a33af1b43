// Level meters: the loudness of a block of samples as 0..1 (-60 dBFS..0 dBFS), with a fast rise
// and a slow fall so speech reads as a steady bar rather than a flicker.
const FLOOR_DB = -60;
const RELEASE_PER_BLOCK = 0.08; // how much a meter may fall per block (~40 ms)

export function blockLevel(samples) {
  let sum = 0;
  for (let i = 0; i < samples.length; i++) sum += samples[i] * samples[i];
  const rms = Math.sqrt(sum / Math.max(1, samples.length));
  const db = 20 * Math.log10(rms + 1e-9);
  return Math.min(1, Math.max(0, (db - FLOOR_DB) / -FLOOR_DB));
}

export class LevelMeter {
  constructor(element) {
    this.element = element;
    this.bar = element.querySelector(".bar");
    this.value = 0;
  }

  update(samples) {
    const level = blockLevel(samples);
    this.value = level > this.value ? level : Math.max(level, this.value - RELEASE_PER_BLOCK);
    this.render();
    return this.value;
  }

  reset() {
    this.value = 0;
    this.render();
  }

  render() {
    this.bar.style.width = `${(100 * this.value).toFixed(1)}%`;
    this.element.setAttribute("aria-valuenow", this.value.toFixed(2));
  }
}
