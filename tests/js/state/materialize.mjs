// Materializes a State Protocol stream with the reference implementation, for
// tests/state/test_reference_client.py.
//
//   node tests/js/state/materialize.mjs <stream url>
//
// Reads the whole stream with a catch-up read of @durable-streams/client (offset -1, every chunk
// until the server says up-to-date, then `json()` stops) and applies it with MaterializedState from
// @durable-streams/state, handling `reset` by clearing the state as state-protocol-0.1.md 8 does
// (MaterializedState.apply itself ignores control events). Prints one JSON object on stdout:
//   {"entities": [{type, key, value}, ...], "events": n, "changes": n, "controls": {kind: n},
//    "requests": [{offset, status, nextOffset, upToDate}], "offset": "<final offset>"}
// On any failure it prints the reason on stderr and exits 1.
import { stream } from "@durable-streams/client"
import { MaterializedState, isChangeEvent, isControlEvent } from "@durable-streams/state"

const WATCHDOG_MS = 45_000
// The client's default backoff retries network errors and 5xx forever: cap it.
const backoffOptions = { initialDelay: 50, maxDelay: 500, multiplier: 1.5, maxRetries: 2 }

function fail(message) {
  process.stderr.write(`materialize.mjs: ${message}\n`)
  process.exit(1)
}

const watchdog = setTimeout(() => fail(`watchdog: not done after ${WATCHDOG_MS} ms`), WATCHDOG_MS)

/** A fetch that records each request the client makes, so the test sees the catch-up reads. */
function recordingFetch(log) {
  return async (input, init = {}) => {
    const url = new URL(typeof input === "string" ? input : input.url)
    const entry = { offset: url.searchParams.get("offset"), live: url.searchParams.get("live") }
    log.push(entry)
    const response = await fetch(input, init)
    entry.status = response.status
    entry.nextOffset = response.headers.get("stream-next-offset")
    entry.upToDate = response.headers.has("stream-up-to-date")
    return response
  }
}

async function main() {
  const url = process.argv[2]
  if (!url) fail("usage: node materialize.mjs <stream url>")
  const requests = []
  // Not `live: false`: client 0.2.7 then stops after the FIRST response even when it is not
  // up-to-date (StreamResponseState.shouldContinueLive), despite documenting "stop at first
  // upToDate". In long-poll mode json() catches up chunk by chunk with plain GETs and stops at
  // the first up-to-date response, before any live request.
  const res = await stream({
    url, offset: "-1", live: "long-poll", backoffOptions, fetch: recordingFetch(requests),
  })
  const items = await res.json()

  const state = new MaterializedState()
  const controls = {}
  let changes = 0
  for (const event of items) {
    if (isControlEvent(event)) {
      controls[event.headers.control] = (controls[event.headers.control] ?? 0) + 1
      if (event.headers.control === "reset") state.clear()
    } else if (isChangeEvent(event)) {
      changes += 1
      state.apply(event)
    } else {
      throw new Error(`not a state event: ${JSON.stringify(event)}`)
    }
  }

  const entities = []
  for (const type of state.types) {
    for (const [key, value] of state.getType(type)) entities.push({ type, key, value })
  }
  return { entities, events: items.length, changes, controls, requests, offset: res.offset }
}

main().then(
  (report) => {
    clearTimeout(watchdog)
    process.stdout.write(`${JSON.stringify(report)}\n`)
  },
  (error) => fail(error?.stack ?? String(error)),
)
