// Pages whose content the server renders (the stream list, a state stream's entities, a Yjs
// document's content) and that follow one stream to know when it changed: each change
// fetches the fragment again (coalesced, so a burst of appends costs a few fetches).
//
// The stream list follows the registry (__registry__), where every create and delete is
// recorded, and also refreshes every PERIODIC_MS for sizes and tails that changed.

import { LiveStream, fragmentRefresher, pageConfig, statusShower } from "./live.js";

const config = pageConfig();
const target = document.getElementById("live-fragment");
const showStatus = statusShower(document.getElementById("live-status"));
const problem = document.getElementById("refresh-problem");

function fragmentUrl() {
  return target.dataset.fragmentUrl || config.fragmentUrl;
}

const refresh = fragmentRefresher(fragmentUrl, target, {
  minIntervalMs: config.minIntervalMs || 300,
  onError: (error) => {
    if (problem) {
      problem.textContent = `Could not refresh: ${error.message}`;
      problem.hidden = false;
    }
  },
});

target.addEventListener("console:refreshed", () => {
  if (problem) problem.hidden = true;
});

const live = new LiveStream({
  live: config.live,
  liveUrlEndpoint: config.liveUrlEndpoint,
  onStatus: showStatus,
  onChunk: (chunk) => {
    if (chunk.data.length) refresh();
  },
  // What followed the offset reached is gone (a trim or a compaction): the fragment is
  // rendered again and followed from the tail.
  onGone: () => {
    refresh();
    live.start("now");
  },
});
live.start(config.tail);

if (config.periodicMs) setInterval(refresh, config.periodicMs);
