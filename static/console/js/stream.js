// A stream's page: its messages, tailing live over SSE, older ones loaded by offset, and the
// form that appends one.
//
// Under load the page must stay responsive: messages received are queued and put into the
// DOM in one batch per animation frame, and only the newest WINDOW of them are kept in the
// DOM while the view follows the tail; older ones are dropped from it and can be loaded again.
// Every message's content is set as text (textContent), never as HTML.

import { LiveStream, copyText, fetchJson, pageConfig, statusShower } from "./live.js";

const WINDOW = 500; // messages kept in the DOM while following the tail
const MAX_KEPT = 5000; // kept even while the reader scrolled away from the tail
const PER_FRAME = 1000; // messages put into the DOM per animation frame at most
const OLDER_PAGE = 50;
const HEX_BYTES_SHOWN = 4096;
const TEXT_CHARS_SHOWN = 65536;
const OFFSET_RE = /^[0-9]{16}_[0-9]{16}$/;

const config = pageConfig();
const list = document.getElementById("messages");
const pane = document.getElementById("messages-pane");
const pauseButton = document.getElementById("pause");
const olderButton = document.getElementById("load-older");
const receivedCount = document.getElementById("received-count");
const shownCount = document.getElementById("shown-count");
const tailOffset = document.getElementById("tail-offset");
const notice = document.getElementById("messages-notice");
const showStatus = statusShower(document.getElementById("live-status"));
const encoder = new TextEncoder();

let received = 0;
let queue = [];
let frameRequested = false;
let oldestShown = null; // offset of the oldest message in the DOM
let moreOlder = false;

const live = new LiveStream({
  live: config.live,
  liveUrlEndpoint: config.liveUrlEndpoint,
  onStatus: showStatus,
  onChunk: (chunk) => {
    const messages = messagesOfChunk(chunk);
    received += messages.length;
    for (const message of messages) queue.push(message);
    showTail(chunk.next);
    if (chunk.closed) setNotice("The stream is closed: nothing more will be appended.");
    scheduleFlush();
  },
  onGone: () => {
    setNotice(
      "Messages after the last one shown were trimmed or compacted away: following from the tail.",
    );
    live.start("now");
  },
});

function showTail(offset) {
  const { seq, pos } = parseOffset(offset);
  tailOffset.textContent = offset;
  document.getElementById("tail-messages").textContent = String(seq);
  document.getElementById("tail-bytes").textContent = String(pos);
}

// -- decoding --------------------------------------------------------------------------------

function base64Bytes(text) {
  const binary = atob(text.replace(/\s+/g, ""));
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i += 1) bytes[i] = binary.charCodeAt(i);
  return bytes;
}

function parseOffset(offset) {
  const [seq, pos] = offset.split("_");
  return { seq: Number(seq), pos: Number(pos) };
}

function formatOffset(seq, pos) {
  return `${String(seq).padStart(16, "0")}_${String(pos).padStart(16, "0")}`;
}

/** The top-level elements of a JSON array as the text they were sent as. */
function splitJsonArray(text) {
  const parts = [];
  let depth = 0;
  let inString = false;
  let escaped = false;
  let start = -1;
  for (let i = 0; i < text.length; i += 1) {
    const ch = text[i];
    if (inString) {
      if (escaped) escaped = false;
      else if (ch === "\\") escaped = true;
      else if (ch === '"') inString = false;
      continue;
    }
    if (ch === '"') inString = true;
    else if (ch === "[" || ch === "{") {
      depth += 1;
      if (depth === 1 && ch === "[") start = i + 1;
    } else if (ch === "]" || ch === "}") {
      if (depth === 1 && ch === "]" && i > start && text.slice(start, i).trim()) {
        parts.push(text.slice(start, i));
      }
      depth -= 1;
    } else if (ch === "," && depth === 1) {
      parts.push(text.slice(start, i));
      start = i + 1;
    }
  }
  return parts;
}

/**
 * The messages of one chunk (the data events before a control event). A JSON chunk is an
 * array of messages, each stored as the text received, so each one's offset is known from
 * their sizes. Text and binary chunks have no boundaries on the wire (PROTOCOL.md 5.8): a
 * chunk is one entry, with the number of messages it holds.
 */
