// metalserve's page: talking to the server. The API key (this tab only), the connection state the header
// shows, and fetch with the key that asks for it again when the server refuses it.
"use strict";

const KEY_ITEM = "metalserve-api-key";  // sessionStorage: this tab only
const $ = (id) => document.getElementById(id);

// The header's word on the server: connecting, connected, unreachable, key needed, key rejected.
function setConn(state, text) {
  const conn = $("conn");
  conn.dataset.state = state;
  conn.textContent = text || state;
}

class KeyMissing extends Error {
  constructor() { super("This server needs an API key: press Key in the header to enter it."); this.name = "KeyMissing"; }
}
class Unreachable extends Error {
  constructor() { super("The server is unreachable: is it still running? The page retries on its own."); this.name = "Unreachable"; }
}

function apiKey() { return sessionStorage.getItem(KEY_ITEM) || ""; }

function headers() {
  const h = { "Content-Type": "application/json" };
  if (apiKey()) h["Authorization"] = "Bearer " + apiKey();
  return h;
}

// One dialog, any number of callers waiting on it: they all get the key, or all get KeyMissing.
let keyWaiters = [];
const KEY_MESSAGES = {
  needed: "This server needs an API key.",
  rejected: "The server rejected this key. Enter the right one.",
  change: "Change the API key this tab sends.",
};

function askForKey(reason, signal) {
  return new Promise((resolve, reject) => {
    const waiter = { resolve, reject };
    keyWaiters.push(waiter);
    const dialog = $("key-dialog");
    $("key-message").textContent = KEY_MESSAGES[reason] || KEY_MESSAGES.needed;
    $("key-message").className = reason === "rejected" ? "error" : "";
    if (!dialog.open) { $("key-input").value = ""; dialog.showModal(); }
    if (signal) signal.addEventListener("abort", () => {  // Stop or New chat while the dialog is open
      const i = keyWaiters.indexOf(waiter);
      if (i < 0) return;
      keyWaiters.splice(i, 1);
      reject(new DOMException("stopped", "AbortError"));
      if (!keyWaiters.length && dialog.open) dialog.close("cancel");
    }, { once: true });
  });
}

function closeKeyDialog(saved) {
  const dialog = $("key-dialog");
  if (dialog.open) dialog.close(saved ? "save" : "cancel");
  const waiters = keyWaiters; keyWaiters = [];
  if (saved) waiters.forEach((w) => w.resolve());
  else waiters.forEach((w) => w.reject(new KeyMissing()));
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY_ITEM, $("key-input").value.trim());
  closeKeyDialog(true);
});
$("key-cancel").addEventListener("click", () => closeKeyDialog(false));
// Escape closes a modal dialog without a submit: the waiters learn there is no key.
$("key-dialog").addEventListener("close", () => { if (keyWaiters.length) closeKeyDialog(false); });

// fetch with the key. A 401 asks for the key (saying when the one sent was refused) and tries again;
// a network failure is Unreachable; a cancelled dialog is KeyMissing; an abort stays an AbortError.
async function api(path, options) {
  options = options || {};
  for (;;) {
    let response;
    try {
      response = await fetch(path, Object.assign({}, options, { headers: headers() }));
    } catch (error) {
      if (error.name === "AbortError") throw error;
      setConn("unreachable");
      throw new Unreachable();
    }
    if (response.status !== 401) { setConn("connected"); return response; }
    const sent = apiKey();
    setConn(sent ? "rejected" : "key-needed", sent ? "key rejected" : "key needed");
    await askForKey(sent ? "rejected" : "needed", options.signal);
  }
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (e) { return response.status + " " + response.statusText; }
}
