// The page: prompt and voice choice, one conversation over /api/chat (WebSocket, the default) or
// WebRTC (WHIP), transcript, stats, recording.
import { Kind, chatUrl, decodeMessage, encodeAudio } from "./protocol.js";
import { OggOpusDecoder, OggOpusEncoder, Resampler, WIRE_RATE, webCodecsAvailable } from "./opus.js";
import { ConversationRecorder } from "./recorder.js";
import { LevelMeter } from "./levels.js";
import { WebRtcCall } from "./webrtc.js";

// The reference client's prompt examples (assistant, customer service, casual, astronaut).
const PRESETS = [
  {
    label: "Assistant",
    text: "You are a wise and friendly teacher. Answer questions or provide advice in a clear and engaging way.",
  },
  {
    label: "Customer service",
    text: "You work for CitySan Services which is a waste management and your name is Ayelen Lucero. Information: Verify customer name Omar Torres. Current schedule: every other week. Upcoming pickup: April 12th. Compost bin service available for $8/month add-on.",
  },
  {
    label: "Casual",
    text: "You enjoy having a good conversation. Have a casual discussion about eating at home versus dining out.",
  },
  {
    label: "Astronaut",
    text: "You enjoy having a good conversation. Have a technical discussion about fixing a reactor core on a spaceship to Mars. You are an astronaut on a Mars mission. Your name is Alex. You are already dealing with a reactor core meltdown on a Mars mission. Several ship systems are failing, and continued instability will lead to catastrophic failure. You explain what is happening and you urgently ask for help thinking through how to stabilize the reactor.",
  },
];

const $ = (id) => document.getElementById(id);
const pageParams = new URLSearchParams(location.search);

// Everything a test (or a curious user in the console) may want to read.
const state = {
  phase: "idle", // idle | connecting | queued | preparing | live | ended
  transport: "websocket", // of the current (or last) call: websocket | webrtc
  // WebRTC calls add rttMs, lossPct, jitterMs, jitterBufferMs, concealedMs (from getStats).
  stats: { played: 0, missed: 0, dropped: 0, buffered: 0, sampleRate: 0, sentBytes: 0, receivedBytes: 0 },
  transcript: "",
  metadata: null,
  error: null,
  micSamplesSent: 0,
  levels: { caller: 0, agent: 0 }, // the meters, 0..1
  levelPeaks: { caller: 0, agent: 0 }, // the loudest each meter showed in this call
};
window.personaplex = state;

const meters = { caller: new LevelMeter($("meter-caller")), agent: new LevelMeter($("meter-agent")) };

function showLevels(mic, agent) {
  for (const [name, samples] of [["caller", mic], ["agent", agent]]) {
    state.levels[name] = meters[name].update(samples);
    state.levelPeaks[name] = Math.max(state.levelPeaks[name], state.levels[name]);
  }
}

// Prompts whose URL form would be longer than this go by POST /api/prompts (a request line is
// capped by the server and by proxies; see docs/server.md), named in the URL by `prompt_id`.
const MAX_PROMPT_IN_URL = 2000;

async function promptParams(text) {
  if (encodeURIComponent(text).length <= MAX_PROMPT_IN_URL) return { text_prompt: text };
  const url = new URL("/api/prompts", location.href);
  for (const [k, v] of Object.entries(tokenParams())) url.searchParams.set(k, v);
  const response = await fetch(url, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ text_prompt: text }),
  });
  const body = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error(body.detail || `the server answered ${response.status}`);
  return { prompt_id: body.prompt_id };
}

let call = null; // the live conversation's resources

function setStatus(text, phase) {
  if (phase) state.phase = phase;
  $("status").textContent = text;
}

function showError(text) {
  state.error = text;
  $("error").textContent = text;
  $("error").hidden = !text;
}

function setupPresets() {
  const prompt = $("prompt");
  const buttons = PRESETS.map((preset) => {
    const button = document.createElement("button");
    button.type = "button";
    button.textContent = preset.label;
    button.addEventListener("click", () => {
      prompt.value = preset.text;
      buttons.forEach((b) => b.setAttribute("aria-pressed", String(b === button)));
    });
    $("presets").append(button);
    return button;
  });
  prompt.value = PRESETS[0].text;
  buttons[0].setAttribute("aria-pressed", "true");
}

function tokenParams() {
  const token = $("token").value.trim();
  return token ? { token } : {};
}