function messagesOfChunk({ data, start, next }) {
  if (!data.length) return [];
  const from = parseOffset(start);
  const to = parseOffset(next);
  if (config.kind === "json") {
    const parts = data.flatMap((payload) => splitJsonArray(payload));
    const sizes = parts.map((part) => encoder.encode(part).length);
    const exact = sizes.reduce((a, b) => a + b, 0) === to.pos - from.pos;
    let pos = from.pos;
    return parts.map((part, i) => {
      const message = {
        offset: exact || i === 0 ? formatOffset(from.seq + i, pos) : null,
        seq: from.seq + i,
        count: 1,
        size: sizes[i],
        text: part,
      };
      pos += sizes[i];
      return message;
    });
  }
  const message = { offset: start, seq: from.seq, count: to.seq - from.seq, size: to.pos - from.pos };
  if (config.kind === "text") message.text = data.join("\n");
  else message.bytes = concat(data.map(base64Bytes));
  return [message];
}

function concat(arrays) {
  if (arrays.length === 1) return arrays[0];
  const out = new Uint8Array(arrays.reduce((n, a) => n + a.length, 0));
  let at = 0;
  for (const array of arrays) {
    out.set(array, at);
    at += array.length;
  }
  return out;
}

// -- rendering -------------------------------------------------------------------------------

function hex(bytes) {
  const shown = bytes.subarray(0, HEX_BYTES_SHOWN);
  const lines = [];
  for (let i = 0; i < shown.length; i += 16) {
    const row = Array.from(shown.subarray(i, i + 16), (b) => b.toString(16).padStart(2, "0"));
    lines.push(row.join(" "));
  }
  return lines.join("\n");
}

function prettyJson(text) {
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    return text;
  }
}

function plural(n, word) {
  return `${n} ${word}${n === 1 ? "" : "s"}`;
}

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function renderMessage(message) {
  const item = element("li", "message");
  item.dataset.seq = String(message.seq);
  if (message.offset) item.dataset.offset = message.offset;
  const meta = element("div", "message-meta");
  if (message.offset) {
    meta.append(element("code", "offset", message.offset));
    const copy = element("button", "copy", "copy offset");
    copy.type = "button";
    copy.dataset.offset = message.offset;
    meta.append(copy);
  } else {
    meta.append(element("span", "offset", `message ${message.seq}`));
  }
  const size = message.bytes ? message.bytes.length : message.size;
  let sizeText = plural(message.size, "byte");
  if (message.count > 1) sizeText = `${plural(message.count, "message")}, ${sizeText}`;
  meta.append(element("span", "size", sizeText));
  item.append(meta);

  let body;
  let cut = message.truncated;
  if (message.bytes !== undefined) {
    body = element("pre", "body hex", hex(message.bytes));
    cut = cut || size > HEX_BYTES_SHOWN;
  } else {
    const text = config.kind === "json" ? prettyJson(message.text) : message.text;
    body = element("pre", `body ${config.kind}`, text.slice(0, TEXT_CHARS_SHOWN));
    cut = cut || text.length > TEXT_CHARS_SHOWN;
  }
  item.append(body);
  if (cut) item.append(element("div", "cut", "(only the beginning is shown)"));
  return item;
}

function followingTail() {
  return pane.scrollHeight - pane.scrollTop - pane.clientHeight < 40;
}

function scheduleFlush() {
  if (frameRequested) return;
  frameRequested = true;
  requestAnimationFrame(flush);
}

/** Put queued messages into the DOM in one batch, then keep the window. */
function flush() {
  frameRequested = false;
  const follow = followingTail();
  const batch = queue.length > PER_FRAME ? queue.splice(0, PER_FRAME) : queue;
  if (batch === queue) queue = [];
  const fragment = document.createDocumentFragment();
  for (const message of batch) fragment.append(renderMessage(message));
  list.append(fragment);
  trim(follow ? WINDOW : MAX_KEPT);
  if (follow) pane.scrollTop = pane.scrollHeight;
  updateCounts();
  if (queue.length) scheduleFlush();
}

function trim(keep) {
  let excess = list.children.length - keep;
  if (excess <= 0) return;
  while (excess > 0) {
    list.firstElementChild.remove();
    excess -= 1;
  }
  moreOlder = true;
  rememberOldest();
}

