// A ceiling, not a server: the least an HTTP server can do and still answer the requests
// bench/js/upstream-shapes.mjs makes (create, HEAD, append, long-poll, delete), with streams
// held in memory and nothing durable. Run against it, the TypeScript client shows how fast
// it can go when the server costs next to nothing: bench/compare.py --ceiling.
//
// Usage: node null-server.mjs --port PORT      (prints "listening <url>")
import http from "node:http"
import { parseArgs } from "node:util"

const { values } = parseArgs({ options: { port: { type: "string" } } })
const streams = new Map() // path -> { chunks: Buffer[], size: number, waiters: Function[] }
const offset = (n) => `0000000000000000_${String(n).padStart(16, "0")}`
const COMMON = { "cache-control": "no-store", "access-control-allow-origin": "*" }

function answer(res, status, headers, body) {
  res.writeHead(status, { ...COMMON, ...headers })
  res.end(body)
}

function readFrom(stream, from) {
  // Everything after byte `from`, as one buffer.
  const all = Buffer.concat(stream.chunks)
  return all.subarray(from)
}

const server = http.createServer((req, res) => {
  const url = new URL(req.url, "http://x")
  const path = url.pathname
  const parts = []
  req.on("data", (c) => parts.push(c))
  req.on("end", () => {
    const body = Buffer.concat(parts)
    let stream = streams.get(path)
    switch (req.method) {
      case "PUT":
        if (!stream) streams.set(path, (stream = { chunks: [], size: 0, type: req.headers["content-type"], waiters: [] }))
        return answer(res, 201, { "content-type": stream.type, "stream-next-offset": offset(stream.size) })
      case "DELETE":
        streams.delete(path)
        return answer(res, 204, {})
    }
    if (!stream) return answer(res, 404, {}, "not found")
    switch (req.method) {
      case "HEAD":
        return answer(res, 200, { "content-type": stream.type, "stream-next-offset": offset(stream.size) })
      case "POST": {
        stream.chunks.push(body)
        stream.size += body.length
        answer(res, 204, { "stream-next-offset": offset(stream.size) })
        for (const wake of stream.waiters.splice(0)) wake()
        return
      }
      case "GET": {
        const raw = url.searchParams.get("offset") ?? "-1"
        const from = raw === "-1" ? 0 : raw === "now" ? stream.size : Number(raw.split("_")[1])
        const send = () => {
          const data = readFrom(stream, from)
          answer(res, 200, {
            "content-type": stream.type,
            "stream-next-offset": offset(stream.size),
            "stream-up-to-date": "true",
          }, data)
        }
        if (from < stream.size || url.searchParams.get("live") !== "long-poll") return send()
        const timer = setTimeout(() => answer(res, 204, { "stream-next-offset": offset(stream.size), "stream-up-to-date": "true" }), 30000)
        stream.waiters.push(() => { clearTimeout(timer); send() })
        return
      }
    }
    answer(res, 405, {})
  })
})
server.keepAliveTimeout = 60000
server.listen(Number(values.port), "127.0.0.1", () => console.log(`listening http://127.0.0.1:${values.port}`))
process.on("SIGTERM", () => process.exit(0))
