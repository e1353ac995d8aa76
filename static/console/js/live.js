// Following a stream over SSE (PROTOCOL.md 5.8) with a signed read URL, as any browser client
// of the protocol does, and helpers the console's pages share.
//
// The browser's EventSource would reconnect by itself, but to the URL it was given, that is
// from the first offset again: each reconnection is made here instead, from the last
// `streamNextOffset` received, with a fresh signed URL when the one held is about to expire.

const REFRESH_BEFORE_EXPIRY_SECS = 60;
const MAX_BACKOFF_MS = 10000;

/** The JSON config a page's template put in a <script type="application/json"> element. */
export function pageConfig(id = "console-config") {
  const element = document.getElementById(id);
  return element ? JSON.parse(element.textContent) : {};
}

/** A JSON answer of the console's own endpoints (same origin, session cookie). */
export async function fetchJson(url, options = {}) {
  const response = await fetch(url, {
    credentials: "same-origin",
    headers: { Accept: "application/json", ...(options.headers || {}) },
    ...options,
  });
  let body = null;
  try {
    body = await response.json();
  } catch {
    body = { error: `the server answered ${response.status}` };
  }
  if (!response.ok) {
    const error = new Error((body && body.error) || `the server answered ${response.status}`);
    error.status = response.status;
    throw error;
  }
  return body;
}

/**
 * Follows one stream. `onChunk({data, start, next, upToDate, closed})` is called for each
 * control event with the data events before it (`data`: their payloads, as received), `start`
 * and `next` the offsets around them. `onStatus(status, detail)` tells "connecting", "live",
 * "paused", "closed" or "error". `onGone()` is called, following stopped, when the offset
 * reached is gone (410: a trim or a compaction dropped what follows it).
 */
export class LiveStream {
  constructor({ live, liveUrlEndpoint, onChunk, onStatus, onGone }) {
    this.signed = live;
    this.liveUrlEndpoint = liveUrlEndpoint;
    this.onChunk = onChunk;
    this.onStatus = onStatus || (() => {});
    this.onGone = onGone || null;
    this.source = null;
    this.offset = null;
    this.cursor = null;
    this.pendingData = [];
    this.failures = 0;
    this.timer = null;
    this.running = false;
  }

  /** Start following from `offset` ("-1", "now" or an offset of the stream). */
  start(offset) {
    this.stop();
    this.offset = offset;
    this.running = true;
    this._connect();
  }

  /** Stop following; `resume()` goes on from the last offset received. */
  stop(status) {
    this.running = false;
    clearTimeout(this.timer);
    this.timer = null;
    if (this.source) {
      this.source.close();
      this.source = null;
    }
    this.pendingData = [];
    if (status) this.onStatus(status);
  }

  resume() {
    if (!this.running && this.offset !== null) this.start(this.offset);
  }

  async _connect() {
    this.onStatus("connecting");
    try {
      await this._freshUrl();
    } catch (error) {
      this._retry(error.message);
      return;
    }
    if (!this.running) return;
    const params = new URLSearchParams({ offset: this.offset, live: "sse" });
    if (this.cursor) params.set("cursor", this.cursor);
    const source = new EventSource(`${this.signed.url}&${params}`);
    this.source = source;
    source.addEventListener("data", (event) => {
      this.pendingData.push(event.data);
    });
    source.addEventListener("control", (event) => this._control(event));
    source.addEventListener("open", () => this.onStatus("live"));
    source.addEventListener("error", () => {
      if (this.source !== source) return;
      // The server ends each connection after a while (PROTOCOL.md 10.2), or it failed:
      // either way, connect again from the last offset received.
      source.close();
      this.source = null;
      this.pendingData = [];
      if (this.running) this._retry("disconnected");
    });
  }

  _control(event) {
    let control;
    try {
      control = JSON.parse(event.data);
    } catch {
      return;
    }
    const data = this.pendingData;
    this.pendingData = [];
    const start = this.offset;
    this.offset = control.streamNextOffset || start;
    this.cursor = control.streamCursor || this.cursor;
    this.failures = 0;
    this.onChunk({
      data,
      start,
      next: this.offset,
      upToDate: Boolean(control.upToDate),
      closed: Boolean(control.streamClosed),
    });
    if (control.streamClosed) this.stop("closed");
  }

  async _freshUrl() {
    const remaining = this.signed.expires - Date.now() / 1000;
    if (remaining > REFRESH_BEFORE_EXPIRY_SECS && this.failures < 2) return;
    this.signed = await fetchJson(this.liveUrlEndpoint);
  }

  _retry(detail) {
    this.failures += 1;
    const delay = Math.min(MAX_BACKOFF_MS, 250 * 2 ** Math.min(this.failures, 6));
    this.onStatus(this.failures > 1 ? "error" : "connecting", detail);
    clearTimeout(this.timer);
    this.timer = setTimeout(async () => {
      if (!this.running) return;
      if (this.failures >= 2 && this.onGone && (await this._gone())) {
        this.stop("paused");
        this.onGone();
        return;
      }
      if (this.running) this._connect();
    }, delay);
  }

  // An EventSource cannot see its answer's status: a 410 (what follows the offset was trimmed
  // or compacted away) looked like any failure and was retried for ever. After a second
  // failure in a row, a catch-up read at the offset tells.
  async _gone() {
    try {
      const params = new URLSearchParams({ offset: this.offset });
      const response = await fetch(`${this.signed.url}&${params}`);
      return response.status === 410;
    } catch {
      return false;
    }
  }
}

/**
 * Fetches a server-rendered fragment again into `target` when `trigger()` is called: at most
 * one request at a time and one per `minIntervalMs`; triggers meanwhile are folded into the
 * next request. The fragment is HTML the server rendered and escaped.
 */
export function fragmentRefresher(url, target, { minIntervalMs = 300, onError } = {}) {
  let inFlight = false;
  let again = false;
  let last = 0;
  let timer = null;

  async function run() {
    timer = null;
    inFlight = true;
    again = false;
    last = Date.now();
    try {
      const response = await fetch(url(), { credentials: "same-origin" });
      if (!response.ok) throw new Error(`the server answered ${response.status}`);
      target.innerHTML = await response.text();
      target.dispatchEvent(new CustomEvent("console:refreshed", { bubbles: true }));
    } catch (error) {
      if (onError) onError(error);
    } finally {
      inFlight = false;
      if (again) trigger();
    }
  }

  function trigger() {
    if (inFlight) {
      again = true;
      return;
    }
    if (timer) return;
    timer = setTimeout(run, Math.max(0, minIntervalMs - (Date.now() - last)));
  }

  return trigger;
}

/** Shows a LiveStream's status in an element with `data-status`. */
export function statusShower(element) {
  const labels = {
    connecting: "connecting…",
    live: "live",
    paused: "paused",
    closed: "closed",
    error: "reconnecting…",
  };
  return (status, detail) => {
    if (!element) return;
    element.dataset.status = status;
    element.textContent = labels[status] || status;
    element.title = detail || "";
  };
}

/** Copies `text` to the clipboard; resolves to whether it worked. */
export async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch {
    const input = document.createElement("textarea");
    input.value = text;
    input.setAttribute("readonly", "");
    input.className = "offscreen";
    document.body.append(input);
    input.select();
    const copied = document.execCommand("copy");
    input.remove();
    return copied;
  }
}
