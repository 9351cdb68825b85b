// metalserve's page: a chat view over /v1/chat/completions and a server view over /v1/server/status.
// Plain browser JavaScript, no build step, no network beyond this server.
"use strict";

const KEY_ITEM = "metalserve-api-key";        // sessionStorage: this tab only
const CHAT_ITEM = "metalserve-conversation";  // localStorage: the conversation survives a reload
const $ = (id) => document.getElementById(id);

let conversation = loadConversation();
let controller = null;   // the running answer's AbortController
let models = [];
let pollTimer = null;

// ---- the API key ----

function apiKey() { return sessionStorage.getItem(KEY_ITEM) || ""; }

function headers(extra) {
  const h = Object.assign({ "Content-Type": "application/json" }, extra || {});
  if (apiKey()) h["Authorization"] = "Bearer " + apiKey();
  return h;
}

let keyWaiters = [];
function askForKey() {
  return new Promise((resolve) => {
    keyWaiters.push(resolve);
    const dialog = $("key-dialog");
    if (!dialog.open) { $("key-input").value = ""; dialog.showModal(); }
  });
}

$("key-form").addEventListener("submit", () => {
  sessionStorage.setItem(KEY_ITEM, $("key-input").value.trim());
  const waiters = keyWaiters; keyWaiters = [];
  waiters.forEach((w) => w());
});
$("key-button").addEventListener("click", () => askForKey().then(refreshAll));

// fetch with the key; a 401 asks for the key and tries again.
async function api(path, options) {
  for (;;) {
    const response = await fetch(path, Object.assign({}, options, { headers: headers() }));
    if (response.status !== 401) return response;
    await askForKey();
  }
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (e) { return response.status + " " + response.statusText; }
}

// ---- tabs ----

document.querySelectorAll(".tab").forEach((tab) => tab.addEventListener("click", () => {
  document.querySelectorAll(".tab").forEach((t) => t.classList.toggle("active", t === tab));
  document.querySelectorAll(".view").forEach((v) => { v.hidden = v.id !== tab.dataset.view; });
  if (tab.dataset.view === "server-view") pollStatus(); else loadModels();
}));

// ---- models ----

async function loadModels() {
  const response = await api("/v1/models");
  if (!response.ok) { $("conn").textContent = await errorText(response); return; }
  models = (await response.json()).data;
  const select = $("model-select");
  const chosen = select.value || localStorage.getItem("metalserve-model") || "";
  select.innerHTML = "";
  for (const m of models) {
    const option = document.createElement("option");
    option.value = m.id;
    option.textContent = m.id + "  (" + m.state + ")";
    select.appendChild(option);
  }
  if (models.some((m) => m.id === chosen)) select.value = chosen;
  showModelState();
  $("conn").textContent = "connected";
}

function showModelState() {
  const m = models.find((x) => x.id === $("model-select").value);
  if (!m) { $("model-state").textContent = ""; return; }
  const aliases = m.aliases && m.aliases.length ? "aliases: " + m.aliases.join(", ") + " · " : "";
  const context = m.max_model_len ? "context " + m.max_model_len + " tokens · " : "";
  $("model-state").textContent = aliases + context + m.state;
}

$("model-select").addEventListener("change", () => {
  localStorage.setItem("metalserve-model", $("model-select").value);
  showModelState();
});

// ---- the conversation ----

function loadConversation() {
  try { return JSON.parse(localStorage.getItem(CHAT_ITEM)) || []; } catch (e) { return []; }
}
function saveConversation() { localStorage.setItem(CHAT_ITEM, JSON.stringify(conversation)); }

function renderMessage(message) {
  const box = document.createElement("div");
  box.className = "message " + message.role;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = message.role === "user" ? "You" : (message.model || "assistant");
  box.appendChild(who);
  const reasoning = document.createElement("details");
  reasoning.className = "reasoning";
  reasoning.hidden = !message.reasoning;
  reasoning.innerHTML = "<summary>Reasoning</summary><div class='reasoning-text'></div>";
  reasoning.querySelector(".reasoning-text").textContent = message.reasoning || "";
  box.appendChild(reasoning);
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = message.content || "";
  box.appendChild(content);
  const note = document.createElement("div");
  note.className = "note muted";
  note.textContent = message.note || "";
  box.appendChild(note);
  $("messages").appendChild(box);
  return box;
}