async function loadVoices() {
  const url = new URL("/api/voices", location.href);
  for (const [k, v] of Object.entries(tokenParams())) url.searchParams.set(k, v);
  try {
    const response = await fetch(url);
    if (response.status === 401) {
      showError("The server needs an API key: enter it under Advanced (the voice list then reloads).");
      return;
    }
    if (!response.ok) return; // still loading: the default voice works
    if (state.error && state.error.includes("API key")) showError("");
    const { voices } = await response.json();
    const select = $("voice");
    const current = select.value;
    select.replaceChildren(new Option("(server default)", ""));
    for (const voice of voices) select.append(new Option(`${voice.name} (${voice.kind})`, voice.name));
    if ([...select.options].some((o) => o.value === current)) select.value = current;
  } catch (e) {
    console.warn("voice list unavailable", e);
  }
}

async function openAudio(transport) {
  let ctx;
  try {
    ctx = new AudioContext({ sampleRate: WIRE_RATE, latencyHint: "interactive" });
  } catch {
    ctx = new AudioContext({ latencyHint: "interactive" }); // this browser resamples in JS then
  }
  await ctx.resume();
  await ctx.audioWorklet.addModule("worklets.js");
  const stream = await navigator.mediaDevices.getUserMedia({
    audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
  });
  const mic = ctx.createMediaStreamSource(stream);
  const capture = new AudioWorkletNode(ctx, "capture", { numberOfInputs: 2, numberOfOutputs: 1 });
  mic.connect(capture, 0, 0);
  capture.connect(ctx.destination); // silent; keeps the capture node running
  let playback = null;
  if (transport === "websocket") {
    // Our own jitter buffer plays the decoded Ogg-Opus; WebRTC has the browser's (NetEq).
    playback = new AudioWorkletNode(ctx, "playback", { numberOfInputs: 0, outputChannelCount: [1] });
    playback.connect(capture, 0, 1);
    playback.connect(ctx.destination);
  }
  return { ctx, stream, mic, playback, capture, player: null };
}

// WebRTC: the agent's track plays through an <audio> element (so the browser's echo canceller
// knows it) and feeds the capture node (meter, recording).
function playRemote(audio, stream) {
  const player = new Audio();
  player.autoplay = true;
  player.srcObject = stream;
  player.play().catch((e) => console.warn("agent audio did not start", e));
  audio.player = player;
  audio.ctx.createMediaStreamSource(stream).connect(audio.capture, 0, 1);
}

function closeAudio(audio) {
  if (!audio) return;
  if (audio.player) audio.player.srcObject = null;
  audio.stream.getTracks().forEach((t) => t.stop());
  audio.ctx.close();
}

async function connect() {
  showError("");
  const transport = $("transport").value;
  if (transport === "websocket" && !webCodecsAvailable()) {
    showError("This browser has no WebCodecs Opus support. Use a recent Chrome, Edge or Safari.");
    return;
  }
  if (transport === "webrtc" && typeof RTCPeerConnection === "undefined") {
    showError("This browser has no WebRTC. Choose the WebSocket transport.");
    return;
  }
  if (!window.isSecureContext) {
    showError("The microphone needs https (or localhost). Start the server with --ssl DIR.");
    return;
  }
  $("transcript").textContent = "";
  state.transcript = "";
  state.micSamplesSent = 0;
  state.levelPeaks = { caller: 0, agent: 0 };
  state.transport = transport;
  state.stats = { played: 0, missed: 0, dropped: 0, buffered: 0, sampleRate: 0, sentBytes: 0, receivedBytes: 0 };
  setStatus("Opening the microphone…", "connecting");
  $("connect").disabled = true;
  $("transport").disabled = true;

  let audio;
  try {
    audio = await openAudio(transport);
  } catch (e) {
    endSetup();
    showError(`Could not open the microphone: ${e.message || e}`);
    return;
  }

  let prompt;
  try {
    prompt = await promptParams($("prompt").value);
  } catch (e) {
    closeAudio(audio);
    endSetup();
    showError(`The server did not take the prompt: ${e.message || e}`);
    return;
  }
  const params = {
    ...prompt,
    voice_prompt: $("voice").value,
    seed: $("seed").value,
    text_temperature: $("text-temperature").value,
    audio_temperature: $("audio-temperature").value,
    ...tokenParams(),
  };
  const recorder = new ConversationRecorder(audio.ctx.sampleRate);
  state.stats.sampleRate = audio.ctx.sampleRate;
  if (transport === "webrtc") await connectWebRtc(params, audio, recorder);
  else connectWebSocket(params, audio, recorder);
}

