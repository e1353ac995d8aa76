// The official TypeScript client with an API key (its `headers` option), for
// tests/access/test_access_features.py.
//
//   node tests/js/clients/keyed_client.mjs <stream url> <key>
//
// Creates a JSON stream, appends through an IdempotentProducer, reads it back, follows it with
// a long-poll while one more item is appended, and tries a create without the key. Prints one
// JSON object; on failure prints the reason on stderr and exits 1.
import { DurableStream, IdempotentProducer, stream } from "@durable-streams/client"

const backoffOptions = { initialDelay: 50, maxDelay: 500, multiplier: 1.5, maxRetries: 2 }
const fail = (message) => {
  process.stderr.write(`keyed_client.mjs: ${message}\n`)
  process.exit(1)
}
setTimeout(() => fail("watchdog: not done after 30 s"), 30_000)

const [url, key] = process.argv.slice(2)
if (!url || !key) fail("usage: node keyed_client.mjs <stream url> <key>")
const headers = { Authorization: `Bearer ${key}` }

try {
  const handle = await DurableStream.create({ url, contentType: "application/json", headers, backoffOptions })
  const errors = []
  const producer = new IdempotentProducer(handle, "keyed-producer", {
    lingerMs: 5,
    onError: (error) => errors.push(String(error)),
  })
  producer.append(JSON.stringify({ n: 1 }))
  producer.append(JSON.stringify({ n: 2 }))
  await producer.flush()
  if (errors.length) fail(`producer: ${errors.join("; ")}`)

  const catchUp = await stream({ url, offset: "-1", live: false, headers, backoffOptions })
  const items = await catchUp.json()

  const abort = new AbortController()
  const live = await stream({
    url, offset: catchUp.offset, live: "long-poll", headers, backoffOptions, signal: abort.signal,
  })
  const delivered = new Promise((resolve) => {
    live.subscribeJson((batch) => {
      if (batch.items.length) resolve(batch.items)
    })
  })
  await new Promise((resolve) => setTimeout(resolve, 300))
  producer.append(JSON.stringify({ live: true }))
  await producer.flush()
  items.push(...(await delivered))
  abort.abort()
  await producer.detach()

  const withoutKey = await fetch(`${url}-nokey`, {
    method: "PUT",
    headers: { "Content-Type": "application/json" },
  })
  process.stdout.write(`${JSON.stringify({ url, items, withoutKey: withoutKey.status })}\n`)
  process.exit(0)
} catch (error) {
  fail(error?.stack ?? String(error))
}
