// metalserve's page: the server view over GET /v1/server/status, refreshed every second.
"use strict";

let pollTimer = null;

function bytes(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + units[i];
}
// Durations: milliseconds below a second, seconds above, minutes above a minute.
function duration(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  if (seconds < 1) return (1000 * seconds).toFixed(seconds < 0.01 ? 1 : 0) + " ms";
  if (seconds < 60) return seconds.toFixed(seconds < 10 ? 2 : 1) + " s";
  const minutes = Math.floor(seconds / 60);
  if (minutes < 60) return minutes + " min " + Math.round(seconds % 60) + " s";
  return Math.floor(minutes / 60) + " h " + (minutes % 60) + " min";
}
const msDuration = (v) => (v === null || v === undefined ? "-" : duration(v / 1000));
const pct = (v) => (v === null || v === undefined ? "-" : (100 * v).toFixed(1) + "%");
const rate = (v) => (v === null || v === undefined ? "-" : v.toFixed(1));
const count = (v) => (v === null || v === undefined ? "-" : Number(v).toLocaleString("en-US"));

function field(card, name, text) {
  const cell = card.querySelector("[data-field='" + name + "']");
  if (cell) cell.textContent = text;
}

const CARD_FIELDS = [
  ["state", "State"], ["weights", "Weights"], ["kv_in_use", "KV pool in use"], ["kv_reserved", "KV pool reserved"],
  ["running", "Running / waiting"],
  ["prompt_tps", "Prompt tok/s"], ["generation_tps", "Output tok/s"], ["ttft", "TTFT p50 / p90"],
  ["tpot", "TPOT p50 / p90"], ["kv", "KV blocks used"], ["prefix", "Prefix-cache hits"], ["context", "Context"],
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
  const aliases = document.createElement("div");
  aliases.className = "muted small aliases";
  aliases.textContent = model.aliases.length ? "aliases: " + model.aliases.join(", ") : "";
  const grid = document.createElement("dl");
  for (const [name, label] of CARD_FIELDS) {
    const dt = document.createElement("dt"); dt.textContent = label;
    const dd = document.createElement("dd"); dd.dataset.field = name;
    grid.append(dt, dd);
  }
  const bar = document.createElement("div"); bar.className = "bar"; bar.append(document.createElement("span"));
  card.append(title, aliases, grid, bar);
  $("model-cards").appendChild(card);
  return card;
}

function renderCard(m, windowS) {
  const card = modelCard(m);
  card.dataset.state = m.state;
  const mem = m.memory;
  field(card, "state", m.state + (m.pinned ? " (pinned)" : ""));
  field(card, "weights", mem ? bytes(mem.weights_bytes) : "-");
  field(card, "kv_in_use", mem ? bytes(mem.kv_in_use_bytes) : "-");
  field(card, "kv_reserved", mem ? bytes(mem.kv_reserved_bytes) + " (budget share)" : "-");
  field(card, "running", m.running + " / " + m.waiting);
  const per = windowS ? " (last " + windowS + " s)" : "";
  card.querySelector("[data-field='prompt_tps']").previousSibling.textContent = "Prompt tok/s" + per;
  card.querySelector("[data-field='generation_tps']").previousSibling.textContent = "Output tok/s" + per;
  field(card, "prompt_tps", rate(m.prompt_tokens_per_s));
  field(card, "generation_tps", rate(m.generation_tokens_per_s));
  field(card, "ttft", m.ttft_ms ? msDuration(m.ttft_ms.p50) + " / " + msDuration(m.ttft_ms.p90) : "-");
  field(card, "tpot", m.tpot_ms ? msDuration(m.tpot_ms.p50) + " / " + msDuration(m.tpot_ms.p90) : "-");
  field(card, "kv", pct(m.kv_cache_usage));
  field(card, "prefix", pct(m.prefix_cache_hit_rate));
  field(card, "context", m.max_model_len ? count(m.max_model_len) + " tokens" : "-");
  field(card, "loads", m.loads);
  card.querySelector(".bar span").style.width = (100 * (m.kv_cache_usage || 0)).toFixed(1) + "%";
}