function endSetup() {
  $("connect").disabled = false;
  $("transport").disabled = false;
  setStatus("Not connected.", "idle");
}

// The messages both transports carry (WebRTC: on its data channel), audio aside.
function onServerMessage(msg) {
  if (!call) return;
  switch (msg.kind) {
    case Kind.METADATA:
      onMetadata(msg.data);
      break;
    case Kind.HANDSHAKE:
      call.live = true;
      if (call.audio.playback) call.audio.playback.port.postMessage({ type: "reset" });
      $("record").disabled = false;
      $("connect").disabled = false;
      $("connect").textContent = "Disconnect";
      setStatus("Live: speak now.", "live");
      break;
    case Kind.TEXT:
      state.transcript += msg.text;
      $("transcript").textContent = state.transcript;
      $("transcript").scrollTop = $("transcript").scrollHeight;
      break;
    case Kind.ERROR:
      call.serverError = msg.text;
      showError(`Server: ${msg.text}`);
      break;
    default:
      break; // ping, control and unknown kinds are ignored
  }
}

function connectWebSocket(params, audio, recorder) {
  const ws = new WebSocket(chatUrl(params));
  ws.binaryType = "arraybuffer";
  const toWire = new Resampler(audio.ctx.sampleRate, WIRE_RATE);
  const onCodecError = (text) => {
    showError(text);
    ws.close();
  };
  const encoder = new OggOpusEncoder((pages) => send(pages), onCodecError);
  const decoder = new OggOpusDecoder(
    audio.ctx.sampleRate,
    (pcm) => audio.playback.port.postMessage({ type: "pcm", samples: pcm }, [pcm.buffer]),
    onCodecError,
  );
  call = { transport: "websocket", ws, audio, encoder, decoder, recorder, live: false, opened: false, serverError: null };

  function send(pages) {
    if (ws.readyState !== WebSocket.OPEN) return;
    const message = encodeAudio(pages);
    state.stats.sentBytes += message.length;
    ws.send(message);
  }

  audio.capture.port.onmessage = ({ data }) => {
    recorder.add(data.agent, data.mic);
    showLevels(data.mic, data.agent);
    if (!call || !call.live) return; // like the reference client: audio flows after the handshake
    const pcm = toWire.process(data.mic);
    state.micSamplesSent += pcm.length;
    encoder.encode(pcm);
  };
  audio.playback.port.onmessage = ({ data }) => {
    Object.assign(state.stats, data);
    renderStats();
  };

  ws.onopen = () => {
    call.opened = true;
    setStatus("Connected; preparing the persona…", "preparing");
    measureNetwork();
  };
  ws.onmessage = (event) => {
    state.stats.receivedBytes += event.data.byteLength;
    const msg = decodeMessage(event.data);
    if (!msg) return;
    if (msg.kind === Kind.AUDIO) decoder.push(msg.payload);
    else onServerMessage(msg);
  };
  ws.onclose = (event) => {
    if (call && !call.opened) {
      // A browser shows a refused upgrade (an HTTP 4xx/5xx) only as a close: ask the server why.
      showRefusal(ws.url);
    } else if (call && !call.serverError && event.code !== 1000 && event.code !== 1005) {
      showError(`The connection closed (code ${event.code}${event.reason ? `: ${event.reason}` : ""}).`);
    }
    hangUp(call && call.serverError ? "Ended by the server." : "Call ended.");
  };
}

async function connectWebRtc(params, audio, recorder) {
  const rtc = new WebRtcCall(params, audio.stream, {
    onMessage: onServerMessage,
    onTrack: (stream) => playRemote(audio, stream),
    onClose: (reason) => {
      if (reason && call && !call.serverError) showError(reason);
      hangUp(call && call.serverError ? "Ended by the server." : "Call ended.");
    },
  });
  call = { transport: "webrtc", rtc, audio, recorder, live: false, opened: false, serverError: null };
  audio.capture.port.onmessage = ({ data }) => {
    recorder.add(data.agent, data.mic);
    showLevels(data.mic, data.agent);
  };
  call.statsTimer = setInterval(() => readWebRtcStats(rtc), 1000);
  try {
    setStatus("Connecting (WebRTC)…", "connecting");
    await rtc.start();
  } catch (e) {
    showError(`Server: ${e.message || e}`);
    hangUp("Not connected.");
    return;
  }
  if (!call || call.rtc !== rtc) return; // hung up meanwhile
  call.opened = true;
  setStatus("Connected; preparing the persona…", "preparing");
}

