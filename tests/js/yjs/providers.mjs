// Drives the official Yjs provider (@durable-streams/y-durable-streams) against our server.
// Run by tests/yjs/test_yjs_providers.py:
//
//   node providers.mjs <scenario> <base url A> [<base url B>]
//
// base urls are provider baseUrls (`http://host:port/v1/yjs/<service>`); with two, client B
// talks to the second server. Prints one JSON report on stdout; exits 1 on failure.
import * as Y from "yjs"
import { Awareness } from "y-protocols/awareness"
import { YjsProvider } from "@durable-streams/y-durable-streams"

const [scenario, baseA, baseB = baseA] = process.argv.slice(2)
const docId = `providers/${scenario}-${Date.now()}-${Math.random().toString(36).slice(2, 8)}`
const requests = []

// Record every request the providers make (snapshot discovery and loads included).
const realFetch = globalThis.fetch
globalThis.fetch = async (input, init) => {
  const url = typeof input === "string" ? input : input.url
  const response = await realFetch(input, init)
  requests.push({ method: init?.method ?? "GET", url, status: response.status })
  return response
}

const watchdog = setTimeout(() => fail(new Error("watchdog: scenario took longer than 60 s")), 60_000)

function fail(error) {
  console.error(`FAILED: ${error.stack ?? error}`)
  process.exit(1)
}

function client(name, baseUrl) {
  const doc = new Y.Doc()
  const awareness = new Awareness(doc)
  const errors = []
  const provider = new YjsProvider({ doc, baseUrl, docId, awareness, connect: false })
  provider.on("error", (e) => errors.push(String(e?.message ?? e)))
  return { name, doc, awareness, provider, errors, text: () => doc.getText("text").toString() }
}

async function waitFor(what, predicate, ms = 15_000) {
  const started = Date.now()
  while (!predicate()) {
    if (Date.now() - started > ms) throw new Error(`timed out waiting for ${what}`)
    await new Promise((resolve) => setTimeout(resolve, 20))
  }
}

async function connect(c) {
  await c.provider.connect()
  if (!c.provider.synced) throw new Error(`${c.name} did not sync: ${c.errors.join("; ")}`)
}

// Concurrent edits: each client inserts at the start and at the end (the same places as the
// others, so the CRDT has to order concurrent inserts), several rounds. Inserts never split an
// earlier one, so every token stays readable in the converged text.
async function editConcurrently(clients, rounds, label) {
  for (let round = 0; round < rounds; round++) {
    for (const c of clients) {
      const text = c.doc.getText("text")
      text.insert(text.length, `${c.name}${label}${round} `)
      text.insert(0, `<${c.name}${round}>`)
    }
    await Promise.all(clients.map((c) => c.provider.flush()))
  }
}

async function converge(clients, what) {
  await waitFor(what, () => clients.every((c) => c.text() === clients[0].text() && c.text().length > 0))
  return clients[0].text()
}

async function snapshotLocation(baseUrl) {
  const response = await realFetch(`${baseUrl}/docs/${docId}?offset=snapshot`, { redirect: "manual" })
  return response.headers.get("location")
}

async function main() {
  const a = client("A", baseA)
  const b = client("B", baseB)
  const report = { docId }
  await connect(a)
  await connect(b)

  // 1. Concurrent edits converge before any compaction.
  await editConcurrently([a, b], 3, "pre")
  report.before = await converge([a, b], "convergence before compaction")
  report.locationBefore = await snapshotLocation(baseA)

  // 2. Enough edits to cross the (lowered) threshold; wait for the snapshot to appear.
  await editConcurrently([a, b], 25, "bulk")
  const started = Date.now()
  let location = await snapshotLocation(baseA)
  while (!location?.includes("_snapshot")) {
    if (Date.now() - started > 15_000) throw new Error(`no snapshot after compaction: ${location}`)
    await new Promise((resolve) => setTimeout(resolve, 50))
    location = await snapshotLocation(baseA)
  }
  report.locationAfter = location

  // 3. More concurrent edits after compaction still converge.
  await editConcurrently([a, b], 3, "post")
  report.after = await converge([a, b], "convergence after compaction")

  // 4. The snapshot itself loads in Yjs: its content is the document up to its offset. (A
  // later compaction may have replaced the one seen above: discover the current one.)
  let snapshotResponse
  for (let attempt = 0; ; attempt++) {
    report.snapshotLocation = await snapshotLocation(baseA)
    snapshotResponse = await realFetch(new URL(report.snapshotLocation, `${baseA}/`).toString())
    if (snapshotResponse.status === 200) break
    if (attempt === 5) throw new Error(`snapshot read answered ${snapshotResponse.status}`)
  }
  const snapshotBytes = new Uint8Array(await snapshotResponse.arrayBuffer())
  report.snapshotBase64 = Buffer.from(snapshotBytes).toString("base64")
  const snapshotDoc = new Y.Doc()
  Y.applyUpdate(snapshotDoc, snapshotBytes)
  report.snapshotText = snapshotDoc.getText("text").toString()
  report.snapshotNextOffset = snapshotResponse.headers.get("stream-next-offset")

  // 5. A third client joining now loads the snapshot and converges.
  const seen = requests.length
  const c = client("C", baseA)
  await connect(c)
  report.joinerRequests = requests.slice(seen).map((r) => `${r.method} ${new URL(r.url).search} ${r.status}`)
  report.joiner = await converge([a, b, c], "the late joiner converging")
  await editConcurrently([a, b, c], 2, "three")
  report.final = await converge([a, b, c], "convergence of three clients")

  // 6. Awareness: A's state change reaches B and C.
  a.awareness.setLocalStateField("user", { name: "Ada", cursor: 42 })
  await waitFor("A's awareness at B and C", () =>
    [b, c].every((peer) => peer.awareness.getStates().get(a.doc.clientID)?.user?.name === "Ada"),
  )
  report.awarenessSeenByB = b.awareness.getStates().get(a.doc.clientID)?.user

  report.errors = [a, b, c].flatMap((x) => x.errors)
  for (const x of [a, b, c]) x.provider.destroy()
  await new Promise((resolve) => setTimeout(resolve, 300))
  clearTimeout(watchdog)
  console.log(JSON.stringify(report))
  process.exit(0)
}

main().catch(fail)