// The resident memory as parts that add up to it; the pools' reserved but not yet grown share apart.
const MEMORY_PARTS = [
  ["weights_bytes", "Weights", "w"], ["kv_in_use_bytes", "KV pool in use", "k"],
  ["kv_free_bytes", "KV pool grown, free", "f"], ["other_bytes", "Other (Python, buffers)", "o"],
];

function renderMemory(memory) {
  $("mem-rss").textContent = bytes(memory.process_rss_bytes);
  $("mem-budget").textContent = memory.budget_bytes ? bytes(memory.budget_bytes) : "no limit set";
  const total = MEMORY_PARTS.reduce((sum, [key]) => sum + (memory[key] || 0), 0) || 1;
  const bar = $("mem-bar"), legend = $("mem-legend");
  bar.innerHTML = ""; legend.innerHTML = "";
  for (const [key, label, cls] of MEMORY_PARTS) {
    const part = document.createElement("span");
    part.className = "part " + cls;
    part.style.width = (100 * (memory[key] || 0) / total).toFixed(2) + "%";
    bar.appendChild(part);
    const item = document.createElement("li");
    item.dataset.part = key;
    const swatch = document.createElement("i"); swatch.className = "part " + cls;
    item.append(swatch, label + " " + bytes(memory[key] || 0));
    legend.appendChild(item);
  }
  $("mem-reserved").textContent = "KV pools reserved: " + bytes(memory.kv_reserved_bytes) +
    " (each loaded model's share of the budget; " + bytes(memory.kv_not_allocated_bytes) +
    " of it not yet allocated, so not in the process memory).";
}

// A pooling request (an embedding, score or rerank input) returns a vector, not tokens: say so beside its model.
function modelLabel(r) {
  return r.kind === "pooling" ? r.model + " (pooling)" : r.model;
}

function renderRunning(running) {
  const box = $("running-requests");
  box.innerHTML = "";
  $("running-box").hidden = !running.length;
  for (const r of running) {
    const row = document.createElement("div");
    row.className = "running";
    const prefill = r.output_tokens === 0;
    const text = prefill
      ? "prompt " + count(r.prompt_tokens_done) + " / " + count(r.prompt_tokens) + " tokens"
      : count(r.output_tokens) + " tokens out";
    const label = document.createElement("span");
    label.textContent = modelLabel(r) + " · " + text + " · " + duration(r.elapsed_s);
    const bar = document.createElement("div"); bar.className = "bar";
    const fill = document.createElement("span");
    fill.style.width = (prefill ? 100 * r.prompt_tokens_done / Math.max(1, r.prompt_tokens) : 100).toFixed(1) + "%";
    bar.appendChild(fill);
    row.append(label, bar);
    box.appendChild(row);
  }
}

function renderRecent(recent) {
  const body = document.querySelector("#recent-requests tbody");
  body.innerHTML = "";
  for (const r of recent) {
    const row = document.createElement("tr");
    const cells = [modelLabel(r), r.status, count(r.prompt_tokens), count(r.cached_tokens), count(r.output_tokens),
      duration(r.ttft_s), duration(r.tpot_s), duration(r.e2e_s), new Date(1000 * r.ended_at).toLocaleTimeString()];
    for (const c of cells) { const td = document.createElement("td"); td.textContent = c; row.appendChild(td); }
    body.appendChild(row);
  }
}

function renderStatus(status) {
  renderMemory(status.memory);
  $("requests-total").textContent = count(status.requests_total) +
    (status.pooling_requests_total ? " (" + count(status.pooling_requests_total) + " pooling)" : "");
  $("uptime").textContent = duration(status.uptime_s < 60 ? Math.round(status.uptime_s) : status.uptime_s);
  for (const m of status.models) renderCard(m, m.window_s ? m.window_s.throughput : null);
  renderRunning(status.running_requests || []);
  renderRecent(status.recent_requests);
  $("status-updated").textContent = "Last update " + new Date().toLocaleTimeString() + ".";
}

async function pollStatus() {
  clearTimeout(pollTimer);
  if ($("server-view").hidden) return;
  try {
    const response = await api("/v1/server/status");
    if (response.ok) renderStatus(await response.json());
    else $("status-updated").textContent = await errorText(response);
  } catch (error) {
    $("status-updated").textContent = error.message;
    if (error.name === "KeyMissing") return;  // no key given: wait for the Key button, do not ask every second
  }
  pollTimer = setTimeout(pollStatus, 1000);
}