function renderConversation() {
  $("messages").innerHTML = "";
  conversation.forEach(renderMessage);
  $("messages").scrollTop = $("messages").scrollHeight;
}

$("new-chat").addEventListener("click", () => {
  if (controller) controller.abort();
  conversation = []; saveConversation(); renderConversation();
});

function showError(text) {
  $("chat-error").textContent = text;
  $("chat-error").hidden = !text;
}

// ---- sending and streaming ----

$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); $("composer").requestSubmit(); }
});

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  send(text);
});

$("stop").addEventListener("click", () => { if (controller) controller.abort(); });

function requestMessages() {
  const out = [];
  const system = $("system-prompt").value.trim();
  if (system) out.push({ role: "system", content: system });
  for (const m of conversation) if (m.content || m.role === "user") out.push({ role: m.role, content: m.content });
  return out;
}

async function send(text) {
  showError("");
  conversation.push({ role: "user", content: text });
  renderMessage(conversation[conversation.length - 1]);
  const model = $("model-select").value;
  const answer = { role: "assistant", content: "", reasoning: "", model: model, note: "" };
  const box = renderMessage(answer);
  box.classList.add("streaming");
  const body = {
    model: model, messages: requestMessages(), stream: true,
    temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value),
    stream_options: { include_usage: true },
  };
  controller = new AbortController();
  $("send").disabled = true; $("stop").disabled = false;
  const started = performance.now();
  try {
    const response = await fetchStream(body, controller.signal);
    if (!response.ok) throw new Error(await errorText(response));
    await readStream(response, answer, box);
    answer.note = finishNote(answer, started);
  } catch (error) {
    if (error.name === "AbortError") answer.note = "stopped";
    else { answer.note = "error"; showError(error.message); }
  } finally {
    controller = null;
    $("send").disabled = false; $("stop").disabled = true;
    box.classList.remove("streaming");
    box.querySelector(".note").textContent = answer.note;
    conversation.push(answer); saveConversation();
    loadModels();
  }
}

async function fetchStream(body, signal) {
  for (;;) {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: signal,
    });
    if (response.status !== 401) return response;
    await askForKey();
  }
}

function finishNote(answer, started) {
  const seconds = ((performance.now() - started) / 1000).toFixed(1);
  const usage = answer.usage ? answer.usage.completion_tokens + " tokens, " : "";
  return usage + seconds + " s" + (answer.finish ? " · " + answer.finish : "");
}

// Server-sent events: "data: {json}" lines, blank-line separated, ending with "data: [DONE]".
async function readStream(response, answer, box) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, cut).trim();
      buffer = buffer.slice(cut + 1);
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") return;
      applyChunk(JSON.parse(data), answer, box);
    }
  }
}

function applyChunk(chunk, answer, box) {
  if (chunk.error) throw new Error(chunk.error.message);
  if (chunk.usage) answer.usage = chunk.usage;
  for (const choice of chunk.choices || []) {
    const delta = choice.delta || {};
    if (delta.reasoning_content) {
      answer.reasoning += delta.reasoning_content;
      const details = box.querySelector(".reasoning");
      details.hidden = false; details.open = true;
      details.querySelector(".reasoning-text").textContent = answer.reasoning;
    }
    if (delta.content) {
      answer.content += delta.content;
      box.querySelector(".content").textContent = answer.content;
    }
    if (choice.finish_reason) answer.finish = choice.finish_reason;
  }
  $("messages").scrollTop = $("messages").scrollHeight;
}

// ---- the server view ----

function bytes(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + units[i];
}
const ms = (v) => (v === null || v === undefined ? "-" : v.toFixed(1) + " ms");
const pct = (v) => (v === null || v === undefined ? "-" : (100 * v).toFixed(1) + "%");
const secs = (v) => (v === null || v === undefined ? "-" : v.toFixed(2) + " s");

function field(card, name, text) {
  let cell = card.querySelector("[data-field='" + name + "']");
  if (cell) cell.textContent = text;
}

