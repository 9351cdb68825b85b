// metalserve's page: the chat view over /v1/chat/completions (the server view is server.js).
// Plain browser JavaScript, no build step, no network beyond this server.
"use strict";

const CHAT_ITEM = "metalserve-conversation";  // localStorage: the conversation survives a reload
const MODEL_ITEM = "metalserve-model";
const RETRY_MS = 3000;       // an unreachable server is asked again this often
const PROGRESS_MS = 400;     // how often the wait for the first token is described

let conversation = loadConversation();
let turn = null;             // the running answer: { controller, answer, box, dropped, responseId }
let models = [];
let reconnectTimer = null;
let modelsProblem = "";     // why the model list did not load, for the check before sending

// ---- layout: tabs and, on a narrow screen, the settings drawer ----

document.querySelectorAll(".tab").forEach((tab) => tab.addEventListener("click", () => {
  document.querySelectorAll(".tab").forEach((t) => t.classList.toggle("active", t === tab));
  document.querySelectorAll(".view").forEach((v) => { v.hidden = v.id !== tab.dataset.view; });
  setDrawer(false);
  if (tab.dataset.view === "server-view") pollStatus(); else loadModels();
}));

function setDrawer(open) {
  document.body.classList.toggle("drawer-open", open);
  $("menu-button").setAttribute("aria-expanded", String(open));
  $("drawer-backdrop").hidden = !open;
}
$("menu-button").addEventListener("click", () => setDrawer(!document.body.classList.contains("drawer-open")));
$("drawer-backdrop").addEventListener("click", () => setDrawer(false));
document.addEventListener("keydown", (e) => { if (e.key === "Escape") setDrawer(false); });

$("key-button").addEventListener("click", () => askForKey("change").then(refreshAll, () => {}));

// ---- models ----

async function loadModels() {
  clearTimeout(reconnectTimer);
  let response;
  try {
    response = await api("/v1/models");
  } catch (error) {
    $("model-state").textContent = modelsProblem = error.message;
    if (error.name === "Unreachable") reconnectTimer = setTimeout(loadModels, RETRY_MS);
    return;
  }
  if (!response.ok) { $("model-state").textContent = modelsProblem = await errorText(response); return; }
  modelsProblem = "";
  showModels((await response.json()).data);
}

// The picker lists every model with its state (kept current while a model loads for an answer).
function showModels(list) {
  models = list;
  const select = $("model-select");
  const chosen = select.value || localStorage.getItem(MODEL_ITEM) || "";
  select.innerHTML = "";
  for (const m of models) {
    const option = document.createElement("option");
    option.value = m.id;
    // A LoRA adapter is listed with its base model (`parent`, as vLLM lists it); it runs on that model.
    const kind = m.parent ? "LoRA on " + m.parent + (m.state ? ", " + m.state : "") : m.state;
    option.textContent = m.id + (kind ? "  (" + kind + ")" : "");
    select.appendChild(option);
  }
  if (models.some((m) => m.id === chosen)) select.value = chosen;
  showModelState();
}

const selectedModel = () => models.find((m) => m.id === $("model-select").value);

function showModelState() {
  const m = selectedModel();
  if (!m) { $("model-state").textContent = models.length ? "" : "The server lists no model."; return; }
  const aliases = m.aliases && m.aliases.length ? "aliases: " + m.aliases.join(", ") + " · " : "";
  const context = m.max_model_len ? "context " + m.max_model_len + " tokens · " : "";
  const state = m.state === "unloaded" ? "unloaded (it loads on the first message)" : (m.state || "");
  const adapter = m.parent ? "LoRA adapter on " + m.parent + " · " : "";
  $("model-state").textContent = adapter + aliases + context + state;
  $("lora-scale-label").hidden = !m.parent;  // the scale is an adapter's (lora_scale); the base has none
}