async function readWebRtcStats(rtc) {
  const s = await rtc.readStats().catch(() => null);
  if (!s || !call || call.rtc !== rtc) return;
  const rate = state.stats.sampleRate;
  Object.assign(state.stats, {
    rttMs: s.rttMs,
    lossPct: s.lossPct,
    jitterMs: s.jitterMs,
    jitterBufferMs: s.jitterBufferMs,
    jitterBufferTargetMs: s.jitterBufferTargetMs,
    concealedMs: s.concealedMs,
    sentBytes: s.bytesSent || 0,
    receivedBytes: s.bytesReceived || 0,
    played: Math.round((s.playedSeconds || 0) * rate),
  });
  renderStats();
}

async function showRefusal(wsUrl) {
  // GET on the same URL answers what the upgrade was refused for (426 when nothing would be).
  const url = new URL(wsUrl);
  url.protocol = url.protocol === "wss:" ? "https:" : "http:";
  let reason = "";
  try {
    const response = await fetch(url, { cache: "no-store" });
    if (response.status !== 426) reason = (await response.text()).trim();
  } catch (e) {
    reason = "";
  }
  showError(
    reason
      ? `Server: ${reason}`
      : "The server refused the connection before it opened (it is down or unreachable): see its log.",
  );
}

function onMetadata(data) {
  if (!data) return;
  state.metadata = data;
  $("stat-session").textContent = `${data.session_id} · ${data.model} · voice ${data.voice}`;
  const seed = data.seed === -1 ? "random seed" : `seed ${data.seed}`;
  $("stat-sampling").textContent = data.greedy
    ? `greedy · ${seed}`
    : `text ${data.text_temperature} / top ${data.text_topk} · audio ${data.audio_temperature} / top ${data.audio_topk} · ${seed}`;
  if (data.instance_name) {
    const build = data.build_info ? ` · ${data.build_info.git_describe}` : "";
    $("stat-server").textContent = `${data.instance_name}${build} · ${data.max_sessions} line(s)`;
  }
  if (data.queue_position > 0) {
    const ahead = data.queue_position - 1;
    const who = ahead === 0 ? "you are next" : `${ahead} caller${ahead === 1 ? "" : "s"} ahead of you`;
    setStatus(`All ${data.max_sessions} line(s) are busy: waiting for a free slot (${who}).`, "queued");
  } else if (state.phase !== "live") {
    setStatus("Connected; preparing the persona…", "preparing");
  }
}

function hangUp(message) {
  if (!call) return;
  const ending = call;
  call = null;
  if (ending.recorder.active) stopRecording(ending.recorder);
  if (ending.transport === "webrtc") {
    clearInterval(ending.statsTimer);
    ending.rtc.hangUp();
  } else {
    ending.encoder.close();
    ending.decoder.close();
    if (ending.ws.readyState <= WebSocket.OPEN) ending.ws.close(1000);
  }
  closeAudio(ending.audio);
  meters.caller.reset();
  meters.agent.reset();
  state.levels = { caller: 0, agent: 0 };
  $("connect").disabled = false;
  $("connect").textContent = "Connect";
  $("transport").disabled = false;
  $("record").disabled = true;
  setStatus(message, "ended");
}

function toggleRecording() {
  if (!call) return;
  if (call.recorder.active) stopRecording(call.recorder);
  else {
    call.recorder.start();
    $("record").textContent = "Stop recording";
    $("record").classList.add("recording");
    $("download").hidden = true;
  }
}

function stopRecording(recorder) {
  const blob = recorder.stop();
  const link = $("download");
  if (link.href) URL.revokeObjectURL(link.href);
  link.href = URL.createObjectURL(blob);
  link.textContent = `Download recording (${recorder.seconds.toFixed(1)} s, agent left / you right)`;
  link.hidden = false;
  $("record").textContent = "Record";
  $("record").classList.remove("recording");
}

function ms(samples, rate) {
  return rate ? `${Math.round((1000 * samples) / rate)} ms` : "–";
}

