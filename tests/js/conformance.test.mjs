// Runs the official Durable Streams conformance suite against CONFORMANCE_TEST_URL.
// Driven by tests/conformance/test_conformance.py (which starts the server). DS_SUBSCRIPTIONS
// turns on the opt-in subscription group (PROTOCOL.md 6, 7).
import { runConformanceTests } from "@durable-streams/server-conformance-tests"

runConformanceTests({
  baseUrl: process.env.CONFORMANCE_TEST_URL,
  longPollTimeoutMs: Number(process.env.CONFORMANCE_LONG_POLL_TIMEOUT_MS ?? 2000),
  subscriptions: process.env.DS_SUBSCRIPTIONS === "true",
})