$("model-select").addEventListener("change", () => {
  localStorage.setItem(MODEL_ITEM, $("model-select").value);
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
  const reasoning = document.createElement("details");
  reasoning.className = "reasoning";
  reasoning.hidden = !message.reasoning;
  const summary = document.createElement("summary"); summary.textContent = "Reasoning";
  const reasoningText = document.createElement("div"); reasoningText.className = "reasoning-text";
  reasoningText.textContent = message.reasoning || "";
  reasoning.append(summary, reasoningText);
  const progress = document.createElement("div");
  progress.className = "progress muted";
  progress.hidden = true;
  const content = document.createElement("div");
  content.className = "content";
  if (message.role === "user") content.textContent = message.content || "";
  else renderMarkdown(content, message.content);
  const note = document.createElement("div");
  note.className = "note muted";
  note.textContent = message.note || "";
  box.append(who, reasoning, progress, content, note);
  $("messages").appendChild(box);
  return box;
}

function renderConversation() {
  $("messages").innerHTML = "";
  conversation.forEach(renderMessage);
  $("messages").scrollTop = $("messages").scrollHeight;
}

// New chat: the running answer is aborted and dropped, so it is neither kept nor sent as context.
$("new-chat").addEventListener("click", () => {
  if (turn) { turn.dropped = true; turn.controller.abort(); }
  conversation = []; saveConversation(); renderConversation(); showError("");
  setDrawer(false);
});

function showError(text) {
  $("chat-error").textContent = text;
  $("chat-error").hidden = !text;
}

// ---- what is sent: checked before sending ----

function readSettings() {
  const problems = [];
  const body = {};
  const temperature = $("temperature"), maxTokens = $("max-tokens");
  if (temperature.validity.badInput) problems.push("Temperature is not a number.");
  else if (temperature.value.trim() !== "") {
    const t = Number(temperature.value);
    if (!(t >= 0 && t <= 2)) problems.push("Temperature must be between 0 and 2.");
    else body.temperature = t;
  }
  const model = selectedModel();
  if (maxTokens.validity.badInput) problems.push("Max tokens is not a number.");
  else if (maxTokens.value.trim() !== "") {  // empty: the server's default (the rest of the context)
    const n = Number(maxTokens.value);
    if (!Number.isInteger(n) || n < 1) problems.push("Max tokens must be a whole number of at least 1 (or empty for the default).");
    else if (model && model.max_model_len && n >= model.max_model_len) problems.push("Max tokens must be below the model's context of " + model.max_model_len + " tokens.");
    else body.max_tokens = n;
  }
  const scale = $("lora-scale");
  if (model && model.parent) {  // an adapter: its strength (docs/lora.md: lora_scale, 0 to 8)
    if (scale.validity.badInput) problems.push("Adapter scale is not a number.");
    else if (scale.value.trim() !== "") {
      const s = Number(scale.value);
      if (!(s >= 0 && s <= 8)) problems.push("Adapter scale must be between 0 and 8.");
      else body.lora_scale = s;
    }
  }
  if (!$("model-select").value) problems.push("No model to send to: " + (modelsProblem || "the server lists none."));
  $("settings-error").textContent = problems.join(" ");
  $("settings-error").hidden = !problems.length;
  return problems.length ? { problems } : { body };
}

$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); $("composer").requestSubmit(); }
});

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || turn) return;
  const settings = readSettings();
  if (settings.problems) { showError(settings.problems.join(" ")); return; }
  $("prompt").value = "";
  send(text, settings.body);
});

$("stop").addEventListener("click", () => { if (turn) turn.controller.abort(); });

function requestMessages() {
  const out = [];
  const system = $("system-prompt").value.trim();
  if (system) out.push({ role: "system", content: system });
  for (const m of conversation) if (m.content || m.role === "user") out.push({ role: m.role, content: m.content });
  return out;
}

// ---- sending and streaming ----

async function send(text, settings) {
  showError("");
  conversation.push({ role: "user", content: text });
  renderMessage(conversation[conversation.length - 1]);
  const model = $("model-select").value;
  const answer = { role: "assistant", content: "", reasoning: "", model: model, note: "" };
  const box = renderMessage(answer);
  box.classList.add("streaming");
  $("messages").scrollTop = $("messages").scrollHeight;  // the new answer in view, however long the prompt
  const body = Object.assign({ model: model, messages: requestMessages(), stream: true,
    stream_options: { include_usage: true } }, settings);
  const current = { controller: new AbortController(), answer, box, dropped: false, responseId: null,
    started: performance.now(), waiting: true };
  turn = current;
  $("send").disabled = true; $("stop").disabled = false;
  watchFirstToken(current);
  try {
    const response = await api("/v1/chat/completions",
      { method: "POST", body: JSON.stringify(body), signal: current.controller.signal });
    if (!response.ok) throw new Error(await errorText(response));
    await readStream(response, current);
    answer.note = finishNote(answer, current.started, "max_tokens" in settings);
  } catch (error) {
    if (error.name === "AbortError") answer.note = "stopped";
    else {
      answer.note = "error";
      showError(error.name === "TypeError" ? "The connection to the server was lost during the answer." : error.message);
      if (error.name === "TypeError") setConn("unreachable");
      if (error.name === "Unreachable" || error.name === "TypeError") reconnectTimer = setTimeout(loadModels, RETRY_MS);
    }
  } finally {
    current.waiting = false;
    if (turn === current) turn = null;
    $("send").disabled = false; $("stop").disabled = true;
    box.classList.remove("streaming");
    box.querySelector(".progress").hidden = true;
    flushContent(current);
    box.querySelector(".note").textContent = answer.note;
    if (current.dropped) box.remove();
    else { conversation.push(answer); saveConversation(); }
    if (!current.dropped || !turn) loadModels();
  }
}

