// Follows a State Protocol stream live over SSE with @durable-streams/client and materializes it
// with MaterializedState from @durable-streams/state, until the stream reaches a given offset;
// for tests/tablesync (a published table read live by the reference clients).
//
//   node tests/js/state/follow.mjs <stream url> <start offset> <until>
//
// <until> is an offset (stop once the stream reaches it) or key=<key> (stop after the first
// change event with that key).
// Writes "ready" on a line of stderr once it is up to date (a live test then writes). Prints
// one JSON object on stdout: {"entities": [{type, key, value}], "events": n,
// "controls": {kind: n}, "requests": [{offset, live, status}], "offset": "<offset reached>"};
// `reset` clears the state, as state-protocol-0.1.md 8 does. On any failure (or when the target
// is not reached within the watchdog) it prints the reason on stderr and exits 1.
import { stream } from "@durable-streams/client"
import { MaterializedState, isChangeEvent, isControlEvent } from "@durable-streams/state"

const WATCHDOG_MS = 60_000
const backoffOptions = { initialDelay: 50, maxDelay: 500, multiplier: 1.5, maxRetries: 5 }

function fail(message) {
  process.stderr.write(`follow.mjs: ${message}\n`)
  process.exit(1)
}

const watchdog = setTimeout(() => fail(`watchdog: target not reached after ${WATCHDOG_MS} ms`), WATCHDOG_MS)

function recordingFetch(log) {
  return async (input, init = {}) => {
    const url = new URL(typeof input === "string" ? input : input.url)
    const entry = { offset: url.searchParams.get("offset"), live: url.searchParams.get("live") }
    log.push(entry)
    const response = await fetch(input, init)
    entry.status = response.status
    return response
  }
}

async function main() {
  const [url, start, until] = process.argv.slice(2)
  if (!url || !start || !until) fail("usage: node follow.mjs <stream url> <start offset> <until>")
  const untilKey = until.startsWith("key=") ? until.slice(4) : null
  let sawKey = false
  const requests = []
  const state = new MaterializedState()
  const controls = {}
  let events = 0
  let ready = false
  const res = await stream({ url, offset: start, live: "sse", backoffOptions, fetch: recordingFetch(requests) })
  const reached = new Promise((resolve, reject) => {
    res.subscribeJson((batch) => {
      for (const event of batch.items) {
        events += 1
        if (isControlEvent(event)) {
          controls[event.headers.control] = (controls[event.headers.control] ?? 0) + 1
          if (event.headers.control === "reset") state.clear()
        } else if (isChangeEvent(event)) {
          state.apply(event)
          if (event.key === untilKey) sawKey = true
        } else {
          reject(new Error(`not a state event: ${JSON.stringify(event)}`))
        }
      }
      if (batch.upToDate && !ready) {
        ready = true
        process.stderr.write("ready\n")
      }
      if (untilKey === null ? batch.offset >= until : sawKey) resolve(batch.offset)
    })
  })
  const offset = await reached
  res.cancel()
  const entities = []
  for (const type of state.types) {
    for (const [key, value] of state.getType(type)) entities.push({ type, key, value })
  }
  return { entities, events, controls, requests, offset }
}

main().then(
  (report) => {
    clearTimeout(watchdog)
    process.stdout.write(`${JSON.stringify(report)}\n`)
    process.exit(0)
  },
  (error) => fail(error?.stack ?? String(error)),
)