// Round trip, mouth to ear: one 20 ms Opus packet to fill, the network both ways, one 80 ms model
// frame, and what waits in the playback buffer.
const ENCODE_MS = 20;
const MODEL_FRAME_MS = 80;

async function measureNetwork() {
  if (!call || call.transport !== "websocket") return; // WebRTC measures its own round trip
  const started = performance.now();
  try {
    await fetch("/healthz", { cache: "no-store" });
    const rtt = performance.now() - started;
    state.stats.networkMs = state.stats.networkMs ? 0.7 * state.stats.networkMs + 0.3 * rtt : rtt;
  } catch {
    /* the next try will tell */
  }
}
setInterval(measureNetwork, 2000);

function renderStats() {
  if (state.transport === "webrtc") {
    renderWebRtcStats();
    return;
  }
  const s = state.stats;
  const rate = s.sampleRate;
  const bufferMs = rate ? (1000 * s.buffered) / rate : 0;
  state.stats.latencyMs = Math.round(ENCODE_MS + (s.networkMs || 0) + MODEL_FRAME_MS + bufferMs);
  $("stat-latency").textContent = call && call.live ? `${state.stats.latencyMs} ms` : "–";
  $("stat-latency").title = `Opus ${ENCODE_MS} ms + network ${Math.round(s.networkMs || 0)} ms + model frame ${MODEL_FRAME_MS} ms + playback buffer ${Math.round(bufferMs)} ms`;
  $("stat-network").textContent = `round trip ${Math.round(s.networkMs || 0)} ms (HTTP); TCP retransmits lost packets`;
  $("stat-buffer").textContent = `${ms(s.buffered, rate)} (target ${ms(s.target, rate)})`;
  $("stat-missed").textContent = ms(s.missed, rate);
  $("stat-dropped").textContent = ms(s.dropped, rate);
  $("stat-played").textContent = rate ? `${(s.played / rate).toFixed(1)} s` : "–";
  $("stat-bytes").textContent = `${(s.sentBytes / 1024).toFixed(0)} KiB / ${(s.receivedBytes / 1024).toFixed(0)} KiB`;
}

// WebRTC: the same rows from getStats(): the browser's jitter buffer (NetEq) is the playback buffer,
// its concealment the missed audio, its time-stretching the dropped (or added) audio.
function renderWebRtcStats() {
  const s = state.stats;
  const rtt = s.rttMs || 0;
  const buffer = s.jitterBufferMs || 0;
  state.stats.latencyMs = Math.round(ENCODE_MS + rtt + MODEL_FRAME_MS + buffer);
  $("stat-latency").textContent = call && call.live ? `${state.stats.latencyMs} ms` : "–";
  $("stat-latency").title = `Opus ${ENCODE_MS} ms + network ${Math.round(rtt)} ms + model frame ${MODEL_FRAME_MS} ms + jitter buffer ${Math.round(buffer)} ms`;
  $("stat-network").textContent = `RTT ${Math.round(rtt)} ms · loss ${(s.lossPct || 0).toFixed(1)} % · jitter ${Math.round(s.jitterMs || 0)} ms`;
  const target = s.jitterBufferTargetMs !== undefined ? ` (target ${Math.round(s.jitterBufferTargetMs)} ms)` : "";
  $("stat-buffer").textContent = `${Math.round(buffer)} ms jitter buffer${target}`;
  $("stat-missed").textContent = `${Math.round(s.concealedMs || 0)} ms concealed`;
  $("stat-dropped").textContent = "–";
  const rate = s.sampleRate;
  $("stat-played").textContent = rate ? `${(s.played / rate).toFixed(1)} s` : "–";
  $("stat-bytes").textContent = `${(s.sentBytes / 1024).toFixed(0)} KiB / ${(s.receivedBytes / 1024).toFixed(0)} KiB`;
}

function init() {
  setupPresets();
  if (pageParams.get("token")) $("token").value = pageParams.get("token");
  if (pageParams.get("prompt")) $("prompt").value = pageParams.get("prompt");
  if (pageParams.get("transport") === "webrtc") $("transport").value = "webrtc";
  $("connect").addEventListener("click", () => {
    if (call) hangUp("Call ended.");
    else connect();
  });
  $("record").addEventListener("click", toggleRecording);
  $("token").addEventListener("change", loadVoices);
  loadVoices();
}

init();
