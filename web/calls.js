// The calls page: the Twilio bridge's live calls (meters, live transcript) and past calls
// (transcript, actions, recording). Everything comes from /phone/calls* with the API key as a
// Bearer token; the key is kept for this tab only (sessionStorage) or given as #token=… .
const POLL_MS = 400;
const FLOOR_DB = -60;
const $ = (id) => document.getElementById(id);

// What a test (or the console) may read.
const state = { live: [], past: [], selected: null, transcript: "", audioReady: false, error: null, polls: 0 };
window.calls = state;

let key = "";
let selected = null; // { sid, live, transcriptFrom, actions }
let recordingUrl = null;

function takeKey() {
  const fromHash = new URLSearchParams(location.hash.slice(1)).get("token");
  if (fromHash) {
    sessionStorage.setItem("calls-key", fromHash);
    history.replaceState(null, "", location.pathname + location.search);
  }
  key = sessionStorage.getItem("calls-key") || "";
  $("key").value = key;
}

async function api(path) {
  const response = await fetch(path, { headers: { Authorization: `Bearer ${key}` } });
  if (response.status === 401) throw new Error("The API key was not accepted.");
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response;
}

function showError(message) {
  state.error = message;
  $("error").textContent = message || "";
  $("error").hidden = !message;
}

function fraction(db) {
  return Math.min(1, Math.max(0, (db - FLOOR_DB) / -FLOOR_DB));
}

function meter(kind, db) {
  const outer = document.createElement("div");
  outer.className = `meter ${kind}`;
  outer.setAttribute("role", "meter");
  outer.setAttribute("aria-valuemin", "0");
  outer.setAttribute("aria-valuemax", "1");
  outer.setAttribute("aria-valuenow", fraction(db).toFixed(2));
  const bar = document.createElement("div");
  bar.className = "bar";
  bar.style.width = `${(100 * fraction(db)).toFixed(1)}%`;
  outer.append(bar);
  return outer;
}

function cell(row, content) {
  const td = document.createElement("td");
  if (content instanceof Node) td.append(content);
  else td.textContent = content ?? "";
  row.append(td);
  return td;
}

function seconds(value) {
  if (value === null || value === undefined) return "–";
  const s = Math.round(Number(value));
  return `${Math.floor(s / 60)}:${String(s % 60).padStart(2, "0")}`;
}

function renderLive(live) {
  const body = $("live").tBodies[0];
  body.replaceChildren();
  for (const call of live) {
    const row = document.createElement("tr");
    row.dataset.sid = call.call_sid;
    row.classList.toggle("selected", selected?.sid === call.call_sid);
    cell(row, call.carrier);
    cell(row, call.persona);
    cell(row, call.from);
    cell(row, seconds(call.duration_s));
    cell(row, meter("caller", call.caller_level_db));
    cell(row, meter("agent", call.agent_level_db));
    cell(row, String(call.transcript_pieces));
    const slips = cell(row, slipsText(call.dropped_ms, call.inserted_ms));
    slips.classList.toggle("slips", (call.dropped_ms || 0) + (call.inserted_ms || 0) > 0);
    row.addEventListener("click", () => select(call.call_sid, true));
    body.append(row);
  }
  $("no-live").hidden = live.length > 0;
}

// Audio a call lost (or had silence put in) to keep the frame clock: "–" for a clean line.
function slipsText(dropped, inserted) {
  const parts = [];
  if (dropped > 0) parts.push(`lost ${Math.round(dropped)} ms`);
  if (inserted > 0) parts.push(`+${Math.round(inserted)} ms silence`);
  return parts.join(", ") || "–";
}

function slipDetail(amounts) {
  const entries = Object.entries(amounts || {}).filter(([, ms]) => ms > 0);
  return entries.map(([reason, ms]) => `${reason} ${Math.round(ms)} ms`).join(", ") || "none";
}

function renderPast(past) {
  const body = $("past").tBodies[0];
  body.replaceChildren();
  for (const call of past) {
    const row = document.createElement("tr");
    row.dataset.sid = call.call_sid;
    row.classList.toggle("selected", selected?.sid === call.call_sid);
    const started = call.started_at ? new Date(call.started_at * 1000).toLocaleString() : "–";
    cell(row, started);
    cell(row, call.carrier);
    cell(row, call.persona);
    cell(row, call.from);
    cell(row, seconds(call.recording_s ?? call.metrics?.duration_s));
    cell(row, (call.interrupted ? "(server stopped) " : "") + (call.end_reason || ""));
    cell(row, String((call.actions || []).length));
    cell(row, call.recording ? "yes" : "");
    row.addEventListener("click", () => select(call.call_sid, false));
    body.append(row);
  }
}