function rememberOldest() {
  const first = list.querySelector("li[data-offset]");
  oldestShown = first ? first.dataset.offset : oldestShown;
  olderButton.hidden = !moreOlder;
}

function updateCounts() {
  receivedCount.textContent = String(received);
  shownCount.textContent = String(list.children.length);
}

function setNotice(text) {
  notice.textContent = text;
  notice.hidden = !text;
}

// -- older messages --------------------------------------------------------------------------

function storedMessage(stored) {
  const message = {
    offset: stored.offset,
    seq: parseOffset(stored.offset).seq,
    count: 1,
    size: stored.size,
    truncated: stored.truncated,
  };
  const bytes = base64Bytes(stored.data);
  if (config.kind === "binary") message.bytes = bytes;
  else message.text = new TextDecoder().decode(bytes);
  return message;
}

/** Put stored messages before `before` at the top of the list. */
async function loadOlder(before, limit = OLDER_PAGE) {
  const params = new URLSearchParams({ before, limit: String(limit) });
  const answer = await fetchJson(`${config.messagesUrl}?${params}`);
  const fragment = document.createDocumentFragment();
  for (const stored of answer.messages) fragment.append(renderMessage(storedMessage(stored)));
  const height = pane.scrollHeight;
  list.prepend(fragment);
  pane.scrollTop += pane.scrollHeight - height; // keep what the reader was looking at
  moreOlder = answer.more;
  rememberOldest();
  updateCounts();
  return answer;
}

olderButton.addEventListener("click", async () => {
  olderButton.disabled = true;
  try {
    await loadOlder(oldestShown || config.tail);
    setNotice("");
  } catch (error) {
    setNotice(`Could not load older messages: ${error.message}`);
  } finally {
    olderButton.disabled = false;
  }
});

// -- controls --------------------------------------------------------------------------------

let paused = false;

pauseButton.addEventListener("click", () => {
  paused = !paused;
  pauseButton.textContent = paused ? "Resume" : "Pause";
  pauseButton.setAttribute("aria-pressed", String(paused));
  if (paused) live.stop("paused");
  else live.resume();
});

list.addEventListener("click", async (event) => {
  const button = event.target.closest("button.copy");
  if (!button) return;
  const copied = await copyText(button.dataset.offset);
  button.textContent = copied ? "copied" : "copy failed";
  setTimeout(() => {
    button.textContent = "copy offset";
  }, 1500);
});

document.getElementById("goto-offset").addEventListener("submit", async (event) => {
  event.preventDefault();
  const input = event.target.elements.offset;
  const offset = input.value.trim();
  if (!OFFSET_RE.test(offset)) {
    setNotice("An offset is 16 digits, '_' and 16 digits (copy one from a message).");
    return;
  }
  try {
    live.stop();
    list.replaceChildren();
    received = 0;
    queue = [];
    await loadOlder(offset, 10);
    setNotice(`Reading from ${offset}: the messages before it are shown above it.`);
    if (!paused) live.start(offset);
    else live.offset = offset;
  } catch (error) {
    setNotice(`Cannot read from there: ${error.message}`);
  }
});

// -- appending -------------------------------------------------------------------------------

const appendForm = document.getElementById("append-form");
if (appendForm) {
  const result = document.getElementById("append-result");
  appendForm.addEventListener("submit", async (event) => {
    event.preventDefault();
    const button = appendForm.querySelector("button[type=submit]");
    button.disabled = true;
    try {
      const answer = await fetchJson(config.appendUrl, {
        method: "POST",
        body: new FormData(appendForm),
      });
      result.textContent = `Appended: the tail is now ${answer.next_offset}.`;
      result.dataset.outcome = "ok";
    } catch (error) {
      result.textContent = `Not appended (${error.status || "error"}): ${error.message}`;
      result.dataset.outcome = "error";
    } finally {
      button.disabled = false;
    }
  });
}

// -- start -----------------------------------------------------------------------------------

loadOlder(config.tail).catch((error) => setNotice(`Could not load the latest messages: ${error.message}`));
if (config.closed) {
  showStatus("closed");
  setNotice("The stream is closed: nothing more will be appended.");
} else {
  live.start(config.tail);
}