// Until the first token: "loading model" while the model loads (the request waits for it before the
// server answers), then the prompt's progress, tokens read of total, from /v1/server/requests/{id}.
async function watchFirstToken(current) {
  const line = current.box.querySelector(".progress");
  const known = selectedModel();
  const mayLoad = known && known.state && known.state !== "loaded";
  while (current.waiting) {
    const seconds = Math.round((performance.now() - current.started) / 1000);
    let text = "Waiting for the server… " + seconds + " s", fraction = null;
    try {
      if (current.responseId) {
        const r = await fetch("/v1/server/requests/" + encodeURIComponent(current.responseId), { headers: headers() });
        const running = r.ok ? (await r.json()).requests[0] : null;
        if (running && running.output_tokens === 0) {
          fraction = running.prompt_tokens_done / Math.max(1, running.prompt_tokens);
          text = "Reading the prompt: " + count(running.prompt_tokens_done) + " / " + count(running.prompt_tokens) +
            " tokens · " + seconds + " s";
        }
      } else if (mayLoad) {
        const r = await fetch("/v1/models", { headers: headers() });
        const list = r.ok ? (await r.json()).data : null;
        if (list && !turnIsOver(current)) showModels(list);
        const m = list ? list.find((x) => x.id === current.answer.model) : null;
        if (m && m.state !== "loaded") text = "Loading model " + m.id + "… " + seconds + " s";
      }
    } catch (e) { /* the request itself reports an unreachable server */ }
    if (!current.waiting) break;
    showProgress(line, text, fraction);
    await new Promise((resolve) => setTimeout(resolve, PROGRESS_MS));
  }
}

const turnIsOver = (current) => !current.waiting || current.dropped;

function showProgress(line, text, fraction) {
  const messages = $("messages");
  const atBottom = messages.scrollHeight - messages.scrollTop - messages.clientHeight < 40;
  line.hidden = false;
  line.textContent = text;
  if (fraction !== null) {
    const bar = document.createElement("div"); bar.className = "bar";
    const fill = document.createElement("span"); fill.style.width = (100 * fraction).toFixed(1) + "%";
    bar.appendChild(fill); line.appendChild(bar);
  }
  if (atBottom) messages.scrollTop = messages.scrollHeight;
}

function finishNote(answer, started, limited) {
  const seconds = duration((performance.now() - started) / 1000);
  const usage = answer.usage ? answer.usage.completion_tokens + " tokens, " : "";
  let end = "";
  if (answer.finish === "length") {
    end = " · cut off: " + (limited ? "the Max tokens limit was reached" : "the model's context is full");
  } else if (answer.finish && answer.finish !== "stop") end = " · " + answer.finish;
  return usage + seconds + end;
}

// Server-sent events: "data: {json}" lines, blank-line separated, ending with "data: [DONE]".
async function readStream(response, current) {
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
      applyChunk(JSON.parse(data), current);
    }
  }
}

function applyChunk(chunk, current) {
  if (chunk.error) throw new Error(chunk.error.message);
  const { answer, box } = current;
  if (chunk.id && !current.responseId) current.responseId = chunk.id;
  if (chunk.usage) answer.usage = chunk.usage;
  for (const choice of chunk.choices || []) {
    const delta = choice.delta || {};
    if (delta.reasoning_content) {
      answer.reasoning += delta.reasoning_content;
      const details = box.querySelector(".reasoning");
      details.hidden = false; details.open = true;
      details.querySelector(".reasoning-text").textContent = answer.reasoning;
    }
    if (delta.content) { answer.content += delta.content; scheduleContent(current); }
    if (delta.content || delta.reasoning_content) {
      current.waiting = false;
      box.querySelector(".progress").hidden = true;
    }
    if (choice.finish_reason) answer.finish = choice.finish_reason;
  }
}

// Markdown is re-rendered at most every 60 ms while an answer streams in.
function scheduleContent(current) {
  if (current.renderTimer) return;
  current.renderTimer = setTimeout(() => flushContent(current), 60);
}
function flushContent(current) {
  clearTimeout(current.renderTimer);
  current.renderTimer = null;
  const messages = $("messages");
  const atBottom = messages.scrollHeight - messages.scrollTop - messages.clientHeight < 40;
  renderMarkdown(current.box.querySelector(".content"), current.answer.content);
  if (atBottom) messages.scrollTop = messages.scrollHeight;
}

function refreshAll() { loadModels(); pollStatus(); }

renderConversation();
loadModels();
