// Drives the official TypeScript client (@durable-streams/client, pinned in ../package.json)
// against a running server, for tests/clients/test_typescript_client.py.
//
//   node tests/js/clients/typescript_client.mjs <stream base url>
//
// Streams are created at <base>/json (application/json) and <base>/bin
// (application/octet-stream). Every request the client makes goes through a recording fetch, so
// the Python test can check which HTTP requests delivered what. The script prints one JSON object
// on stdout; on any failure it prints the reason on stderr and exits 1. Each wait has a deadline
// and client retries are capped, so a broken server fails the script instead of hanging it.
import { DurableStream, IdempotentProducer, stream } from "@durable-streams/client"

const WAIT_MS = 10_000
const WATCHDOG_MS = 45_000
// The client's default backoff retries network errors and 5xx forever: cap it.
const backoffOptions = { initialDelay: 50, maxDelay: 500, multiplier: 1.5, maxRetries: 2 }

const started = performance.now()
const now = () => Math.round((performance.now() - started) * 10) / 10
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms))

function fail(message) {
  process.stderr.write(`typescript_client.mjs: ${message}\n`)
  process.exit(1)
}

const watchdog = setTimeout(() => fail(`watchdog: not done after ${WATCHDOG_MS} ms`), WATCHDOG_MS)

async function waitFor(predicate, what) {
  const deadline = performance.now() + WAIT_MS
  while (!predicate()) {
    if (performance.now() > deadline) throw new Error(`timed out after ${WAIT_MS} ms waiting for ${what}`)
    await sleep(10)
  }
}

/** A fetch that records each request and its response (SSE and JSON bodies as text) in `log`. */
function recordingFetch(log) {
  return async (input, init = {}) => {
    const url = new URL(typeof input === "string" ? input : input.url)
    const requestHeaders = new Headers(init.headers)
    const entry = {
      method: init.method ?? "GET",
      path: url.pathname,
      offset: url.searchParams.get("offset"),
      live: url.searchParams.get("live"),
      producerEpoch: requestHeaders.get("producer-epoch"),
      producerSeq: requestHeaders.get("producer-seq"),
      startedAt: now(),
    }
    log.push(entry)
    const response = await fetch(input, init)
    entry.headersAt = now()
    entry.status = response.status
    entry.contentType = response.headers.get("content-type")
    entry.nextOffset = response.headers.get("stream-next-offset")
    entry.upToDate = response.headers.has("stream-up-to-date")
    entry.sseDataEncoding = response.headers.get("stream-sse-data-encoding")
    const textual = /event-stream|json/.test(entry.contentType ?? "")
    if (!response.body || !textual) return response
    // Tee the body text into the log while the client consumes it.
    entry.body = ""
    const decoder = new TextDecoder()
    const recorder = new TransformStream({
      transform(chunk, controller) {
        entry.body += decoder.decode(chunk, { stream: true })
        controller.enqueue(chunk)
      },
    })
    return new Response(response.body.pipeThrough(recorder), {
      status: response.status,
      statusText: response.statusText,
      headers: response.headers,
    })
  }
}

function producerFor(handle, producerId, log, errors) {
  return new IdempotentProducer(handle, producerId, {
    lingerMs: 5,
    fetch: recordingFetch(log),
    onError: (error) => errors.push(`${error.name}: ${error.message}`),
  })
}

async function flushChecked(producer, errors, what) {
  await producer.flush() // never rejects: batch failures only reach onError
  if (errors.length) throw new Error(`IdempotentProducer failed during ${what}: ${errors.join("; ")}`)
}

/** Opens a live read at `offset`, appends once it is waiting, and returns what it delivered. */
async function liveRead({ url, offset, live, subscribe, waiting, settleMs = 0, append }) {
  const log = []
  const abort = new AbortController()
  const res = await stream({
    url, offset, live, signal: abort.signal, backoffOptions, fetch: recordingFetch(log),
  })
  const batches = []
  subscribe(res, batches)
  try {
    await waitFor(() => waiting(log), `the ${live} request to be waiting`)
    await sleep(settleMs)
    const appendedAt = now()
    await append()
    await waitFor(() => batches.some((b) => b.hasData), `the ${live} read to deliver the later append`)
    return { appendedAt, batches, requests: log, offset: res.offset }
  } finally {
    abort.abort()
  }
}

// The server has answered the SSE request with its first control event (caught up at the tail).
const sseCaughtUp = (log) => log.some((e) => e.live === "sse" && /event:\s*control/.test(e.body ?? ""))

const JSON_ROUND_1 = [{ n: 1, text: "héllo ✓" }, [1, 2, { nested: true }], "a string"]
const JSON_ROUND_2 = [42, null, { n: 2 }]
const JSON_LONG_POLL = { live: "long-poll", n: 3 }
const JSON_SSE = { live: "sse", n: 4 }

