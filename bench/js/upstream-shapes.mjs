// The shapes of the upstream benchmark package (@durable-streams/benchmarks), run through the
// official TypeScript client against one server, for bench/compare.py.
//
// Usage: node upstream-shapes.mjs --base-url URL --prefix PATH [--warmup-iterations N]
//          [--latency-iterations N] [--small-iterations N] [--small-count N]
//          [--large-iterations N] [--large-count N]
//
// (a) latency: per iteration create a stream, long-poll from its tail, append 100 B and
//     receive it (once as warm-up, once measured: "rtt"), delete the stream ("cycle" is the
//     whole iteration, create to delete);
// (b) small: 1,000 appends of 100 B to one stream, 75 at a time (Promise.all, as upstream);
// (c) large: 50 appends of 1 MiB, 15 at a time.
// Each shape first runs --warmup-iterations (5) iterations that are not measured, as upstream's
// harness does: vitest's bench() runs tinybench, which calls a task at least warmupIterations
// times (5 in tinybench 2, 16 in later versions) before its measured iterations. Without them
// every shape's first iterations measure this client process's own start (its JIT, its heap)
// and the server's first requests of that size. Their figures are reported apart ("warmup_*").
// The client's DurableStream.append batches overlapping calls into one POST (its default,
// as upstream runs it). Unlike upstream, the last group is only what is left, so exactly
// the stated number of appends is sent and counted.
//
// Each (b)/(c) message is a distinct record "<tag>#<seq>|" padded with "." to its size, and
// the streams are left in place: compare.py reads them back, checks every acknowledged append
// is stored exactly once, then deletes them. Prints the report as JSON on its last line.
import { parseArgs } from "node:util"
import { DurableStream } from "@durable-streams/client"

// With bench/compare.py --auth keys, the API key every request carries.
const headers = process.env.DS_BENCH_AUTHORIZATION
  ? { Authorization: process.env.DS_BENCH_AUTHORIZATION }
  : {}

const { values } = parseArgs({
  options: {
    "base-url": { type: "string" },
    prefix: { type: "string" },
    "warmup-iterations": { type: "string", default: "5" },
    "latency-iterations": { type: "string", default: "20" },
    "small-iterations": { type: "string", default: "3" },
    "small-count": { type: "string", default: "1000" },
    "large-iterations": { type: "string", default: "2" },
    "large-count": { type: "string", default: "50" },
  },
})
const base = values["base-url"].replace(/\/$/, "")
const prefix = values.prefix
const CONTENT_TYPE = "application/octet-stream"

// With DS_BENCH_INCOMPRESSIBLE=1 (compare.py --incompressible), random letters instead of dots.
const LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
// The same noise as bench/compare.py makes (a multiplicative hash of the index), so its checks hold.
const NOISE = Buffer.alloc(2 * 1024 * 1024)
for (let i = 0; i < NOISE.length; i++) NOISE[i] = LETTERS.charCodeAt(((Math.imul(i, 2654435761) >>> 0) >>> 11) % 62)

function record(tag, seq, size) {
  const buf = Buffer.alloc(size, ".")
  if (process.env.DS_BENCH_INCOMPRESSIBLE === "1") {
    const start = (seq * 7919) % (NOISE.length - size)
    NOISE.copy(buf, 0, start, start + size)
  }
  buf.write(`${tag}#${String(seq).padStart(7, "0")}|`, 0, "latin1")
  return new Uint8Array(buf.buffer, buf.byteOffset, buf.byteLength)
}

// Resolves with the first non-empty chunk a long-poll read from `offset` receives.
async function receiveOne(handle, offset) {
  const res = await handle.stream({ offset, live: "long-poll" })
  return new Promise((resolve) => {
    const unsubscribe = res.subscribeBytes((chunk) => {
      if (chunk.data.length > 0) {
        unsubscribe()
        res.cancel()
        resolve(chunk)
      }
    })
  })
}

async function latencyIteration(index) {
  const cycleStart = performance.now()
  const handle = await DurableStream.create({
    url: `${base}/v1/stream/${prefix}/latency-${index}`,
    contentType: CONTENT_TYPE,
    headers,
  })
  const message = new Uint8Array(100).fill(42)
  let offset = (await handle.head()).offset
  // Warm-up round trip, as upstream (not measured).
  const warm = receiveOne(handle, offset)
  await handle.append(message)
  offset = (await warm).offset
  // Measured round trip: append until the long-poll delivers it.
  const read = receiveOne(handle, offset)
  const start = performance.now()
  await handle.append(message)
  const chunk = await read
  const rtt = performance.now() - start
  if (chunk.data.length !== 100 || chunk.data.some((b) => b !== 42)) {
    throw new Error(`long-poll delivered ${chunk.data.length} unexpected bytes`)
  }
  await handle.delete()
  return { rtt, cycle: performance.now() - cycleStart }
}

async function throughputIteration(kind, index, count, size, inFlight) {
  const url = `${base}/v1/stream/${prefix}/${kind}-${index}`
  const handle = await DurableStream.create({ url, contentType: CONTENT_TYPE, headers })
  const tag = `${kind[0]}${index}`
  const messages = Array.from({ length: count }, (_, seq) => record(tag, seq, size))
  const start = performance.now()
  for (let first = 0; first < count; first += inFlight) {
    await Promise.all(messages.slice(first, first + inFlight).map((m) => handle.append(m)))
  }
  const seconds = (performance.now() - start) / 1000
  return { rate: count / seconds, stream: { url, tag, count, size } }
}

const warmups = Number(values["warmup-iterations"])
const report = {
  rtt_ms: [], cycle_ms: [], small_msgs_per_s: [], large_msgs_per_s: [], streams: [],
  warmup_rtt_ms: [], warmup_cycle_ms: [], warmup_small_msgs_per_s: [], warmup_large_msgs_per_s: [],
}
// Warm-up iterations first (figures under "warmup_"), then the measured ones.
for (const [key, iterations] of [["warmup_", warmups], ["", Number(values["latency-iterations"])]]) {
  for (let i = 0; i < iterations; i++) {
    const { rtt, cycle } = await latencyIteration(`${key}${i}`)
    report[`${key}rtt_ms`].push(rtt)
    report[`${key}cycle_ms`].push(cycle)
  }
}
const throughputShapes = [
  ["small", "small-iterations", Number(values["small-count"]), 100, 75],
  ["large", "large-iterations", Number(values["large-count"]), 1 << 20, 15],
]
for (const [kind, iterationsFlag, count, size, inFlight] of throughputShapes) {
  for (const [key, iterations] of [["warmup_", warmups], ["", Number(values[iterationsFlag])]]) {
    for (let i = 0; i < iterations; i++) {
      const { rate, stream } = await throughputIteration(`${key}${kind}`, i, count, size, inFlight)
      report[`${key}${kind}_msgs_per_s`].push(rate)
      report.streams.push(stream)
    }
  }
}
console.log(JSON.stringify(report))