let polling = false;

async function poll() {
  if (!key || polling) return; // one poll at a time: a slow one is not overtaken
  polling = true;
  try {
    const listing = await (await api("/phone/calls?live_metrics=0")).json();
    const liveSids = new Set(listing.live.map((c) => c.call_sid));
    state.live = listing.live;
    state.past = [...listing.calls.slice().reverse(), ...listing.earlier_calls].filter(
      (c) => !liveSids.has(c.call_sid) && c.started_at,
    );
    $("capacity").textContent = `(${listing.active_sessions} of ${listing.capacity} slots in use)`;
    renderLive(state.live);
    renderPast(state.past);
    if (selected) await refreshSelected(liveSids.has(selected.sid));
    state.polls += 1;
    $("status").textContent = `Updated ${new Date().toLocaleTimeString()}.`;
    showError(null);
  } catch (error) {
    showError(error.message);
  } finally {
    polling = false;
  }
}

async function select(sid, live) {
  selected = { sid, live, transcriptFrom: 0 };
  state.selected = sid;
  state.transcript = "";
  state.audioReady = false;
  $("transcript").textContent = "";
  $("player-row").hidden = true;
  // The last call's recording may still be loading: its canplay must not count for this one.
  const player = $("player");
  player.oncanplay = null;
  player.removeAttribute("src");
  player.load();
  if (recordingUrl) URL.revokeObjectURL(recordingUrl);
  recordingUrl = null;
  $("detail").hidden = false;
  poll();
}

async function refreshSelected(live) {
  const current = selected;
  const record = await (await api(`/phone/calls/${current.sid}?since=${current.transcriptFrom}`)).json();
  if (selected !== current) return;
  const via = record.carrier ? ` (${record.carrier})` : "";
  $("detail-title").textContent = `${live ? "Live call" : "Call"} ${record.call_sid}${via}`;
  const facts = $("detail-facts");
  facts.replaceChildren();
  const rows = [
    ["Persona", record.persona],
    ["From → to", `${record.from || "?"} → ${record.to || "?"}`],
    ["Variables", Object.entries(record.variables || {}).map(([k, v]) => `${k}: ${v}`).join(", ") || "–"],
    ["Ended because", live ? "(live)" : record.end_reason],
  ];
  if (record.webhook) rows.push(["Webhook", record.webhook.delivered ? `delivered (${record.webhook.attempts})` : `failed: ${record.webhook.error}`]);
  if (record.metrics?.dropped_ms) {
    rows.push(["Audio lost to keep the clock", slipDetail(record.metrics.dropped_ms)]);
    rows.push(["Silence put in", slipDetail(record.metrics.inserted_ms)]);
  }
  for (const [name, value] of rows) {
    const dt = document.createElement("dt");
    dt.textContent = name;
    const dd = document.createElement("dd");
    dd.textContent = value ?? "";
    facts.append(dt, dd);
  }
  $("detail-prompt").textContent = record.prompt || "";
  const pieces = record.transcript.map((p) => p.text).join("");
  state.transcript += pieces;
  current.transcriptFrom = (record.transcript_from || 0) + record.transcript.length;
  $("transcript").textContent = state.transcript;
  $("transcript").scrollTop = $("transcript").scrollHeight;
  const actions = $("actions");
  actions.replaceChildren();
  for (const action of record.actions || []) {
    const li = document.createElement("li");
    li.textContent = `${action.t.toFixed(1)} s: ${action.what} on ${action.trigger}${action.ok ? "" : " (refused)"}`;
    actions.append(li);
  }
  if (!actions.children.length) actions.append(Object.assign(document.createElement("li"), { textContent: "none" }));
  current.live = live;
  if (!live && record.recording && !current.recordingRequested) await loadRecording(current);
}

async function loadRecording(current) {
  // Once per selection: two polls overlapping here would each set a new source, and the
  // player would be reloading (no duration yet) after the first one said it was ready.
  current.recordingRequested = true;
  let blob;
  try {
    blob = await (await api(`/phone/calls/${current.sid}/recording`)).blob();
  } catch (error) {
    current.recordingRequested = false; // the next poll tries again
    throw error;
  }
  if (selected !== current) return;
  const url = URL.createObjectURL(blob);
  recordingUrl = url;
  const player = $("player");
  player.oncanplay = () => {
    const stillShown = selected === current && player.src === url;
    if (stillShown && Number.isFinite(player.duration)) state.audioReady = true;
  };
  player.src = url;
  $("player-row").hidden = false;
}

$("use-key").addEventListener("click", () => {
  key = $("key").value.trim();
  sessionStorage.setItem("calls-key", key);
  poll();
});

takeKey();
poll();
setInterval(poll, POLL_MS);
