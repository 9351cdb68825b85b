// metalserve's page: a model's answer as Markdown. marked parses it; any HTML the model wrote is shown as
// text, never inserted as markup; DOMPurify cleans what marked made; highlight.js colours code blocks,
// each with a Copy button. Images are not fetched (an answer must not make the browser call other hosts).
"use strict";

function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

const markdown = new marked.Marked({
  gfm: true,
  breaks: true,
  renderer: {
    html({ text }) { return escapeHtml(text); },           // raw HTML in the answer stays text
    image({ text }) { return escapeHtml("[image: " + (text || "") + "]"); },
  },
});

const PURIFY = { FORBID_TAGS: ["img", "style", "form", "input", "button", "iframe"], FORBID_ATTR: ["style"] };

// Render `text` into `element` (replacing what it held).
function renderMarkdown(element, text) {
  const html = DOMPurify.sanitize(markdown.parse(text || ""), PURIFY);
  element.innerHTML = html;
  for (const link of element.querySelectorAll("a[href]")) {
    link.target = "_blank";
    link.rel = "noopener noreferrer";
  }
  for (const code of element.querySelectorAll("pre > code")) decorateCode(code);
}

function decorateCode(code) {
  const language = (code.className.match(/language-([\w+#-]+)/) || [])[1];
  if (language && hljs.getLanguage(language)) {
    code.innerHTML = hljs.highlight(code.textContent, { language: language, ignoreIllegals: true }).value;
    code.classList.add("hljs");
  } else if (code.textContent.length < 20000) {
    const guess = hljs.highlightAuto(code.textContent);
    code.innerHTML = guess.value;
    code.classList.add("hljs");
  }
  const pre = code.parentElement;
  const bar = document.createElement("div");
  bar.className = "code-bar";
  const label = document.createElement("span");
  label.textContent = language || "";
  const copy = document.createElement("button");
  copy.type = "button";
  copy.className = "copy";
  copy.textContent = "Copy";
  copy.addEventListener("click", () => copyText(code.textContent, copy));
  bar.append(label, copy);
  pre.before(bar);
}

async function copyText(text, button) {
  let done = false;
  try {
    if (navigator.clipboard && window.isSecureContext) { await navigator.clipboard.writeText(text); done = true; }
  } catch (e) { done = false; }
  if (!done) {  // plain http from another machine: the clipboard API is off, the old way still works
    const area = document.createElement("textarea");
    area.value = text;
    area.style.position = "fixed"; area.style.opacity = "0";
    document.body.appendChild(area);
    area.select();
    try { done = document.execCommand("copy"); } catch (e) { done = false; }
    area.remove();
  }
  button.textContent = done ? "Copied" : "Copy failed";
  setTimeout(() => { button.textContent = "Copy"; }, 1500);
}
