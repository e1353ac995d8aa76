const orig = globalThis.fetch
const t0 = performance.now()
globalThis.fetch = async (url, init) => {
  const s = performance.now()
  const r = await orig(url, init)
  const u = new URL(url)
  console.log(`${(s - t0).toFixed(2).padStart(8)} +${(performance.now() - s).toFixed(2).padStart(6)} ${init?.method ?? "GET"} ${u.pathname.slice(-12)}${u.search} -> ${r.status}`)
  return r
}
const { DurableStream } = await import("@durable-streams/client")
const base = process.argv[2]
async function receiveOne(handle, offset) {
  const res = await handle.stream({ offset, live: "long-poll" })
  return new Promise((resolve) => {
    const unsubscribe = res.subscribeBytes((chunk) => {
      if (chunk.data.length > 0) { unsubscribe(); res.cancel(); resolve(chunk) }
    })
  })
}
for (let i = 0; i < 4; i++) {
  console.log("--- iteration", i)
  const handle = await DurableStream.create({ url: `${base}/v1/stream/trace/${Date.now()}-${i}`, contentType: "application/octet-stream" })
  const message = new Uint8Array(100).fill(42)
  let offset = (await handle.head()).offset
  const warm = receiveOne(handle, offset)
  await handle.append(message)
  offset = (await warm).offset
  console.log(`${(performance.now() - t0).toFixed(2).padStart(8)} measured start`)
  const read = receiveOne(handle, offset)
  const start = performance.now()
  await handle.append(message)
  await read
  console.log(`${(performance.now() - t0).toFixed(2).padStart(8)} rtt ${(performance.now() - start).toFixed(2)}`)
  await handle.delete()
}