const CARD_FIELDS = [
  ["state", "State"], ["memory", "Memory"], ["running", "Running"], ["waiting", "Waiting"],
  ["prompt_tps", "Prompt tok/s"], ["generation_tps", "Generation tok/s"], ["ttft", "TTFT p50 / p90"],
  ["tpot", "TPOT p50 / p90"], ["kv", "KV pool used"], ["prefix", "Prefix-cache hits"], ["context", "Context"],
  ["loads", "Loads"],
];

function modelCard(model) {
  let card = document.querySelector(".model-card[data-model='" + CSS.escape(model.id) + "']");
  if (card) return card;
  card = document.createElement("div");
  card.className = "model-card";
  card.dataset.model = model.id;
  const title = document.createElement("h3");
  title.textContent = model.id;
  card.appendChild(title);
  const aliases = document.createElement("div");
  aliases.className = "muted";
  aliases.textContent = model.aliases.length ? "aliases: " + model.aliases.join(", ") : "";
  card.appendChild(aliases);
  const grid = document.createElement("dl");
  for (const [name, label] of CARD_FIELDS) {
    const dt = document.createElement("dt"); dt.textContent = label;
    const dd = document.createElement("dd"); dd.dataset.field = name;
    grid.appendChild(dt); grid.appendChild(dd);
  }
  card.appendChild(grid);
  const bar = document.createElement("div"); bar.className = "bar"; bar.innerHTML = "<span></span>";
  card.appendChild(bar);
  $("model-cards").appendChild(card);
  return card;
}

function renderStatus(status) {
  $("mem-budget").textContent = bytes(status.memory.budget_bytes);
  $("mem-models").textContent = bytes(status.memory.models_bytes);
  $("mem-rss").textContent = bytes(status.memory.process_rss_bytes);
  $("requests-total").textContent = status.requests_total;
  $("uptime").textContent = Math.round(status.uptime_s) + " s";
  for (const m of status.models) {
    const card = modelCard(m);
    card.dataset.state = m.state;
    field(card, "state", m.state + (m.pinned ? " (pinned)" : ""));
    field(card, "memory", m.state === "unloaded" ? "-" : bytes(m.memory_bytes));
    field(card, "running", m.running);
    field(card, "waiting", m.waiting);
    field(card, "prompt_tps", m.prompt_tokens_per_s === undefined ? "-" : m.prompt_tokens_per_s.toFixed(1));
    field(card, "generation_tps", m.generation_tokens_per_s === undefined ? "-" : m.generation_tokens_per_s.toFixed(1));
    field(card, "ttft", m.ttft_ms ? ms(m.ttft_ms.p50) + " / " + ms(m.ttft_ms.p90) : "-");
    field(card, "tpot", m.tpot_ms ? ms(m.tpot_ms.p50) + " / " + ms(m.tpot_ms.p90) : "-");
    field(card, "kv", pct(m.kv_cache_usage));
    field(card, "prefix", pct(m.prefix_cache_hit_rate));
    field(card, "context", m.max_model_len ? m.max_model_len + " tokens" : "-");
    field(card, "loads", m.loads);
    card.querySelector(".bar span").style.width = (100 * (m.kv_cache_usage || 0)).toFixed(1) + "%";
  }
  const body = document.querySelector("#recent-requests tbody");
  body.innerHTML = "";
  for (const r of status.recent_requests) {
    const row = document.createElement("tr");
    const cells = [r.model, r.status, r.prompt_tokens, r.cached_tokens, r.output_tokens,
      r.ttft_s === null ? "-" : ms(1000 * r.ttft_s), r.tpot_s === null ? "-" : ms(1000 * r.tpot_s),
      secs(r.e2e_s), new Date(1000 * r.ended_at).toLocaleTimeString()];
    for (const c of cells) { const td = document.createElement("td"); td.textContent = c; row.appendChild(td); }
    body.appendChild(row);
  }
  $("status-updated").textContent = "Last update " + new Date().toLocaleTimeString() + ".";
}

async function pollStatus() {
  clearTimeout(pollTimer);
  if ($("server-view").hidden) return;
  try {
    const response = await api("/v1/server/status");
    if (response.ok) { renderStatus(await response.json()); $("conn").textContent = "connected"; }
    else $("conn").textContent = await errorText(response);
  } catch (error) { $("conn").textContent = "server unreachable"; }
  pollTimer = setTimeout(pollStatus, 1000);
}

function refreshAll() { loadModels(); pollStatus(); }

renderConversation();
loadModels();
