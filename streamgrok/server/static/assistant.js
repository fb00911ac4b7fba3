// streamgrok browser assistant: camera frames (JPEG) and microphone (PCM16 at the device's rate) over the
// websocket protocol v1 (docs/PROTOCOL.md); questions and streamed answers; live KV panel.
"use strict";

const KIND = { frame: 1, chunk: 2, audio: 3 };
const $ = (id) => document.getElementById(id);
const token = new URLSearchParams(location.search).get("token");
const wsUrl = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/ws` +
  (token ? `?token=${encodeURIComponent(token)}` : "");
let ws, started = false, t0 = performance.now(), queryCount = 0, frameTimer = null;
let audioRate = 0; // the microphone's sample rate once audio runs (told to the server)
let camera = null, muted = false, retries = 0, clockTimer = null, sessions = 0;
let resumeHandle = null; // the session's resume handle: a reconnect carries on with it
const outbox = []; // questions typed while disconnected: sent once a session is back

function streamTime() { return (performance.now() - t0) / 1000; }

function media(kind, payload) {
  const header = new DataView(new ArrayBuffer(11));
  header.setUint8(0, kind);
  header.setUint16(1, 0, true);
  header.setFloat64(3, streamTime(), true);
  const message = new Uint8Array(11 + payload.byteLength);
  message.set(new Uint8Array(header.buffer), 0);
  message.set(new Uint8Array(payload), 11);
  if (ws && ws.readyState === WebSocket.OPEN && ws.bufferedAmount < 4e6) ws.send(message);
}

function connect() {
  ws = new WebSocket(wsUrl);
  ws.binaryType = "arraybuffer";
  ws.onopen = () => {
    retries = 0;
    $("status").textContent = "connected";
    if (audioRate) ws.send(JSON.stringify({ type: "audio.format", rate: audioRate }));
    // a dropped connection: resume the same session (a new one if it has ended meanwhile)
    ws.send(JSON.stringify(resumeHandle
      ? { type: "session.resume", id: "resume", handle: resumeHandle, or_start: true }
      : { type: "session.start", id: "start" }));
  };
  ws.onclose = () => {
    started = false;
    const wait = Math.min(10, 2 ** retries++);
    $("status").textContent = `disconnected · reconnecting in ${wait} s` +
      (outbox.length ? ` · ${outbox.length} question(s) waiting` : "");
    $("status").className = "down";
    setTimeout(connect, wait * 1000);
  };
  ws.onmessage = (msg) => handle(JSON.parse(msg.data));
}

function sendQuestion(id, text) {
  ws.send(JSON.stringify({ type: "query", id, text }));
}

function sessionUp(m) {
  started = true;
  resumeHandle = m.resume ? m.resume.handle : null;
  $("status").className = "";
  $("status").textContent = `session ${m.session_id} · ${m.pipeline} · ${m.model} · ` +
    visionLabel(m.vision);
  while (outbox.length) {
    const [id, text] = outbox.shift();
    answerBox(id).querySelector(".n").textContent = "";
    sendQuestion(id, text);
  }
}

function handle(m) {
  switch (m.type) {
    case "session.started":
      if (sessions++) addEvent("reconnected: a new session (what the old one saw is gone)", "info");
      sessionUp(m);
      break;
    case "session.resumed":
      addEvent(`reconnected: resumed after ${m.gap.seconds.toFixed(1)} s, the same session ` +
        `(media of those seconds never reached it)`, "info");
      sessionUp(m);
      break;
    case "session.going_away":
      addEvent(`the server is shutting down (answers may finish within ${m.seconds} s)`, "info");
      break;
    case "response.delta": {
      const box = answerBox(m.query_id);
      delete box.dataset.thinking;
      box.querySelector(".a").textContent += m.delta;
      follow();
      break;
    }
    case "response.done": {
      const box = answerBox(m.query_id);
      delete box.dataset.thinking;
      box.querySelector(".a").textContent = m.text;
      box.querySelector(".m").textContent =
        `${m.tokens} tokens · first token ${m.ttft_ms} ms · ${m.tbt_ms_mean} ms/token · ${m.finish_reason}`;
      box.dataset.done = "1";
      follow();
      break;
    }
    case "event": addEvent(`[${fmt(m.t)}] ${m.kind}: ${m.text}`, m.kind); break;
    case "error":
      if (m.code === "busy" && m.retry_after_ms && !started && ws.readyState === WebSocket.OPEN) {
        // the server is at its load: ask to start again when it suggests
        $("status").textContent = `server busy · trying again in ${(m.retry_after_ms / 1000).toFixed(0)} s`;
        setTimeout(() => { if (!started && ws.readyState === WebSocket.OPEN)
          ws.send(JSON.stringify({ type: "session.start", id: "start" })); }, m.retry_after_ms);
      }
      addEvent(`error ${m.code}: ${m.message}`, "error"); break;
    case "stats": if (m.resume) resumeHandle = m.resume.handle; showStats(m); break;
  }
}

function visionLabel(v) {
  if (!v || v.kind === "notes") return "sees: notes only (no frame tokens)";
  if (v.kind === "vlm") return `sees: frames (${v.family} vision tower, ${v.tokens_per_frame} tokens/frame)`;
  return `sees: frames (CLIP + projector, ${v.tokens_per_frame} tokens/frame)`;
}

function follow() { // keep the newest answer in view
  const list = $("answers");
  list.scrollTop = list.scrollHeight;
}

function fmt(t) {
  if (t === null || t === undefined) return "--:--";
  const s = Math.floor(t); return `${String(Math.floor(s / 60)).padStart(2, "0")}:${String(s % 60).padStart(2, "0")}`;
}

function answerBox(id) {
  let box = document.querySelector(`.qa[data-id="${CSS.escape(String(id))}"]`);
  if (!box) {
    box = document.createElement("div");
    box.className = "qa"; box.dataset.id = id;
    box.innerHTML = '<div class="q"></div><div class="n"></div><div class="a"></div>' +
      '<div class="m"></div>';
    box.querySelector(".q").textContent = `(${id})`;
    $("answers").appendChild(box);
  }
  return box;
}

function addEvent(text, kind) {
  const li = document.createElement("li");
  li.textContent = text; li.className = kind;
  $("events").prepend(li);
  while ($("events").children.length > 200) $("events").lastChild.remove();
}

const DROP_NAMES = {frames_duplicate: "duplicate", frames_queue: "queue full",
  frames_stale: "stale", frames_full: "engine queue full", rate_limited: "rate-limited",
  notes_superseded: "notes superseded", outbound: "messages"};

function dropsText(s) {
  const parts = Object.entries(DROP_NAMES)
    .filter(([key]) => s.drops[key])
    .map(([key, name]) => `${name} ${s.drops[key]}`);
  const load = s.load && s.load.degraded
    ? ` · degraded to ${s.load.fps.toFixed(2)} fps (${s.load.reason})` : "";
  return `dropped: ${s.drops.frames} frames` + (parts.length ? ` (${parts.join(", ")})` : "") +
    `, ${s.drops.outbound} messages` + load;
}

function showStats(s) {
  const kv = s.kv;
  $("kv").textContent = `${kv.pages_used} / ${kv.pages_total} pages · evicted ${s.evicted_tokens} tokens` +
    ` · step p50 ${Math.round(s.latency.step_ms_p50 || 0)} ms`;
  $("drops").textContent = dropsText(s);
  const layers = $("layers").getContext("2d"), W = 300, H = 60;
  layers.clearRect(0, 0, W, H);
  const n = kv.layer_tokens.length, bw = W / Math.max(1, n);
  kv.layer_tokens.forEach((tokens, i) => {
    const budget = kv.layer_budget[i] || Math.max(...kv.layer_tokens, 1);
    const h = Math.min(1, tokens / budget) * (H - 2);
    layers.fillStyle = "#3a63d8"; layers.fillRect(i * bw + 1, H - h, bw - 2, h);
  });
  const tl = $("timeline").getContext("2d"); tl.clearRect(0, 0, W, 40);
  const end = Math.max(s.stream_time, 1);
  for (const r of s.retained) {
    tl.fillStyle = r.modality === "frame" ? "#3a63d8" : r.modality === "audio" ? "#1e8e3e" : "#e37400";
    tl.fillRect((r.t / end) * (W - 3), r.modality === "frame" ? 4 : 22, 3, 14);
  }
}

async function startMedia() {
  const stream = await navigator.mediaDevices.getUserMedia({ video: { width: 640 }, audio: true });
  camera = stream;
  t0 = performance.now(); // stream time counts from Start
  clearInterval(clockTimer);
  clockTimer = setInterval(() => { $("clock").textContent = fmt(streamTime()); }, 500);
  $("camera").srcObject = stream;
  const canvas = $("grab"), ctx = canvas.getContext("2d");
  const sendFrame = () => {
    const v = $("camera");
    if (!started || !v.videoWidth) return;
    canvas.width = 320; canvas.height = Math.round(320 * v.videoHeight / v.videoWidth);
    ctx.drawImage(v, 0, 0, canvas.width, canvas.height);
    canvas.toBlob(async (blob) => media(KIND.frame, await blob.arrayBuffer()), "image/jpeg", 0.7);
  };
  const restart = () => {
    clearInterval(frameTimer);
    frameTimer = setInterval(sendFrame, 1000 / Math.max(0.5, Number($("fps").value) || 1));
  };
  $("fps").onchange = restart; restart();
  if (stream.getAudioTracks().length) await startAudio(stream);
  $("start").disabled = true;
  $("stop").disabled = false;
  $("mute").disabled = !stream.getAudioTracks().length;
}

function stopMedia() {
  clearInterval(frameTimer); frameTimer = null;
  clearInterval(clockTimer); clockTimer = null;
  if (camera) camera.getTracks().forEach((t) => t.stop());
  camera = null;
  $("camera").srcObject = null;
  $("start").disabled = false; $("stop").disabled = true; $("mute").disabled = true;
  addEvent("camera and microphone stopped", "info");
}

async function startAudio(stream) {
  // the device's own rate (Firefox refuses a 16 kHz context on a 48 kHz microphone): the
  // server resamples
  const ac = new AudioContext();
  audioRate = ac.sampleRate;
  if (ws && ws.readyState === WebSocket.OPEN) {
    ws.send(JSON.stringify({ type: "audio.format", rate: audioRate }));
  }
  const worklet = `class Tap extends AudioWorkletProcessor {
    constructor() { super(); this.buf = []; this.n = 0; }
    process(inputs) {
      const ch = inputs[0][0]; if (!ch) return true;
      this.buf.push(new Float32Array(ch)); this.n += ch.length;
      if (this.n >= 4000) { this.port.postMessage(this.buf); this.buf = []; this.n = 0; }
      return true; } }
    registerProcessor("tap", Tap);`;
  await ac.audioWorklet.addModule(URL.createObjectURL(new Blob([worklet], { type: "text/javascript" })));
  const node = new AudioWorkletNode(ac, "tap");
  node.port.onmessage = (e) => {
    const total = e.data.reduce((a, b) => a + b.length, 0), pcm = new Int16Array(total);
    let i = 0;
    for (const block of e.data) for (const x of block) pcm[i++] = Math.max(-1, Math.min(1, x)) * 32767;
    if (started && !muted && camera) media(KIND.audio, pcm.buffer);
  };
  ac.createMediaStreamSource(stream).connect(node);
}

$("start").onclick = () => startMedia().catch((err) => addEvent(`media: ${err}`, "error"));
$("stop").onclick = stopMedia;
$("mute").onclick = () => {
  muted = !muted;
  $("mute").textContent = muted ? "Unmute" : "Mute";
};
$("ask").onsubmit = (e) => {
  e.preventDefault();
  const text = $("question").value.trim();
  if (!text) return;
  const id = `q${++queryCount}`;
  const box = answerBox(id);
  box.querySelector(".q").textContent = text;
  box.dataset.thinking = "1"; // until the first token
  if (!camera) {
    box.querySelector(".n").textContent =
      "asked before the camera started: the answer knows only what was typed";
  }
  if (started) sendQuestion(id, text);
  else {
    outbox.push([id, text]);
    box.querySelector(".n").textContent = "not connected: sent when the server is back";
  }
  $("question").value = "";
  follow();
};
connect();
