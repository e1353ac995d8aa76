// The Node reference server (@durable-streams/server) with its durable file store, for
// bench/compare.py. The package ships no command line; this is the smallest one.
//
// Usage: node node-server.mjs --port PORT --data-dir DIR [--long-poll-timeout-ms MS]
//                              [--max-file-handles N]
//
// --max-file-handles: the file store keeps at most this many segment files open (its default,
// when the option is not given, is 100). The server's constructor does not pass the option
// through, so the store is replaced by one opened with it before the server starts. With the
// default, appends to more than ~100 streams at once can be answered 404 (a handle evicted
// between the write and its fdatasync: "Cannot fsync: handle not found").
//
// SIGUSR2 runs a full garbage collection (when started with node --expose-gc).
//
// Prints "listening <url>" once it accepts connections; SIGTERM/SIGINT stop it cleanly
// (the file store closes its LMDB environment and file handles).
import { parseArgs } from "node:util"
import { DurableStreamTestServer, FileBackedStreamStore } from "@durable-streams/server"

const { values } = parseArgs({
  options: {
    port: { type: "string" },
    "data-dir": { type: "string" },
    "long-poll-timeout-ms": { type: "string", default: "30000" },
    "max-file-handles": { type: "string" },
  },
})
if (!values.port || !values["data-dir"]) {
  console.error("usage: node node-server.mjs --port PORT --data-dir DIR")
  process.exit(2)
}

const server = new DurableStreamTestServer({
  host: "127.0.0.1",
  port: Number(values.port),
  dataDir: values["data-dir"], // the FileBackedStreamStore: segment files + LMDB, fdatasync per append
  longPollTimeout: Number(values["long-poll-timeout-ms"]),
})
if (values["max-file-handles"]) {
  await server.store.close()
  server.store = new FileBackedStreamStore({
    dataDir: values["data-dir"],
    maxFileHandles: Number(values["max-file-handles"]),
  })
}
const url = await server.start()
console.log(`listening ${url}`)

let stopping = false
async function stop() {
  if (stopping) return
  stopping = true
  await server.stop()
  process.exit(0)
}
process.on("SIGTERM", stop)
process.on("SIGINT", stop)
// compare.py measures memory per SSE subscriber as the difference of two resident sizes; run
// with --expose-gc, SIGUSR2 collects garbage first so that the heap's own swings do not drown it.
process.on("SIGUSR2", () => globalThis.gc?.())