async function jsonStream(base) {
  const url = `${base}/json`
  const handle = await DurableStream.create({ url, contentType: "application/json", backoffOptions })
  const producerLog = []
  const errors = []
  const producer = producerFor(handle, "ts-json-producer", producerLog, errors)

  // Two rounds of fire-and-forget appends, each sent as one batch (seq 0, then seq 1).
  for (const item of JSON_ROUND_1) producer.append(JSON.stringify(item))
  await flushChecked(producer, errors, "round 1")
  for (const item of JSON_ROUND_2) producer.append(JSON.stringify(item))
  await flushChecked(producer, errors, "round 2")

  const catchUpLog = []
  const catchUp = await stream({
    url, offset: "-1", live: false, backoffOptions, fetch: recordingFetch(catchUpLog),
    signal: AbortSignal.timeout(WAIT_MS),
  })
  const catchUpItems = await catchUp.json()

  const subscribeJson = (res, batches) =>
    res.subscribeJson((batch) => {
      const { items, offset, upToDate } = batch
      batches.push({ items, offset, upToDate, hasData: items.length > 0 })
    })
  const appendOne = (item) => async () => {
    producer.append(JSON.stringify(item))
    await flushChecked(producer, errors, `the append of ${JSON.stringify(item)}`)
  }
  const longPoll = await liveRead({
    url, offset: catchUp.offset, live: "long-poll", subscribe: subscribeJson,
    // Give the server time to park the long-poll before appending.
    waiting: (log) => log.some((e) => e.live === "long-poll"),
    settleMs: 300,
    append: appendOne(JSON_LONG_POLL),
  })
  const sse = await liveRead({
    url, offset: longPoll.offset, live: "sse", subscribe: subscribeJson,
    // Append only once the server has sent its first control event (caught up at the tail).
    waiting: sseCaughtUp,
    append: appendOne(JSON_SSE),
  })
  await producer.detach()
  return {
    url,
    handleContentType: handle.contentType,
    producer: {
      errors, requests: producerLog, epoch: producer.epoch, nextSeq: producer.nextSeq,
      lastOffset: producer.lastSuccessfulOffset,
    },
    catchUp: {
      items: catchUpItems, offset: catchUp.offset, upToDate: catchUp.upToDate, requests: catchUpLog,
    },
    longPoll,
    sse,
  }
}

const BIN_ROUND = [[0, 1, 2, 253, 254, 255], Array.from(new TextEncoder().encode("durable"))]
const BIN_SSE = [10, 0, 13, 255, 128, 61] // \n, \r and "=" bytes: only survive SSE base64-encoded

async function binaryStream(base) {
  const url = `${base}/bin`
  const handle = await DurableStream.create({ url, contentType: "application/octet-stream", backoffOptions })
  const producerLog = []
  const errors = []
  const producer = producerFor(handle, "ts-binary-producer", producerLog, errors)
  for (const chunk of BIN_ROUND) producer.append(new Uint8Array(chunk))
  await flushChecked(producer, errors, "the binary round")

  const catchUp = await stream({
    url, offset: "-1", live: false, backoffOptions, signal: AbortSignal.timeout(WAIT_MS),
  })
  const catchUpBytes = Array.from(await catchUp.body())

  const sse = await liveRead({
    url, offset: catchUp.offset, live: "sse",
    subscribe: (res, batches) =>
      res.subscribeBytes((chunk) => {
        const { data, offset, upToDate } = chunk
        batches.push({ bytes: Array.from(data), offset, upToDate, hasData: data.length > 0 })
      }),
    waiting: sseCaughtUp,
    append: async () => {
      producer.append(new Uint8Array(BIN_SSE))
      await flushChecked(producer, errors, "the binary SSE append")
    },
  })
  await producer.detach()
  return {
    url,
    handleContentType: handle.contentType,
    producer: { errors, requests: producerLog, lastOffset: producer.lastSuccessfulOffset },
    catchUp: { bytes: catchUpBytes, offset: catchUp.offset, upToDate: catchUp.upToDate },
    sse,
  }
}

const base = process.argv[2]
if (!base) fail("usage: node typescript_client.mjs <stream base url>")
try {
  const result = { json: await jsonStream(base), binary: await binaryStream(base) }
  process.stdout.write(`${JSON.stringify(result)}\n`)
} catch (error) {
  const cause = error?.cause ? `\ncause: ${error.cause?.stack ?? error.cause}` : ""
  fail(`${error?.stack ?? String(error)}${cause}`)
}
clearTimeout(watchdog)
process.exit(0)
